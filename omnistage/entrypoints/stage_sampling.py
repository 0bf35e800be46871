"""How an API request's sampling fields become per-stage SamplingParams (shared by the HTTP and realtime
APIs).

The request's top-level fields set the text stage (the Thinker). Every other sampling stage (the Talker)
keeps the deployment's defaults but follows the request's determinism — a greedy temperature makes it
greedy too, a seed seeds it — and the ``talker`` extension object overrides it field by field, within the
deployment's ``max_tokens`` cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.core.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from omnistage.pipeline.client import ModelInfo


class SamplingFieldError(ValueError):
    """A sampling field the request cannot have; ``param`` names it (``talker.max_tokens``), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_greedy(temperature: float | None) -> bool:
    return temperature is not None and temperature < GREEDY_TEMPERATURE_EPS


def check_min_tokens(fields: Mapping[str, Any], base: SamplingParams, param: str) -> None:
    low, high = fields.get("min_tokens"), fields.get("max_tokens", base.max_tokens)
    if low is not None and low > high:
        raise SamplingFieldError(f"{param} ({low}) must not exceed the maximum number of tokens ({high})", param)


def stage_params(info: ModelInfo, text: Mapping[str, Any], talker: Mapping[str, Any]) -> dict[str, SamplingParams]:
    """By stage name. ``text``: the request's fields for the text stage (None values = stage default);
    ``talker``: overrides for every other sampling stage."""
    base = info.stage_sampling
    text = {k: v for k, v in text.items() if v is not None}
    check_min_tokens(text, base[info.text_stage], "min_tokens")
    out: dict[str, SamplingParams] = {}
    try:
        out[info.text_stage] = base[info.text_stage].replace(**text)
        for name, defaults in base.items():
            if name == info.text_stage:
                continue
            fields: dict[str, Any] = {}
            if is_greedy(text.get("temperature")):
                fields["temperature"] = 0.0
            if text.get("seed") is not None:
                fields["seed"] = text["seed"]
            fields.update({k: v for k, v in talker.items() if v is not None})
            if fields.get("max_tokens", 0) > defaults.max_tokens:  # the deployment's cap (pipeline config)
                raise SamplingFieldError(f"talker.max_tokens is {fields['max_tokens']}; this server allows at most "
                                         f"{defaults.max_tokens}", "talker.max_tokens")
            check_min_tokens(fields, defaults, "talker.min_tokens")
            out[name] = defaults.replace(**fields)
    except SamplingFieldError:
        raise
    except ValueError as exc:
        raise SamplingFieldError(f"invalid sampling parameters: {exc}") from exc
    return out
