"""Read a pipeline config from YAML (a user file or a family's packaged preset text), with overrides.

Preset *names* belong to model families: ``omnistage.models.registry.load_pipeline_config`` resolves a name
or a path and calls into this module.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from omnistage.config.errors import ConfigError
from omnistage.config.stage_config import PipelineConfig


def looks_like_path(source: str | os.PathLike[str]) -> bool:
    text = os.fspath(source)
    return (
        isinstance(source, os.PathLike)
        or text.endswith((".yaml", ".yml"))
        or os.sep in text
        or (os.altsep is not None and os.altsep in text)
    )


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts merge key by key (siblings kept); any other value replaces. Inputs are not mutated."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides use the config's own keys; `stages` is a mapping stage name -> partial stage dict."""
    result = copy.deepcopy(dict(raw))
    overrides = dict(overrides)
    stage_overrides = overrides.pop("stages", None) or {}
    if not isinstance(stage_overrides, Mapping):
        raise ConfigError("overrides['stages'] must map stage names to partial stage configs")
    result = _deep_merge(result, overrides)
    stages = result.get("stages")
    if stage_overrides and not isinstance(stages, list):
        raise ConfigError("cannot override stages: the config has no stage list", field="stages")
    by_name = {s.get("name"): i for i, s in enumerate(stages or []) if isinstance(s, Mapping)}
    for name, partial in stage_overrides.items():
        if name not in by_name:
            raise ConfigError(f"override names unknown stage {name!r}; stages: {sorted(map(str, by_name))}")
        if not isinstance(partial, Mapping):
            raise ConfigError("a stage override must be a mapping", stage=name)
        if "name" in partial and partial["name"] != name:
            raise ConfigError("overrides cannot rename a stage", stage=name, field="name")
        stages[by_name[name]] = _deep_merge(dict(stages[by_name[name]]), partial)
    return result


def read_pipeline_file(
    path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> PipelineConfig:
    """Load and validate a pipeline config from a YAML file (see ``parse_pipeline_yaml``)."""
    path = Path(os.fspath(path))
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    return parse_pipeline_yaml(path.read_text(encoding="utf-8"), str(path), overrides)


def parse_pipeline_yaml(text: str, source: str, overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """Validate a pipeline config given as YAML text; ``source`` names it in error messages.

    `overrides` example: {"runner": "cuda_graph", "stages": {"talker": {"sampling": {"temperature": 0.0}}}}.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must hold a mapping at the top level")
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        return PipelineConfig.from_dict(raw)
    except ConfigError as exc:
        raise type(exc)(f"{exc.message} (in {source})", stage=exc.stage, field=exc.field) from None
