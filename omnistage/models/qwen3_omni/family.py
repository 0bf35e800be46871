"""Qwen3-Omni as a model family: Thinker (AR) -> Talker (AR, codec frames) -> Code2Wav (generation).

Declares the parts and bridges the runtime builds, renders chat prompts, maps voices to the Talker's
speaker ids and turns one user request into the per-stage requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from omnistage.config import ExecutionType, ModelCapabilities, StageConfig
from omnistage.config.quantization import Quantization
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import (
    BridgeSpec,
    BuildContext,
    HFChatFamily,
    PartSpec,
    PreparedPrompt,
    StageRequest,
    no_args,
    thinker_layout,
)
from omnistage.models.layers.fast_linear import fast_kernels, pack_on_load
from omnistage.models.layers.quant import QuantFormat
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.loader import building, checkpoint_files, load_embedding_rows, load_into
from omnistage.models.prequantized import read_stored
from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.bridges import TalkerToCode2Wav, ThinkerToTalker, talker2code2wav_args
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omnistage.models.qwen3_omni.config import ARCHITECTURE, THINKER_ARCHITECTURE, load_config
from omnistage.models.qwen3_omni.encoder_cache import MediaEncoders
from omnistage.models.qwen3_omni.mrope import MediaSpan
from omnistage.models.qwen3_omni.processor import (
    MediaItem,
    Qwen3OmniInputProcessor,
    ThinkerMedia,
    media_data,
    media_modalities,
    thinker_media,
)
from omnistage.models.qwen3_omni.stage_models import Code2WavStageModel, TalkerStageModel, ThinkerStageModel
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.talker_inputs import (
    TalkerTokenIds,
    talker_media_spans,
    talker_prompt_rows,
    text_specials,
)
from omnistage.models.qwen3_omni.thinker import Thinker
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder
from omnistage.models.registry import register_family
from omnistage.models.tool_calls import QWEN_TOOL_CALLS
from omnistage.runtime_env import cpu_computes_bf16

PREFERRED_VOICE = "ethan"
TOWER_LAYERS = ("audio_tower.layers.", "visual.blocks.")  # (relative to "thinker.") what quantization covers




def _media_encoders(model_dir: Path, config: Any, dtype: torch.dtype, device: str, fast: bool,
                    scheme: QuantScheme | None = None, thinker: str = "thinker.") -> MediaEncoders:
    """The Thinker's audio and vision towers, when the checkpoint holds them; ``scheme``: the Thinker part's
    quantization (names relative to the Thinker's prefix ``thinker``)."""
    names = checkpoint_files(model_dir)
    towers: dict[str, Any] = {}
    # Derived tables (sinusoids, rotary frequencies) are computed here; a checkpoint that stores them anyway
    # is not an error.
    for attr, tower, cls, cfg, derived in (
        ("audio", "audio_tower.", AudioEncoder, config.thinker_config.audio_config, "positional_embedding."),
        ("vision", "visual.", VisionEncoder, config.thinker_config.vision_config, "rotary_pos_emb."),
    ):
        prefix = thinker + tower
        if not any(n.startswith(prefix) for n in names):
            towers[attr] = None
            continue
        tower_scheme = scheme.within(tower) if scheme is not None else None
        with building(dtype, device, init=False):
            tower = cls(cfg)
        load_into(tower, model_dir, prefix, dtype, skip=(derived,), quantize=tower_scheme)
        towers[attr] = fast_kernels(tower.eval(), fast, many_rows=True)
    return MediaEncoders(towers["audio"], towers["vision"])


# Per quantized part, the layers (relative to the part) in int8 beside its decoder layers (see ``quant_scheme``).
INT8_LAYERS = {"thinker": TOWER_LAYERS, "talker": ("code_predictor.model.layers.",)}


def quant_scheme(part: str, quantization: Quantization,
                 int8_layers: Mapping[str, tuple[str, ...]] = INT8_LAYERS) -> QuantScheme | None:
    """Qwen3-Omni's quantized weights. Under int4: the Thinker's and Talker's decoder layers (attention
    projections, routed and shared experts) in int4; the code predictor's layers in int8 (its 15 passes per
    frame compound rounding; int8 keeps its codes close, ``benchmarks/quant_accuracy.py``), and so are the audio
    and vision towers' layers (int8: 0.6% per-layer error; they are 2.2 GiB in bfloat16 at the released widths,
    1.1 GiB of which int8 saves is what lets the whole model fit 21 GiB). Under int8 all of these in int8 (per
    channel, or in the configured groups). Embeddings, output heads, routers, the projections, the towers'
    convolutions and mergers and Code2Wav keep the serving dtype (an int8 Thinker head was measured: half the
    bytes, but no clear gain at one request and slower from 8 rows up, docs/quantization.md). ``int8_layers``: per
    part quantized, its int8 layers (another family's: Qwen2.5-Omni's Talker has no code predictor)."""
    if not quantization.enabled or part not in int8_layers:
        return None
    if quantization.method == "int8":
        int8 = decoder = QuantFormat(8, quantization.group_size)
    else:
        int8, decoder = QuantFormat(8), QuantFormat(4, quantization.int4_group)
    formats = {"model.layers.": decoder}
    formats.update({prefix: int8 for prefix in int8_layers[part]})
    return QuantScheme(formats)


@register_family
class Qwen3OmniFamily(HFChatFamily):
    name = "qwen3_omni"
    tool_calls = QWEN_TOOL_CALLS
    architectures = (ARCHITECTURE, THINKER_ARCHITECTURE)
    preset_file = "qwen3_omni.yaml"
    wire_types = (ThinkerMedia, MediaItem, MediaSpan)
    parts = {
        "thinker": PartSpec(ExecutionType.AR, ModelCapabilities(supports_full_graph_aux_outputs=True), ("thinker.",)),
        "talker": PartSpec(ExecutionType.AR, ModelCapabilities(supports_full_graph_aux_outputs=True), ("talker.",)),
        "code2wav": PartSpec(ExecutionType.GENERATION, weight_prefixes=("code2wav.",)),
    }
    bridges = {
        "thinker2talker": BridgeSpec(no_args),
        "talker2code2wav": BridgeSpec(talker2code2wav_args),
    }

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        self.config = load_config(self.model_dir)
        self.thinker_prefix, self.parts = thinker_layout(self.model_dir, THINKER_ARCHITECTURE, self.parts)
        self.stored_quantization = read_stored(self.model_dir)  # a pre-quantized checkpoint's scheme (or refusal)
        self.ids = TalkerTokenIds.from_config(self.config)
        talker = self.config.talker_config
        self.speaks = bool(getattr(self.config, "enable_audio_output", True))
        speakers = (talker.speaker_id or {}) if self.speaks else {}
        self.speakers = {str(k).lower(): int(v) for k, v in speakers.items()}
        self.voices = tuple(self.speakers)
        if self.speakers:
            self.default_voice = PREFERRED_VOICE if PREFERRED_VOICE in self.speakers else self.voices[0]
        code2wav = Code2WavConfig.from_hf(self.config.code2wav_config)
        self.sample_rate, self.samples_per_frame = code2wav.sample_rate, code2wav.samples_per_frame
        self.num_code_groups = int(talker.num_code_groups)

    # ---- stage side ---------------------------------------------------------------------------------
    def quant_scheme(self, part: str, quantization: Quantization) -> QuantScheme | None:
        return quant_scheme(part, quantization)

    def weight_dtype(self, part: str, dtype: torch.dtype, device: str) -> torch.dtype:
        """Code2Wav runs in float32 where bfloat16 would be served on a CPU without bfloat16 arithmetic: there
        torch's bfloat16 GEMMs and convolutions fall back to slow paths (the released widths, AVX2, 2 threads:
        37 of 50 s of a spoken answer were Code2Wav's bfloat16 addmm and dilated convolutions); float32 costs
        its 0.22 B parameters 0.4 GiB more."""
        if part == "code2wav" and dtype == torch.bfloat16 and torch.device(device).type == "cpu" \
                and not cpu_computes_bf16():
            return torch.float32
        return super().weight_dtype(part, dtype, device)

    def kv_geometry(self, part: str) -> tuple[int, int, int] | None:
        cfg = {"thinker": self.config.thinker_config, "talker": self.config.talker_config}.get(part)
        if cfg is None:
            return None
        text = cfg.text_config
        return text.num_hidden_layers, text.num_key_value_heads, text.head_dim

    def build_model(self, ctx: BuildContext) -> Any:
        part = ctx.stage.model_part
        if part == "thinker":
            scheme = self.quant_scheme(part, ctx.quantization)
            with building(ctx.dtype, ctx.device, init=False):
                thinker = Thinker(self.config)
            load_into(thinker, self.model_dir, self.thinker_prefix, ctx.dtype, skip=("audio_tower.", "visual."),
                      quantize=scheme, loaded=pack_on_load(ctx.fast))
            encoders = _media_encoders(self.model_dir, self.config, ctx.dtype, ctx.device, ctx.fast, scheme,
                                       self.thinker_prefix)
            return ThinkerStageModel(fast_kernels(thinker.eval(), ctx.fast), encoders)
        if part == "talker":
            scheme = self.quant_scheme(part, ctx.quantization)
            with building(ctx.dtype, ctx.device, init=False):
                talker = Talker(self.config)
            load_into(talker, self.model_dir, "talker.", ctx.dtype, quantize=scheme, loaded=pack_on_load(ctx.fast))
            # The projected tts specials need three of the Thinker's embedding rows (only those are read).
            specials_ids = [self.ids.tts_pad, self.ids.tts_bos, self.ids.tts_eos]
            embed = load_embedding_rows(self.model_dir, "thinker.model.embed_tokens.weight", specials_ids,
                                        ctx.dtype, ctx.device)
            with torch.inference_mode():
                specials = text_specials(talker.eval(), embed, self.ids)
            fast_kernels(talker, ctx.fast).code_predictor.warm_up()
            return TalkerStageModel(talker, self.ids, specials)
        if part == "code2wav":
            dtype = self.weight_dtype(part, ctx.dtype, ctx.device)
            with building(dtype, ctx.device, init=False):
                code2wav = Code2Wav(self.config.code2wav_config)
            load_into(code2wav, self.model_dir, "code2wav.", dtype)
            return Code2WavStageModel(fast_kernels(code2wav.eval(), ctx.fast))
        raise ValueError(f"unknown part {part!r}")

    def build_bridge(self, name: str, model: Any, args: Mapping[str, Any]) -> Any:
        if name == "thinker2talker":
            return ThinkerToTalker(model)
        if name == "talker2code2wav":
            return TalkerToCode2Wav(**args)
        raise ValueError(f"unknown bridge {name!r}")

    # ---- request side -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config.thinker_config.text_config.vocab_size)

    @cached_property
    def input_processor(self) -> Qwen3OmniInputProcessor | None:
        """Audio/image/video parts -> prompt + media (None: the checkpoint has no preprocessor_config.json)."""
        if not (self.model_dir / "preprocessor_config.json").is_file():
            return None
        return Qwen3OmniInputProcessor(self.model_dir, self.tokenizer, self.config)

    @cached_property
    def input_modalities(self) -> tuple[str, ...]:
        """Text, plus audio and image + video for the towers the checkpoint holds (with its processor files)."""
        return media_modalities(self.model_dir, self.thinker_prefix)

    def render_prompt(
        self, messages: Sequence[Mapping[str, Any]], use_audio_in_video: bool = False, answer_prefix: str = "",
        **kwargs: Any
    ) -> PreparedPrompt:
        """Messages with string content, or lists of text/audio/image/video parts (``use_audio_in_video``:
        videos bring their audio track, interleaved by time; ``answer_prefix``: see ``ModelFamily``)."""
        if kwargs:
            raise ValueError(f"unknown prompt options {sorted(kwargs)}")
        self.check_roles(messages)
        self.check_chat_template()
        for m in messages:
            if not isinstance(m.get("content"), (str, list, tuple)):
                raise ValueError("message content must be a string or a list of content parts")
        if all(isinstance(m["content"], str) for m in messages):
            return PreparedPrompt(self.chat_template_ids(messages, answer_prefix))
        if self.input_processor is None:
            raise ValueError(f"{self.model_dir} has no preprocessor_config.json: content parts are not supported")
        return self.input_processor(messages, use_audio_in_video=use_audio_in_video, answer_prefix=answer_prefix)

    def stage_requests(
        self,
        req_id: str,
        prompt: PreparedPrompt,
        stages: Sequence[StageConfig],
        params: Mapping[str, SamplingParams],
        voice: str | None,
    ) -> dict[str, StageRequest]:
        ids = list(prompt.token_ids)
        parts = {s.model_part: s.name for s in stages}
        out: dict[str, StageRequest] = {}
        media = thinker_media(prompt.data)
        if media is not None and media.positions.shape[0] != len(ids):
            raise ValueError("the prompt's media positions do not cover its token ids; render it again")
        thinker_data: dict[str, Any] = media_data(media)
        if "talker" in parts:
            if not self.speakers:
                raise ValueError("this checkpoint has no speakers; request modalities ['text'] only")
            name = (voice or self.default_voice).lower()
            if name not in self.speakers:
                raise ValueError(f"unknown voice {voice!r}; available: {sorted(self.speakers)}")
            # Media placeholder rows of user turns (even ones typed as text) take accept-layer rows, as in
            # transformers; the other rows the Talker reads take layer-0 embeddings.
            thinker_data["talker_rows"], thinker_data["talker_hidden_rows"] = talker_prompt_rows(ids, self.ids)
            talker_data: dict[str, Any] = {"prompt_ids": tuple(ids), "speaker_id": self.speakers[name]}
            if media is not None:
                talker_data["media_spans"] = talker_media_spans(media.spans, ids, self.ids)
            talker = parts["talker"]
            out[talker] = StageRequest(req_id, params[talker], None, (self.config.talker_config.codec_eos_token_id,),
                                       talker_data)
        if "code2wav" in parts:
            out[parts["code2wav"]] = StageRequest(req_id)
        thinker = parts["thinker"]
        out[thinker] = StageRequest(req_id, params[thinker], tuple(ids), self.eos_token_ids, thinker_data)
        return out
