"""Weight quantization as configured: the method (``none``, ``int8``, ``int4``) and the group size, per engine
(``--quantization``) and optionally per stage (a stage's ``quantization:`` key in the YAML)."""

from __future__ import annotations

from dataclasses import dataclass

QUANT_METHODS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 128  # int4's inputs per scale where none is given (compressed-tensors' W4A16)


def check_method(value: object) -> str:
    if value not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANT_METHODS)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Quantization:
    """``method`` int8: weights per output channel, or per ``group_size`` inputs where one is given; int4:
    symmetric in groups of ``group_size`` inputs (``INT4_GROUP_SIZE`` where None). What a model family quantizes
    under each is its choice (``ModelFamily.quant_scheme``)."""

    method: str = "none"
    group_size: int | None = None

    def __post_init__(self) -> None:
        check_method(self.method)
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2):
            raise ValueError(f"quantization group_size must be an even int >= 2 (or None), got {g!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def int4_group(self) -> int:
        return INT4_GROUP_SIZE if self.group_size is None else self.group_size

    def for_stage(self, stage_method: str | None) -> Quantization:
        """This engine setting under a stage's own ``quantization`` key (None: the engine's)."""
        return self if stage_method is None else Quantization(stage_method, self.group_size)


NO_QUANTIZATION = Quantization()
