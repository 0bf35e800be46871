"""Qwen3-Omni's config.json as transformers' ``Qwen3OmniMoeConfig``, with the fields transformers reads but
does not declare filled in."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen3OmniMoeConfig

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
# transformers' Thinker alone (``Qwen3OmniMoeThinkerForConditionalGeneration.save_pretrained``, e.g. a fine-tuned
# Thinker): its config.json is the thinker_config, its tensors the Thinker's names without ``thinker.``
THINKER_ARCHITECTURE = "Qwen3OmniMoeThinkerForConditionalGeneration"


def load_config(model_dir: str | Path) -> Qwen3OmniMoeConfig:
    """Load `config.json`, filling in the fields transformers 5.x reads but does not declare. A Thinker alone
    (``THINKER_ARCHITECTURE``) becomes the whole model's config with that Thinker and no speech (``enable_audio_output``
    false), as transformers would build it around the Thinker.

    Missing `talker_config.spatial_merge_size` takes the vision tower's value,
    `talker_config.text_config.shared_expert_intermediate_size` the talker's `intermediate_size`, and
    `thinker_config.vision_start_token_id` the talker config's value (None when neither has it; only
    image/video position ids need it).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a Qwen3-Omni checkpoint directory?")
    raw = json.loads(path.read_text(encoding="utf-8"))
    if THINKER_ARCHITECTURE in (raw.get("architectures") or []):
        raw = {"architectures": [ARCHITECTURE], "thinker_config": raw, "enable_audio_output": False}
    thinker = raw.setdefault("thinker_config", {})
    talker = raw.setdefault("talker_config", {})
    talker_text = talker.setdefault("text_config", {})
    vision = thinker.get("vision_config", {})
    talker.setdefault("spatial_merge_size", vision.get("spatial_merge_size", 2))
    if "intermediate_size" in talker_text:
        talker_text.setdefault("shared_expert_intermediate_size", talker_text["intermediate_size"])
    thinker.setdefault("vision_start_token_id", talker.get("vision_start_token_id"))
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # mrope keys in rope_parameters draw a spurious "unrecognized keys" warning
    try:
        config = Qwen3OmniMoeConfig.from_dict(raw)
    finally:
        hf_logging.set_verbosity(level)
    config._name_or_path = str(model_dir)
    text = config.talker_config.text_config
    if not hasattr(text, "shared_expert_intermediate_size"):  # no intermediate_size in the file either
        text.shared_expert_intermediate_size = text.intermediate_size
    return config


