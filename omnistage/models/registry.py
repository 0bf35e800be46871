"""Model families by name, the family a checkpoint needs (its config.json ``architectures``), and pipeline
configs by family preset name or YAML path.

Built-in families are listed one line each and imported on first use; others register themselves with
``register_family`` (e.g. a test family).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnistage.config import ConfigError, PipelineConfig, parse_pipeline_yaml, read_pipeline_file
from omnistage.config.loader import looks_like_path
from omnistage.models.family import ModelFamily

# name -> module that defines (and registers) the family
BUILTIN_FAMILIES: Mapping[str, str] = {
    "qwen3_omni": "omnistage.models.qwen3_omni.family",
    "qwen2_5_omni": "omnistage.models.qwen2_5_omni.family",
}
_FAMILIES: dict[str, type[ModelFamily]] = {}


def register_family(cls: type[ModelFamily], *, replace: bool = False) -> type[ModelFamily]:
    """Register a family class (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        raise TypeError(f"expected a ModelFamily subclass, got {cls!r}")
    if cls.name in _FAMILIES and _FAMILIES[cls.name] is not cls and not replace:
        raise ValueError(f"model family {cls.name!r} is already registered")
    _FAMILIES[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for name, module in BUILTIN_FAMILIES.items():
        if name not in _FAMILIES:
            importlib.import_module(module)


def known_families() -> tuple[str, ...]:
    _load_builtins()
    return tuple(sorted(_FAMILIES))


def get_family(name: str) -> type[ModelFamily]:
    if name not in _FAMILIES and name in BUILTIN_FAMILIES:
        importlib.import_module(BUILTIN_FAMILIES[name])
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {list(known_families())}") from None


def family_for_checkpoint(model_dir: str | Path) -> type[ModelFamily]:
    """The family whose ``architectures`` include one named in the checkpoint's config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a model checkpoint directory?")
    try:
        archs = json.loads(path.read_text(encoding="utf-8")).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a JSON object: {exc}") from None
    _load_builtins()
    for cls in _FAMILIES.values():
        if set(archs) & set(cls.architectures):
            return cls
    served = {a: c.name for c in _FAMILIES.values() for a in c.architectures}
    raise ValueError(f"{model_dir}: no model family serves architectures {archs}; served: {served}")


def available_presets() -> tuple[str, ...]:
    """Preset names: one per family (its packaged pipeline)."""
    return known_families()


def load_pipeline_config(
    name_or_path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> PipelineConfig:
    """A family's packaged preset (by family name) or a user YAML file, with optional overrides."""
    if looks_like_path(name_or_path):
        return read_pipeline_file(name_or_path, overrides)
    name = os.fspath(name_or_path)
    try:
        family = get_family(name)
    except ValueError:
        raise ConfigError(f"unknown preset {name!r}; presets: {list(available_presets())}") from None
    return parse_pipeline_yaml(family.preset_text(), f"preset {name!r}", overrides)
