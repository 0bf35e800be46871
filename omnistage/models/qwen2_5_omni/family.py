"""Qwen2.5-Omni as a model family: Thinker (AR, text) -> Talker (AR, one codec token per step) -> Token2Wav
(generation: DiT + BigVGAN, streamed in overlapping windows).

Declares the parts and bridges the runtime builds, renders chat prompts (text, or text/audio/image/video parts
through ``processor``; the speech system prompt as the default system turn), maps voices to the speakers of
``spk_dict.pt`` and turns one user request into the per-stage requests. Per-request data travels in
``StageRequest.data``: the Thinker's ``speech`` flag, media and media placeholder rows, the Talker's prompt
length and voice, Token2Wav's voice and noise seed.
"""

from __future__ import annotations

import math
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
from omnistage.models.layers.fast_linear import fast_kernels
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.qwen2_5_omni.bridges import TalkerToToken2Wav, ThinkerToTalker, talker2token2wav_args
from omnistage.models.qwen2_5_omni.decoder import decoder_config
from omnistage.models.qwen2_5_omni.loading import (
    ARCHITECTURE,
    THINKER_ARCHITECTURE,
    load_config,
    load_media_encoders,
    load_talker,
    load_thinker,
    load_thinker_embedding,
    load_token2wav,
)
from omnistage.models.qwen2_5_omni.processor import Qwen25OmniInputProcessor
from omnistage.models.qwen2_5_omni.prompt import with_speech_system_prompt
from omnistage.models.qwen2_5_omni.stage_models import (
    MEDIA_ROWS_KEY,
    SAMPLE_RATE,
    SPEECH_KEY,
    TALKER_POSITIONS_KEY,
    TalkerStageModel,
    ThinkerStageModel,
    Token2WavStageModel,
)
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan
from omnistage.models.qwen2_5_omni.talker import TalkerTokenIds
from omnistage.models.qwen2_5_omni.tmrope import talker_positions
from omnistage.models.qwen2_5_omni.voices import SPEAKER_FILE, Speaker, load_speakers, resolve_voice
from omnistage.models.qwen3_omni.family import TOWER_LAYERS
from omnistage.models.qwen3_omni.family import quant_scheme as qwen3_quant_scheme
from omnistage.models.qwen3_omni.mrope import MediaSpan
from omnistage.models.qwen3_omni.processor import (
    MediaItem,
    ThinkerMedia,
    media_data,
    media_modalities,
    thinker_media,
)
from omnistage.models.registry import register_family
from omnistage.models.tool_calls import QWEN_TOOL_CALLS

PREFERRED_VOICE = "chelsie"  # transformers' generate(speaker="Chelsie") default
INT8_LAYERS = {"thinker": TOWER_LAYERS, "talker": ()}  # (the Talker has no code predictor)




@register_family
class Qwen25OmniFamily(HFChatFamily):
    name = "qwen2_5_omni"
    tool_calls = QWEN_TOOL_CALLS
    architectures = (ARCHITECTURE, THINKER_ARCHITECTURE)
    preset_file = "qwen2_5_omni.yaml"
    wire_types = (ThinkerMedia, MediaItem, MediaSpan)
    parts = {
        "thinker": PartSpec(ExecutionType.AR, ModelCapabilities(supports_full_graph_aux_outputs=True), ("thinker.",)),
        "talker": PartSpec(ExecutionType.AR, weight_prefixes=("talker.",)),
        "token2wav": PartSpec(ExecutionType.GENERATION, weight_prefixes=("token2wav.",), float32_weights=True),
    }
    bridges = {
        "thinker2talker": BridgeSpec(no_args),
        "talker2token2wav": BridgeSpec(talker2token2wav_args),
    }
    sample_rate = SAMPLE_RATE
    num_code_groups = 1  # one codec token per Talker step

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        self.config = load_config(self.model_dir)
        self.thinker_prefix, self.parts = thinker_layout(self.model_dir, THINKER_ARCHITECTURE, self.parts)
        self.ids = TalkerTokenIds.from_config(self.config)
        # One Talker step (codec token) reads one answer token and becomes `repeats` mel frames of `hop` samples.
        t2w = self.config.token2wav_config
        self.samples_per_frame = int(t2w.dit_config.repeats) * math.prod(t2w.bigvgan_config.upsample_rates)
        has_speakers = (self.model_dir / SPEAKER_FILE).is_file()
        self.speaks = bool(getattr(self.config, "enable_audio_output", True))
        self.speakers: dict[str, Speaker] = load_speakers(self.model_dir) if has_speakers and self.speaks else {}
        # The API names voices in lower case; resolve_voice maps them back to the spk_dict.pt keys.
        self.voices = tuple(sorted(name.lower() for name in self.speakers))
        if self.voices:
            self.default_voice = PREFERRED_VOICE if PREFERRED_VOICE in self.voices else self.voices[0]

    # ---- stage side ---------------------------------------------------------------------------------
    def quant_scheme(self, part: str, quantization: Quantization) -> QuantScheme | None:
        """As Qwen3-Omni's (``qwen3_omni.family.quant_scheme``): the Thinker's and the Talker's decoder layers in
        the configured format (int4 or int8), the towers' layers in int8; embeddings, heads, projections and
        Token2Wav in the serving dtype."""
        return qwen3_quant_scheme(part, quantization, INT8_LAYERS)

    def kv_geometry(self, part: str) -> tuple[int, int, int] | None:
        cfg = {"thinker": self.config.thinker_config.text_config, "talker": self.config.talker_config}.get(part)
        if cfg is None:
            return None
        d = decoder_config(cfg)
        return d.num_layers, d.num_kv_heads, d.head_dim

    def build_model(self, ctx: BuildContext) -> Any:
        part = ctx.stage.model_part
        scheme = self.quant_scheme(part, ctx.quantization)
        if part == "thinker":
            thinker = load_thinker(self.model_dir, self.config, ctx.dtype, ctx.device, self.thinker_prefix, scheme,
                                   ctx.fast)
            encoders = load_media_encoders(self.model_dir, self.config, ctx.dtype, ctx.device, ctx.fast,
                                           self.thinker_prefix, scheme)
            return ThinkerStageModel(fast_kernels(thinker, ctx.fast), encoders)
        if part == "talker":
            talker = load_talker(self.model_dir, self.config, ctx.dtype, ctx.device, scheme, ctx.fast)
            talker = fast_kernels(talker, ctx.fast)
            # The Talker reads a few rows of the Thinker's embedding table (text specials, speaker bos rows).
            ids = [talker.ids.text_eos, talker.ids.text_pad, *(s.bos_token for s in self.speakers.values())]
            embed = load_thinker_embedding(self.model_dir, ids, ctx.dtype, ctx.device)
            return TalkerStageModel.for_speakers(talker, embed, self.speakers)
        if part == "token2wav":
            return Token2WavStageModel(fast_kernels(load_token2wav(self.model_dir, self.config, ctx.device), ctx.fast))
        raise ValueError(f"unknown part {part!r}")

    def build_bridge(self, name: str, model: Any, args: Mapping[str, Any]) -> Any:
        if name == "thinker2talker":
            return ThinkerToTalker(model.ids)
        if name == "talker2token2wav":
            dit = model.token2wav.code2wav_dit_model
            return TalkerToToken2Wav(
                ChunkPlan(**args), dit.block_size, dit.repeats, dit.mel_dim, model.token2wav.tail > 0
            )
        raise ValueError(f"unknown bridge {name!r}")

    # ---- request side -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config.thinker_config.text_config.vocab_size)

    @cached_property
    def input_processor(self) -> Qwen25OmniInputProcessor | None:
        """Audio/image/video parts -> prompt + media (None: the checkpoint has no preprocessor_config.json)."""
        if not (self.model_dir / "preprocessor_config.json").is_file():
            return None
        return Qwen25OmniInputProcessor(self.model_dir, self.tokenizer, self.config)

    @cached_property
    def input_modalities(self) -> tuple[str, ...]:
        """Text, plus audio and image + video for the towers the checkpoint holds (with its processor files)."""
        return media_modalities(self.model_dir, self.thinker_prefix)

    def render_prompt(
        self, messages: Sequence[Mapping[str, Any]], use_audio_in_video: bool = False, answer_prefix: str = "",
        **kwargs: Any
    ) -> PreparedPrompt:
        """Messages with string content, or lists of text/audio/image/video parts (``use_audio_in_video``:
        videos bring their audio track, interleaved in 2-second chunks). A conversation without a system turn
        gets Qwen2.5-Omni's speech system prompt (the model speaks only under it), whether or not this request
        asks for audio: a request's text then does not depend on its modalities. ``answer_prefix``: see
        ``ModelFamily``."""
        if kwargs:
            raise ValueError(f"unknown prompt options {sorted(kwargs)}")
        self.check_roles(messages)
        self.check_chat_template()
        for m in messages:
            if not isinstance(m.get("content"), (str, list, tuple)):
                raise ValueError("message content must be a string or a list of content parts")
        if all(isinstance(m["content"], str) for m in messages):
            if use_audio_in_video:
                raise ValueError("use_audio_in_video needs a video part")
            return PreparedPrompt(self.chat_template_ids(with_speech_system_prompt(messages), answer_prefix))
        if self.input_processor is None:
            raise ValueError(f"{self.model_dir} has no preprocessor_config.json: content parts are not supported")
        for mi, m in enumerate(messages):
            for pi, part in enumerate(() if isinstance(m["content"], str) else m["content"]):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in ("audio", "image", "video") and kind not in self.input_modalities:
                    raise ValueError(f"messages[{mi}].content[{pi}]: this model takes no {kind} input "
                                     f"(input modalities {list(self.input_modalities)})")
        return self.input_processor(messages, use_audio_in_video=use_audio_in_video, answer_prefix=answer_prefix)

    def stage_requests(
        self,
        req_id: str,
        prompt: PreparedPrompt,
        stages: Sequence[StageConfig],
        params: Mapping[str, SamplingParams],
        voice: str | None,
    ) -> dict[str, StageRequest]:
        ids = tuple(prompt.token_ids)
        by_part = {s.model_part: s for s in stages}
        out: dict[str, StageRequest] = {}
        media = thinker_media(prompt.data)
        if media is not None and media.positions.shape[0] != len(ids):
            raise ValueError("the prompt's media positions do not cover its token ids; render it again")
        thinker_data: dict[str, Any] = media_data(media)
        if "talker" in by_part:
            if not self.speakers:
                raise ValueError(f"this checkpoint has no {SPEAKER_FILE}: request modalities ['text'] only")
            speaker = resolve_voice(voice or self.default_voice, self.speakers)  # unknown: lists the voices
            talker = by_part["talker"]
            need = len(ids) + 2
            if need > talker.scheduler.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; the Talker (max_model_len "
                                 f"{talker.scheduler.max_model_len}) can speak for at most "
                                 f"{talker.scheduler.max_model_len - 2}")
            thinker_data[SPEECH_KEY] = True
            if media is not None:
                rows = torch.zeros(len(ids), dtype=torch.bool)
                for item in media.items:
                    rows[item.rows] = True
                thinker_data[MEDIA_ROWS_KEY] = rows
            talker_params = params[talker.name]
            talker_data: dict[str, Any] = {"num_prompt": len(ids), "voice": speaker}
            if media is not None and media.prompt_positions is not None:
                talker_data[TALKER_POSITIONS_KEY] = talker_positions(media.prompt_positions)
            out[talker.name] = StageRequest(req_id, talker_params, None, self.ids.eos_ids, talker_data)
            if "token2wav" in by_part:
                # The ODE's initial noise follows the request's seed (the Talker's): seeded requests repeat.
                out[by_part["token2wav"].name] = StageRequest(req_id, data={"voice": speaker,
                                                                            "seed": talker_params.seed})
        elif "token2wav" in by_part:
            raise ValueError("the token2wav stage needs the talker stage")
        thinker = by_part["thinker"]
        out[thinker.name] = StageRequest(req_id, params[thinker.name], ids, self.eos_token_ids, thinker_data)
        return out
