"""Weight quantization as configured: the method (``none``, ``int8``, ``int4``) and the int4 group size, per
engine (``--quantization``) and optionally per stage (a stage's ``quantization:`` key in the YAML)."""

from __future__ import annotations

from dataclasses import dataclass

QUANT_METHODS = ("none", "int8", "int4")


def check_method(value: object) -> str:
    if value not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANT_METHODS)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Quantization:
    """``method`` int8: weights per output channel; int4: symmetric in groups of ``group_size`` inputs (what
    a model family quantizes under each is its choice: ``ModelFamily.quant_scheme``)."""

    method: str = "none"
    group_size: int = 128

    def __post_init__(self) -> None:
        check_method(self.method)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2:
            raise ValueError(f"quantization group_size must be an even int >= 2, got {g!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def for_stage(self, stage_method: str | None) -> Quantization:
        """This engine setting under a stage's own ``quantization`` key (None: the engine's)."""
        return self if stage_method is None else Quantization(stage_method, self.group_size)


NO_QUANTIZATION = Quantization()
