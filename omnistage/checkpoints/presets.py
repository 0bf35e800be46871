"""Sizes of the built-in test checkpoints and the Qwen3-Omni `config.json` they produce."""

from __future__ import annotations

from dataclasses import dataclass, field

import transformers

from omnistage.checkpoints.tokenizer import TokenizerIds

# generate() suppresses the top 1024 talker ids (all but codec_eos): every codec special id lives there.
TALKER_SPECIAL_RANGE = 1024
# Codec special ids relative to the codebook size, as in the real checkpoint (codebook 2048: pad 2148 ...).
_CODEC_OFFSETS = {
    "codec_pad_id": 100,
    "codec_bos_id": 101,
    "codec_eos_token_id": 102,
    "codec_nothink_id": 107,
    "codec_think_bos_id": 108,
    "codec_think_eos_id": 109,
}
_SPEAKER_OFFSETS = {"chelsie": 253, "ethan": 254, "aiden": 255}
_STORAGE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DecoderSpec:
    """A Qwen3-style decoder stack (attention + MLP or MoE)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int = 0  # 0: dense MLP
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 0 < self.top_k <= self.num_experts:
                raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
            if self.moe_intermediate_size <= 0:
                raise ValueError("an MoE stack needs moe_intermediate_size > 0")

    def mrope_section(self) -> list[int]:
        # Same proportions as the real [24, 20, 20] for head_dim 128; the sections sum to head_dim / 2.
        half = self.head_dim // 2
        hw = half * 20 // 64
        return [half - 2 * hw, hw, hw]


@dataclass(frozen=True)
class Code2WavSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    decoder_dim: int
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    sliding_window: int = 72

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must divide by num_heads {self.num_heads}")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must divide by 2**{len(self.upsample_rates)}")

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in (*self.upsample_rates, *self.upsampling_ratios):
            n *= r
        return n


@dataclass(frozen=True)
class EncoderSpec:
    """Audio and vision towers: always built by transformers, so kept tiny in every preset."""

    audio_d_model: int = 16
    audio_layers: int = 1
    audio_heads: int = 2
    audio_ffn: int = 32
    audio_downsample: int = 8
    vision_hidden: int = 16
    vision_depth: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 32
    vision_position_embeddings: int = 64
    vision_deepstack: tuple[int, ...] | None = None  # blocks that feed deepstack features (None: every block)

    def __post_init__(self) -> None:
        if self.vision_deepstack is not None and not all(0 <= i < self.vision_depth for i in self.vision_deepstack):
            raise ValueError(f"vision_deepstack {self.vision_deepstack} must index blocks 0..{self.vision_depth - 1}")


@dataclass(frozen=True)
class Preset:
    name: str
    thinker: DecoderSpec
    talker: DecoderSpec
    code_predictor: DecoderSpec
    code2wav: Code2WavSpec
    num_code_groups: int
    codebook_size: int
    accept_hidden_layer: int
    encoders: EncoderSpec = field(default_factory=EncoderSpec)
    storage_dtype: str = "float32"
    bpe_vocab_size: int = 735

    def __post_init__(self) -> None:
        if not self.thinker.num_experts or not self.talker.num_experts:
            raise ValueError("thinker and talker are MoE stacks")
        if self.talker.shared_expert_intermediate_size <= 0:
            raise ValueError("the talker MoE has a shared expert")
        if self.code_predictor.num_experts:
            raise ValueError("the code predictor is dense")
        if self.code_predictor.hidden_size != self.talker.hidden_size:
            raise ValueError("code predictor hidden size must equal the talker hidden size")
        if not 0 <= self.accept_hidden_layer <= self.thinker.num_layers:
            raise ValueError(f"accept_hidden_layer must be in [0, {self.thinker.num_layers}]")
        if self.num_code_groups < 2:
            raise ValueError("num_code_groups must be >= 2")
        if self.codebook_size <= 0:
            raise ValueError("codebook_size must be positive")
        if self.storage_dtype not in _STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {_STORAGE_DTYPES}")

    @property
    def talker_vocab_size(self) -> int:
        return self.codebook_size + TALKER_SPECIAL_RANGE


_TINY = Preset(
    name="tiny",
    thinker=DecoderSpec(64, 2, 4, 2, 16, 128, num_experts=4, top_k=2, moe_intermediate_size=64),
    talker=DecoderSpec(
        64, 2, 4, 2, 16, 128, num_experts=4, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    code_predictor=DecoderSpec(64, 2, 4, 2, 16, 128),
    code2wav=Code2WavSpec(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, decoder_dim=64),
    num_code_groups=16,
    codebook_size=64,
    accept_hidden_layer=1,
)

_TINY_GQA = Preset(
    name="tiny-gqa",
    thinker=DecoderSpec(64, 2, 8, 2, 24, 128, num_experts=4, top_k=2, moe_intermediate_size=64),
    talker=DecoderSpec(
        64, 2, 8, 2, 24, 128, num_experts=4, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    code_predictor=DecoderSpec(64, 2, 8, 2, 24, 128),
    code2wav=Code2WavSpec(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, decoder_dim=64),
    num_code_groups=8,
    codebook_size=64,
    accept_hidden_layer=1,
)

_SMALL = Preset(
    name="small",
    thinker=DecoderSpec(768, 12, 12, 4, 64, 2048, num_experts=16, top_k=4, moe_intermediate_size=384),
    talker=DecoderSpec(
        512, 8, 8, 2, 64, 1024, num_experts=16, top_k=4, moe_intermediate_size=256, shared_expert_intermediate_size=512
    ),
    code_predictor=DecoderSpec(512, 3, 8, 4, 64, 1536),
    code2wav=Code2WavSpec(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768, decoder_dim=512),
    num_code_groups=16,
    codebook_size=2048,
    accept_hidden_layer=6,
    # Towers in proportion to the thinker, as the real model's are (1280-wide 32-layer audio, 1152-wide
    # 27-layer vision with 3 deepstack taps, for a 2048-wide thinker); 24x24 learned vision positions.
    encoders=EncoderSpec(
        audio_d_model=384, audio_layers=4, audio_heads=6, audio_ffn=1536, audio_downsample=128,
        vision_hidden=384, vision_depth=4, vision_heads=6, vision_intermediate=1536,
        vision_position_embeddings=576, vision_deepstack=(1, 2, 3),
    ),
    storage_dtype="bfloat16",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (_TINY, _TINY_GQA, _SMALL)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def _rope(spec: DecoderSpec, mrope: bool) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": 1000000.0}
    if mrope:
        rope.update(mrope_section=spec.mrope_section(), interleaved=True, mrope_interleaved=True)
    return rope


def _decoder_fields(spec: DecoderSpec) -> dict:
    out = {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "max_position_embeddings": 32768,
    }
    if spec.num_experts:
        out.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def build_config_dict(preset: Preset, ids: TokenizerIds) -> dict:
    """The `config.json` contents: Qwen3-Omni layout, the preset's sizes, the tokenizer's ids.

    It also writes the three fields transformers 5.x reads without declaring them
    (`talker_config.spatial_merge_size`, `talker_config.text_config.shared_expert_intermediate_size`,
    `thinker_config.vision_start_token_id`).
    """
    enc = preset.encoders
    cb = preset.codebook_size
    thinker_text = {
        "model_type": "qwen3_omni_moe_text",
        "vocab_size": ids.vocab_size,
        **_decoder_fields(preset.thinker),
        "rope_parameters": _rope(preset.thinker, mrope=True),
        "tie_word_embeddings": False,
    }
    audio = {
        "model_type": "qwen3_omni_moe_audio_encoder",
        "num_mel_bins": 128,
        "d_model": enc.audio_d_model,
        "encoder_layers": enc.audio_layers,
        "encoder_attention_heads": enc.audio_heads,
        "encoder_ffn_dim": enc.audio_ffn,
        "downsample_hidden_size": enc.audio_downsample,
        "output_dim": preset.thinker.hidden_size,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
        "activation_function": "gelu",
        "scale_embedding": False,
    }
    vision = {
        "model_type": "qwen3_omni_moe_vision_encoder",
        "depth": enc.vision_depth,
        "hidden_size": enc.vision_hidden,
        "num_heads": enc.vision_heads,
        "intermediate_size": enc.vision_intermediate,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": preset.thinker.hidden_size,
        "num_position_embeddings": enc.vision_position_embeddings,
        # Tiny: every block feeds a deepstack feature (with a 2-layer thinker, features join after layers 0, 1).
        "deepstack_visual_indexes": list(range(enc.vision_depth) if enc.vision_deepstack is None
                                         else enc.vision_deepstack),
    }
    multimodal_ids = {
        "audio_token_id": ids.audio_pad,
        "image_token_id": ids.image_pad,
        "video_token_id": ids.video_pad,
        "audio_start_token_id": ids.audio_start,
        "audio_end_token_id": ids.audio_end,
        "vision_start_token_id": ids.vision_start,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
    }
    thinker = {
        "model_type": "qwen3_omni_moe_thinker",
        "text_config": thinker_text,
        "audio_config": audio,
        "vision_config": vision,
        **multimodal_ids,
        "vision_end_token_id": ids.vision_end,
        "user_token_id": ids.user,
        "tie_word_embeddings": False,
    }
    talker_text = {
        "model_type": "qwen3_omni_moe_talker_text",
        "vocab_size": preset.talker_vocab_size,
        **_decoder_fields(preset.talker),
        "rope_parameters": _rope(preset.talker, mrope=True),
    }
    code_predictor = {
        "model_type": "qwen3_omni_moe_talker_code_predictor",
        "vocab_size": cb,
        **_decoder_fields(preset.code_predictor),
        "rope_parameters": _rope(preset.code_predictor, mrope=False),
        "num_code_groups": preset.num_code_groups,
    }
    talker = {
        "model_type": "qwen3_omni_moe_talker",
        "text_config": talker_text,
        "code_predictor_config": code_predictor,
        "num_code_groups": preset.num_code_groups,
        "thinker_hidden_size": preset.thinker.hidden_size,
        "accept_hidden_layer": preset.accept_hidden_layer,
        **{k: cb + off for k, off in _CODEC_OFFSETS.items()},
        "speaker_id": {name: cb + off for name, off in _SPEAKER_OFFSETS.items()},
        **multimodal_ids,
        "spatial_merge_size": 2,
    }
    c2w = preset.code2wav
    code2wav = {
        "codebook_size": cb,
        "num_quantizers": preset.num_code_groups,
        "hidden_size": c2w.hidden_size,
        "num_hidden_layers": c2w.num_layers,
        "num_attention_heads": c2w.num_heads,
        "num_key_value_heads": c2w.num_heads,
        "intermediate_size": c2w.intermediate_size,
        "decoder_dim": c2w.decoder_dim,
        "upsample_rates": list(c2w.upsample_rates),
        "upsampling_ratios": list(c2w.upsampling_ratios),
        "sliding_window": c2w.sliding_window,
        "layer_scale_initial_scale": 0.01,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "attention_bias": False,
    }
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "enable_audio_output": True,
        "im_start_token_id": ids.im_start,
        "im_end_token_id": ids.im_end,
        "tts_pad_token_id": ids.tts_pad,
        "tts_bos_token_id": ids.tts_bos,
        "tts_eos_token_id": ids.tts_eos,
        "system_token_id": ids.system,
        "user_token_id": ids.user,
        "assistant_token_id": ids.assistant,
        "thinker_config": thinker,
        "talker_config": talker,
        "code2wav_config": code2wav,
        "dtype": preset.storage_dtype,
        "transformers_version": transformers.__version__,
    }


def build_generation_config_dict(ids: TokenizerIds) -> dict:
    return {
        "bos_token_id": ids.endoftext,
        "eos_token_id": [ids.im_end, ids.endoftext],
        "pad_token_id": ids.endoftext,
        "transformers_version": transformers.__version__,
    }


# The processor's side of the checkpoint, in the real Qwen3-Omni layout: one preprocessor_config.json for the
# Whisper feature extractor and the Qwen2-VL image processor (16-pixel patches, merged 2x2: factor 32), and
# the video processor's settings next to it.
_PIXELS = {
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "resample": 3,  # bicubic
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def build_preprocessor_config_dict() -> dict:
    return {
        "processor_class": "Qwen3OmniMoeProcessor",
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 300,
        "n_samples": 4800000,
        "nb_max_frames": 30000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor",
        **_PIXELS,
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 4 * 4096,
    }


def build_video_preprocessor_config_dict() -> dict:
    """Qwen2-VL video processor settings (frame size limits come from the Qwen3-Omni processor's defaults)."""
    return {
        "processor_class": "Qwen3OmniMoeProcessor",
        "video_processor_type": "Qwen2VLVideoProcessor",
        "do_sample_frames": False,
        **_PIXELS,
        "min_pixels": 128 * 32 * 32,
        "max_pixels": 768 * 32 * 32,
    }
