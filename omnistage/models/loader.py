"""Read a Hugging Face Qwen3-Omni checkpoint directory: config + safetensors (single file or sharded).

Only the tensors a stage uses are read (by name prefix); loading into a module is strict and names every
missing or unexpected tensor, so a checkpoint that does not fit the model fails loudly before serving.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3OmniMoeConfig

# Fields transformers' config classes read but do not declare (DESIGN §2.1); filled in when absent.
_UNDECLARED_DEFAULTS = {
    ("talker_config", "spatial_merge_size"): 2,
    ("thinker_config", "vision_start_token_id"): None,
}


def load_config(model_dir: str | Path) -> Qwen3OmniMoeConfig:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a Qwen3-Omni checkpoint directory?")
    config = Qwen3OmniMoeConfig.from_pretrained(model_dir)
    for (part, name), default in _UNDECLARED_DEFAULTS.items():
        sub = getattr(config, part)
        if not hasattr(sub, name):
            setattr(sub, name, default)
    text = config.talker_config.text_config
    if not hasattr(text, "shared_expert_intermediate_size"):
        text.shared_expert_intermediate_size = text.intermediate_size
    return config


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no safetensors weights")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def load_weights(model_dir: str | Path, prefix: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Tensors whose name starts with ``prefix``, prefix stripped, cast to ``dtype`` (floating ones)."""
    model_dir = Path(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name, f in _weight_files(model_dir).items():
        if name.startswith(prefix):
            by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for name in names:
                t = fh.get_tensor(name)
                out[name[len(prefix):]] = t.to(dtype) if t.is_floating_point() else t
    return out


def load_into(
    module: torch.nn.Module,
    model_dir: str | Path,
    prefix: str,
    dtype: torch.dtype = torch.float32,
    skip: tuple[str, ...] = (),
) -> None:
    """Strictly load ``prefix``-ed checkpoint tensors into ``module`` (names = checkpoint names - prefix)."""
    tensors = {k: v for k, v in load_weights(model_dir, prefix, dtype).items() if not k.startswith(skip)}
    expected = set(module.state_dict())
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not fit {type(module).__name__} under {prefix!r}: "
            f"missing {missing[:20]}{' ...' if len(missing) > 20 else ''}, "
            f"unexpected {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )
    module.load_state_dict(tensors, strict=True)
    module.to(dtype)
