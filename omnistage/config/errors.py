"""Errors raised while loading or validating stage / pipeline configuration."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the stage and field when known."""

    def __init__(self, message: str, *, stage: str | None = None, field: str | None = None) -> None:
        self.message = message
        self.stage = stage
        self.field = field
        prefix = ""
        if stage is not None:
            prefix += f"stage {stage!r}: "
        if field is not None:
            prefix += f"field {field!r}: "
        super().__init__(prefix + message)


class UnsupportedConfigError(ConfigError):
    """The config is well formed but asks for a combination the runner or model cannot serve."""
