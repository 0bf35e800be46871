"""Registry of inter-stage input processor *names* and their argument schemas.

The config layer only needs to know which processor names exist, how many upstream stages each one
takes and how to validate its `processor_args`. The pipeline package registers the actual
implementations under the same names; keeping the schema here lets a config be rejected at load time
instead of when the first request reaches the downstream stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omnistage.config.errors import ConfigError

# Validates and normalises processor args (fills defaults); raises ConfigError/ValueError on bad input.
ArgsValidator = Callable[[Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class InputProcessorSpec:
    name: str
    validate_args: ArgsValidator
    num_inputs: int | None = 1  # None => any number of upstream stages

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"input processor name must be a non-empty str, got {self.name!r}")
        if not callable(self.validate_args):
            raise ValueError(f"input processor {self.name!r}: validate_args must be callable")
        if self.num_inputs is not None and (
            isinstance(self.num_inputs, bool) or not isinstance(self.num_inputs, int) or self.num_inputs < 1
        ):
            raise ValueError(f"input processor {self.name!r}: num_inputs must be None or >= 1")


_REGISTRY: dict[str, InputProcessorSpec] = {}


def register_input_processor(spec: InputProcessorSpec, *, replace: bool = False) -> None:
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"input processor {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_input_processor_spec(name: str) -> InputProcessorSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown input processor {name!r}; known: {sorted(_REGISTRY)}", field="input_processor"
        ) from None


def known_input_processors() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _no_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    if args:
        raise ConfigError(f"takes no processor_args, got {sorted(args)}", field="processor_args")
    return MappingProxyType({})


# Reference chunking of transformers' Code2Wav.chunked_decode is 300 frames with 25 frames of left
# context. The first chunk is smaller so the first audio reaches the client early (25 frames = 2 s of
# 24 kHz audio at 1920 samples per frame). A different first-chunk boundary changes the samples near
# the boundary relative to the reference; set first_chunk_frames == chunk_frames for exact parity.
TALKER2CODE2WAV_DEFAULTS: Mapping[str, int] = MappingProxyType(
    {"first_chunk_frames": 25, "chunk_frames": 300, "left_context_frames": 25}
)
# Overrides that reproduce the reference's chunk boundaries exactly (for parity tests).
TALKER2CODE2WAV_REFERENCE_ARGS: Mapping[str, int] = MappingProxyType(
    {"first_chunk_frames": 300, "chunk_frames": 300, "left_context_frames": 25}
)


def _talker2code2wav_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(set(args) - set(TALKER2CODE2WAV_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown}; allowed: {sorted(TALKER2CODE2WAV_DEFAULTS)}", field="processor_args"
        )
    merged = {**TALKER2CODE2WAV_DEFAULTS, **args}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"must be a positive int, got {value!r}", field=f"processor_args.{key}")
    if merged["left_context_frames"] >= merged["chunk_frames"]:
        raise ConfigError(
            f"left_context_frames ({merged['left_context_frames']}) must be < chunk_frames "
            f"({merged['chunk_frames']})",
            field="processor_args.left_context_frames",
        )
    return MappingProxyType(merged)


register_input_processor(InputProcessorSpec("thinker2talker", _no_args, num_inputs=1))
register_input_processor(InputProcessorSpec("talker2code2wav", _talker2code2wav_args, num_inputs=1))
