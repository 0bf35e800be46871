"""Per-request sampling and stopping parameters.

Ranges are checked on construction so that a bad value fails its own request at submission instead of
crashing the stage that samples it:
- ``temperature`` below ``GREEDY_TEMPERATURE_EPS`` means greedy. Dividing float32 logits by a tiny positive
  temperature overflows them to +-inf (1e-300 even rounds to 0 in float32) and softmax turns that into NaN;
  greedy is the limit such a temperature asks for, and it is what other engines do (vLLM's 1e-5), so it is
  treated as greedy rather than rejected. Above the epsilon any float32-finite temperature is safe.
- ``seed`` must fit ``torch.Generator.manual_seed``: [-2**63, 2**64 - 1] (negative seeds are mapped by
  torch onto the unsigned range).
- ``repetition_penalty`` in [1e-6, 1e6], ``frequency_penalty`` / ``presence_penalty`` in [-2, 2] (OpenAI's
  range), ``logit_bias`` values in [-100, 100]: logits stay finite in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.core.validation import check_bool, check_finite, check_int

GREEDY_TEMPERATURE_EPS = 1e-5
FLOAT32_MAX = 3.4028234663852886e38
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
PENALTY_RANGE = (-2.0, 2.0)  # frequency / presence (OpenAI)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE_EPS => greedy
    top_k: int = 0  # 0 or -1 => off
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output
    frequency_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id; a mapping is accepted
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept any iterable (lists from JSON) but store a tuple so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

        check_finite(self.temperature, "temperature")
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be >= 0 and finite in float32, got {self.temperature}")
        check_int(self.top_k, "top_k")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        check_finite(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_range("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        _check_range("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        if self.seed is not None:
            check_int(self.seed, "seed")
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        check_int(self.max_tokens, "max_tokens")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_int(self.min_tokens, "min_tokens")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_bool(self.ignore_eos, "ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_range(name: str, value: object, lo: float, hi: float) -> None:
    check_finite(value, name)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a sequence of ints, got {ids!r}")
    out = tuple(ids)
    for tok in out:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {tok!r}")
    return out


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not hasattr(bias, "__iter__"):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    else:
        pairs = [tuple(p) for p in bias]
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        tok, value = pair
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias token ids must be non-negative ints, got {tok!r}")
        _check_range(f"logit_bias[{tok}]", value, *LOGIT_BIAS_RANGE)
        out[tok] = float(value)
    return tuple(sorted(out.items()))
