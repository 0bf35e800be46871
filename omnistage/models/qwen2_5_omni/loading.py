"""Read a Qwen2.5-Omni checkpoint directory: config, the three parts' weights, speakers.

Weights load strictly by hub name (``thinker.*`` without the audio/vision towers, the towers on their own,
``talker.*``, ``token2wav.*``) through the shared checkpoint loader, into modules built directly in the serving dtype on the
serving device; Token2Wav stays float32 whatever the serving dtype, as transformers keeps it (the reference runs
the ODE and the vocoder in float32).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen2_5OmniConfig

from omnistage.models.layers.fast_linear import fast_kernels, pack_on_load
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.loader import (
    EmbeddingRows,
    building,
    checkpoint_files,
    load_embedding_rows,
    load_into,
)
from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen2_5_omni.talker import Talker
from omnistage.models.qwen2_5_omni.thinker import Thinker
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.vision_encoder import VisionEncoder
from omnistage.models.qwen2_5_omni.voices import load_speakers
from omnistage.models.qwen3_omni.encoder_cache import MediaEncoders

ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
THINKER_ARCHITECTURE = "Qwen2_5OmniThinkerForConditionalGeneration"  # transformers' Thinker saved alone
THINKER_TOWERS = ("audio_tower.", "visual.")


@contextlib.contextmanager
def quiet_config_checks() -> Iterator[None]:
    """Silence transformers' config validation while building a Qwen2.5-Omni config or model: the Talker's
    text-side ids (Thinker rows) lie past its codec vocabulary, as in the released checkpoint, and are flagged."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def load_config(model_dir: str | Path) -> Qwen2_5OmniConfig:
    """config.json as a Qwen2_5OmniConfig. A missing ``thinker_config.vision_start_token_id`` (read by
    transformers but not declared) takes the talker config's value. A Thinker alone (``THINKER_ARCHITECTURE``)
    becomes the whole model's config with that Thinker and no speech (``enable_audio_output`` false)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a Qwen2.5-Omni checkpoint directory?")
    raw = json.loads(path.read_text(encoding="utf-8"))
    if THINKER_ARCHITECTURE in (raw.get("architectures") or []):
        raw = {"architectures": [ARCHITECTURE], "thinker_config": raw, "enable_audio_output": False}
    if ARCHITECTURE not in raw.get("architectures", []):
        raise ValueError(f"{model_dir} is not a Qwen2.5-Omni checkpoint (architectures {raw.get('architectures')})")
    thinker = raw.setdefault("thinker_config", {})
    thinker.setdefault("vision_start_token_id", raw.get("talker_config", {}).get("vision_start_token_id"))
    with quiet_config_checks():
        config = Qwen2_5OmniConfig.from_dict(raw)
    config._name_or_path = str(model_dir)
    return config


def load_thinker(
    model_dir: str | Path, config: Qwen2_5OmniConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
    prefix: str = "thinker.", quantize: QuantScheme | None = None, fast: bool = False,
) -> Thinker:
    """The Thinker, its tensors under ``prefix`` (none in a Thinker saved alone); ``quantize``: the weights it
    quantizes while loading; ``fast``: layers packed as the loader reads them (``pack_on_load``)."""
    with building(dtype, device, init=False):
        thinker = Thinker(config)
    load_into(thinker, model_dir, prefix, dtype, skip=THINKER_TOWERS, quantize=quantize, loaded=pack_on_load(fast))
    return thinker.eval()


def load_talker(
    model_dir: str | Path, config: Qwen2_5OmniConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
    quantize: QuantScheme | None = None, fast: bool = False,
) -> Talker:
    with building(dtype, device, init=False):
        talker = Talker(config)
    load_into(talker, model_dir, "talker.", dtype, quantize=quantize, loaded=pack_on_load(fast))
    return talker.eval()


def load_thinker_embedding(model_dir: str | Path, ids: Sequence[int], dtype: torch.dtype = torch.float32,
                           device: str = "cpu") -> EmbeddingRows:
    """Rows ``ids`` of the Thinker's token embedding table (the Talker reads a few of them; the table itself is
    not loaded)."""
    return load_embedding_rows(model_dir, "thinker.model.embed_tokens.weight", sorted(set(ids)), dtype, device)


def load_token2wav(model_dir: str | Path, config: Qwen2_5OmniConfig, device: str = "cpu") -> Token2Wav:
    with building(torch.float32, device, init=False):
        token2wav = Token2Wav(config)
    load_into(token2wav, model_dir, "token2wav.", torch.float32)
    token2wav.set_speakers(load_speakers(model_dir))
    return token2wav.eval()


def load_media_encoders(
    model_dir: str | Path, config: Qwen2_5OmniConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
    fast: bool = False, thinker: str = "thinker.", quantize: QuantScheme | None = None,
) -> MediaEncoders:
    """The Thinker's towers the checkpoint holds (under the Thinker's prefix ``thinker``), behind the shared
    encoder cache; ``quantize``: the Thinker's scheme (names relative to the Thinker), its towers' part taken."""
    names = checkpoint_files(model_dir)
    towers: list[nn.Module | None] = []
    for tower_prefix, cls, cfg in zip(THINKER_TOWERS, (AudioEncoder, VisionEncoder),
                                      (config.thinker_config.audio_config, config.thinker_config.vision_config)):
        prefix = thinker + tower_prefix
        if not any(n.startswith(prefix) for n in names):
            towers.append(None)
            continue
        with building(dtype, device, init=False):
            tower = cls(cfg)
        load_into(tower, model_dir, prefix, dtype, quantize=quantize.within(tower_prefix) if quantize else None)
        towers.append(fast_kernels(tower.eval(), fast, many_rows=True))
    return MediaEncoders(*towers)
