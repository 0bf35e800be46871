"""Sizes of the built-in Qwen2.5-Omni test checkpoints and the `config.json` they produce.

Layout follows Qwen2.5-Omni-7B/3B: a dense Qwen2.5 Thinker (q/k/v bias, no q/k norm), a dense Talker whose
codec embedding lives in the Thinker's width (``embedding_size``) and is projected by ``thinker_to_talker_proj``,
and a Token2Wav = flow-matching DiT (block attention, ECAPA speaker encoder) + BigVGAN.

Id layout mirrors the real checkpoint relative to its sizes:
- Talker vocab = codebook + 256, codec specials at codebook + 100 (pad), 101 (bos), 102 (eos), 104 (mask).
- Thinker embedding rows past the tokenizer's last id hold the Talker's text-side specials (tts pad/start/end)
  and the speakers' bos rows, as in the real model (151859... lie past the tokenizer's 151664).
- The DiT's code table covers every Talker id (the real one stops at the codebook + 1): a random-weight
  Talker may emit any id, and transformers' Token2Wav would fail on one outside its table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import transformers

from omnistage.checkpoints.presets import DecoderSpec, EncoderSpec
from omnistage.checkpoints.presets import (
    build_preprocessor_config_dict as build_qwen3_preprocessor_config_dict,
)
from omnistage.checkpoints.qwen2_5_omni.tokenizer import Qwen25TokenIds
from omnistage.models.qwen2_5_omni.bigvgan import check_geometry

TALKER_EXTRA_IDS = 256
_CODEC_OFFSETS = {
    "tts_codec_pad_token_id": 100,
    "tts_codec_start_token_id": 101,
    "tts_codec_end_token_id": 102,
    "tts_codec_mask_token_id": 104,
}
# Thinker rows past the tokenizer (offset from the tokenizer size).
_TTS_TEXT_OFFSETS = {"tts_text_pad_token_id": 1, "tts_text_start_token_id": 2, "tts_text_end_token_id": 3}
SPEAKERS = ("Chelsie", "Ethan")
_SPEAKER_BOS_OFFSET = 8
_THINKER_VOCAB_MULTIPLE = 64
_STORAGE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DiTSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    ff_mult: int
    emb_dim: int
    block_size: int  # mel frames per attention block
    look_ahead_layers: tuple[int, ...]
    look_backward_layers: tuple[int, ...]
    enc_emb_dim: int  # speaker `cond` width
    enc_dim: int  # ECAPA output width
    enc_channels: tuple[int, ...]
    enc_attention_channels: int
    enc_se_channels: int
    mel_dim: int = 80
    repeats: int = 2
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_res2net_scale: int = 2

    def __post_init__(self) -> None:
        if not (len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations)):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if any(c % self.enc_res2net_scale for c in self.enc_channels):
            raise ValueError("every ECAPA channel count must divide by enc_res2net_scale")
        for layer in (*self.look_ahead_layers, *self.look_backward_layers):
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"look-ahead/back layer {layer} outside [0, {self.num_layers})")


@dataclass(frozen=True)
class BigVGANSpec:
    upsample_initial_channel: int
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))

    def __post_init__(self) -> None:
        check_geometry(
            self.upsample_rates, self.upsample_kernel_sizes, self.resblock_kernel_sizes, self.resblock_dilation_sizes
        )
        if self.upsample_initial_channel >> len(self.upsample_rates) < 1:
            raise ValueError("upsample_initial_channel must keep >= 1 channel after every upsampling layer")


@dataclass(frozen=True)
class Qwen25Preset:
    name: str
    thinker: DecoderSpec
    talker: DecoderSpec
    dit: DiTSpec
    bigvgan: BigVGANSpec
    codebook_size: int
    ref_mel_frames: int  # length of each speaker's reference mel in spk_dict.pt
    encoders: EncoderSpec = field(default_factory=EncoderSpec)
    storage_dtype: str = "float32"
    bpe_vocab_size: int = 735

    def __post_init__(self) -> None:
        for part in (self.thinker, self.talker):
            if part.num_experts:
                raise ValueError("Qwen2.5-Omni's Thinker and Talker are dense")
        if self.thinker.head_dim * self.thinker.num_heads != self.thinker.hidden_size:
            raise ValueError("the Qwen2.5 text config has no head_dim: thinker head_dim must be hidden / heads")
        if self.codebook_size <= 0 or self.ref_mel_frames <= 0:
            raise ValueError("codebook_size and ref_mel_frames must be positive")
        if self.storage_dtype not in _STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {_STORAGE_DTYPES}")

    @property
    def talker_vocab_size(self) -> int:
        return self.codebook_size + TALKER_EXTRA_IDS


_TINY = Qwen25Preset(
    name="tiny",
    thinker=DecoderSpec(64, 2, 4, 2, 16, 128),
    # Talker width differs from the Thinker's and head_dim * heads != hidden: catches projection mix-ups.
    talker=DecoderSpec(48, 2, 4, 2, 16, 96),
    dit=DiTSpec(
        hidden_size=32, num_layers=4, num_heads=2, head_dim=16, ff_mult=2, emb_dim=16, block_size=8,
        look_ahead_layers=(2,), look_backward_layers=(0, 3), enc_emb_dim=16, enc_dim=16,
        enc_channels=(16, 16, 16, 16, 48), enc_attention_channels=8, enc_se_channels=8,
    ),
    bigvgan=BigVGANSpec(
        upsample_initial_channel=16, upsample_rates=(5, 3, 4, 4), upsample_kernel_sizes=(11, 7, 8, 8),
        resblock_kernel_sizes=(3, 7), resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    ),
    codebook_size=128,
    ref_mel_frames=24,
)

_SMALL = Qwen25Preset(
    name="small",
    thinker=DecoderSpec(768, 12, 12, 4, 64, 2048),
    talker=DecoderSpec(512, 8, 8, 2, 64, 1536),
    dit=DiTSpec(
        hidden_size=256, num_layers=8, num_heads=4, head_dim=64, ff_mult=2, emb_dim=128, block_size=24,
        look_ahead_layers=(4,), look_backward_layers=(0, 6), enc_emb_dim=64, enc_dim=64,
        enc_channels=(64, 64, 64, 64, 192), enc_attention_channels=32, enc_se_channels=32,
    ),
    bigvgan=BigVGANSpec(upsample_initial_channel=256),
    codebook_size=8192,
    ref_mel_frames=300,
    # Towers in proportion to the 7B's (1280 wide, 32 layers each, beside a 3584-wide Thinker).
    encoders=EncoderSpec(
        audio_d_model=256, audio_layers=4, audio_heads=4, audio_ffn=1024,
        vision_hidden=256, vision_depth=4, vision_heads=4, vision_intermediate=1024,
    ),
    storage_dtype="bfloat16",
)

PRESETS: dict[str, Qwen25Preset] = {p.name: p for p in (_TINY, _SMALL)}


def get_preset(name: str) -> Qwen25Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown qwen2_5_omni preset {name!r}; choose from {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class ReservedIds:
    """Thinker-table rows past the tokenizer: Talker text specials and speaker bos rows."""

    thinker_vocab_size: int
    tts_text: dict[str, int]
    speaker_bos: dict[str, int]


def reserved_ids(ids: Qwen25TokenIds) -> ReservedIds:
    base = ids.num_tokens
    last = base + _SPEAKER_BOS_OFFSET + len(SPEAKERS)
    vocab = -(-last // _THINKER_VOCAB_MULTIPLE) * _THINKER_VOCAB_MULTIPLE
    return ReservedIds(
        thinker_vocab_size=vocab,
        tts_text={k: base + off for k, off in _TTS_TEXT_OFFSETS.items()},
        speaker_bos={name: base + _SPEAKER_BOS_OFFSET + i for i, name in enumerate(SPEAKERS)},
    )


def _full_attention_blocks(depth: int) -> list[int]:
    """Every k-th vision block attends over the whole image, the others within windows (the 7B: 7, 15, 23, 31 of
    32); k = depth / 2 here so that even a 2-block tower has one of each."""
    k = max(2, depth // 2)
    return list(range(k - 1, depth, k))


def _mrope_section(head_dim: int) -> list[int]:
    # Same proportions as the real [16, 24, 24] for head_dim 128; the sections sum to head_dim / 2.
    half = head_dim // 2
    hw = half * 24 // 64
    return [half - 2 * hw, hw, hw]


def _decoder_fields(spec: DecoderSpec) -> dict:
    return {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _mrope_section(spec.head_dim),
        },
    }


def build_config_dict(preset: Qwen25Preset, ids: Qwen25TokenIds, reserved: ReservedIds) -> dict:
    """The `config.json` contents: Qwen2.5-Omni layout, the preset's sizes, the tokenizer's ids."""
    enc = preset.encoders
    cb = preset.codebook_size
    media_ids = {
        "audio_token_index": ids.audio,
        "image_token_index": ids.image,
        "video_token_index": ids.video,
        "audio_start_token_id": ids.audio_bos,
        "audio_end_token_id": ids.audio_eos,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
    }
    thinker = {
        "model_type": "qwen2_5_omni_thinker",
        "text_config": {
            "model_type": "qwen2_5_omni_text",
            "vocab_size": reserved.thinker_vocab_size,
            **_decoder_fields(preset.thinker),
            "tie_word_embeddings": False,
        },
        "audio_config": {
            "model_type": "qwen2_5_omni_audio_encoder",
            "num_mel_bins": 128,
            "d_model": enc.audio_d_model,
            "encoder_layers": enc.audio_layers,
            "encoder_attention_heads": enc.audio_heads,
            "encoder_ffn_dim": enc.audio_ffn,
            "output_dim": preset.thinker.hidden_size,
            "max_source_positions": 1500,
            "n_window": 100,
        },
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder",
            "depth": enc.vision_depth,
            "hidden_size": enc.vision_hidden,
            "num_heads": enc.vision_heads,
            "intermediate_size": enc.vision_intermediate,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": _full_attention_blocks(enc.vision_depth),
            "out_hidden_size": preset.thinker.hidden_size,
        },
        **media_ids,
        # Read by get_rope_index but not declared by the thinker config class (AttributeError without it).
        "vision_start_token_id": ids.vision_bos,
        "vision_end_token_id": ids.vision_eos,
        "user_token_id": ids.user,
        "tie_word_embeddings": False,
    }
    talker_spec = preset.talker
    talker = {
        "model_type": "qwen2_5_omni_talker",
        "vocab_size": preset.talker_vocab_size,
        "embedding_size": preset.thinker.hidden_size,
        **_decoder_fields(talker_spec),
        "head_dim": talker_spec.head_dim,
        **{k: cb + off for k, off in _CODEC_OFFSETS.items()},
        **reserved.tts_text,
        "vision_start_token_id": ids.vision_bos,
        "vision_end_token_id": ids.vision_eos,
        **media_ids,
        "spatial_merge_size": 2,
    }
    dit = preset.dit
    big = preset.bigvgan
    token2wav = {
        "model_type": "qwen2_5_omni_token2wav",
        "dit_config": {
            "model_type": "qwen2_5_omni_dit",
            "hidden_size": dit.hidden_size,
            "num_hidden_layers": dit.num_layers,
            "num_attention_heads": dit.num_heads,
            "head_dim": dit.head_dim,
            "ff_mult": dit.ff_mult,
            "emb_dim": dit.emb_dim,
            "block_size": dit.block_size,
            "look_ahead_layers": list(dit.look_ahead_layers),
            "look_backward_layers": list(dit.look_backward_layers),
            "repeats": dit.repeats,
            "num_embeds": preset.talker_vocab_size,
            "mel_dim": dit.mel_dim,
            "dropout": 0.1,
            "enc_emb_dim": dit.enc_emb_dim,
            "enc_dim": dit.enc_dim,
            "enc_channels": list(dit.enc_channels),
            "enc_kernel_sizes": list(dit.enc_kernel_sizes),
            "enc_dilations": list(dit.enc_dilations),
            "enc_attention_channels": dit.enc_attention_channels,
            "enc_res2net_scale": dit.enc_res2net_scale,
            "enc_se_channels": dit.enc_se_channels,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "bigvgan_config": {
            "model_type": "qwen2_5_omni_bigvgan",
            "mel_dim": dit.mel_dim,
            "upsample_initial_channel": big.upsample_initial_channel,
            "resblock_kernel_sizes": list(big.resblock_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in big.resblock_dilation_sizes],
            "upsample_rates": list(big.upsample_rates),
            "upsample_kernel_sizes": list(big.upsample_kernel_sizes),
        },
    }
    return {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": True,
        "thinker_config": thinker,
        "talker_config": talker,
        "token2wav_config": token2wav,
        "dtype": preset.storage_dtype,
        "transformers_version": transformers.__version__,
    }


def build_preprocessor_config_dict() -> dict:
    """Qwen2.5-Omni-7B's ``preprocessor_config.json``: Qwen3-Omni's Whisper features (128 mel, 300 s) and Qwen2-VL
    image processor, with patch 14, CLIP's normalisation and its pixel limits."""
    return {
        **build_qwen3_preprocessor_config_dict(),
        "processor_class": "Qwen2_5OmniProcessor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14,
        "min_pixels": 3136,
        "max_pixels": 12845056,
    }
