"""Pre-quantized checkpoints, read into omnistage's layers: compressed-tensors' ``pack-quantized`` and
``float-quantized`` formats (what llm-compressor writes and vLLM reads), and transformers' own fine-grained FP8
(``quant_method: fp8``).

compressed-tensors: ``config.json`` carries ``quantization_config``: ``quant_method: compressed-tensors``, ``format:
pack-quantized``, ``config_groups`` (each: module ``targets`` and its ``weights`` scheme) and ``ignore``
(module names or ``re:`` patterns kept in float). A quantized linear layer ``X`` stores ``X.weight_packed``
(int32 [N, K * bits / 32]: value i of a row at bits i * bits.., offset by 2^(bits-1)), ``X.weight_scale``
([N, K / group] for strategy ``group``, [N, 1] for ``channel``) and ``X.weight_shape`` ([N, K]). On a
little-endian host the int32 words of 4-bit values are, byte by byte, ``quant.pack_nibbles``' layout (even
column in the low nibble, offset 8), and those of 8-bit values are the values offset by 128.

Supported: integer weights, 4 or 8 bits, strategy ``group`` or ``channel``, no activation quantization. Symmetric
layers keep the stored values: no re-quantization. Layers with zero points (``symmetric: false``: llm-compressor's
``W4A16_ASYM``, e.g. its AWQ) store ``X.weight_zero_point`` too, packed down the outputs; omnistage's int4 layers
have none, so they are dequantized as read to ``(q - zero) * scale`` in the scales' dtype, as the library
decompresses them (``PackedInt``, method ``pack-quantized``).

FP8 (format ``float-quantized``: ``X.weight`` in float8 e4m3 and ``X.weight_scale`` per ``tensor`` [1], per
``channel`` [N, 1] or per ``block`` [ceil(N / bn), ceil(K / bk)] of ``block_structure`` [bn, bk]) is
*dequantized* as it is read, tensor by tensor, to ``value * scale`` in float32, then cast to the serving dtype, or
quantized to int8 / int4 where ``--quantization`` asks (the full model's 35 GB of FP8 does not fit a 24 GiB
machine as bfloat16). Its activation scheme (FP8 per token or per tensor, ``X.input_scale``) is not applied:
activations stay in the serving dtype, as everywhere in omnistage (weight-only). Anything else (other float
formats such as NVFP4, integer activation schemes, other formats or methods) is refused with an error
naming the scheme.

GPTQ (``quant_method: gptq``) and AWQ (``quant_method: awq``, version ``gemm``), as transformers reads them
through gptqmodel: a linear layer ``X`` stores ``X.qweight`` (int32; GPTQ: 32 / bits values per word down the input
dimension, [K * bits / 32, N]; AWQ: 8 nibbles per word along the outputs in the order 0 2 4 6 1 3 5 7, [K, N / 8]),
``X.qzeros`` (packed along the outputs, [groups, N * bits / 32]; GPTQ's original ``gptq`` checkpoint format stores
each zero point minus one, ``gptq_v2`` as is), ``X.scales`` ([groups, N], float16 or bfloat16) and, for GPTQ,
``X.g_idx`` (each input's group: act-order). They are *dequantized* as read to ``(q - zero) * scale`` rounded to
the scales' dtype, the weight transformers' kernels multiply by (float16 or bfloat16 values: a float32 model
gives exactly their outputs), then cast to the serving dtype or quantized where ``--quantization`` asks. 4 and
8 bits (AWQ: 4); other bit widths and kernel formats (marlin, exllama, GEMV) are refused naming them.

transformers' FP8 (``FineGrainedFP8Config``: ``weight_block_size`` [bn, bk], or null for one scale per tensor):
``X.weight`` in float8 e4m3 beside ``X.weight_scale_inv``, which despite its name multiplies (per block, or [1]);
scales in float32 / bfloat16, or as E8M0 exponents (``scale_fmt: ue8m0``; raw bytes 2^(b - 127)). Read as
transformers reads it without a GPU: every weight stored with a ``weight_scale_inv`` is dequantized, whatever
``modules_to_not_convert`` lists; the static activation scheme's ``X.activation_scale`` is not applied. FP4-packed
experts (``expert_dtype: fp4``) are refused.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnistage.models.layers.quant import QuantFormat, pack_nibbles

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
FP8_SUFFIXES = ("input_scale", "activation_scale")  # (beside an FP8 layer's X.weight and its scale: not applied)
FP8_STRATEGIES = ("tensor", "channel", "block")
_SUPPORTED = ("pack-quantized: int weights, 4 or 8 bits, strategy group or channel, no activation "
              "quantization; float-quantized: float 8-bit weights, strategy tensor, channel or block")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization scheme omnistage cannot read."""


@dataclass(frozen=True)
class StoredQuantization:
    """A pre-quantized checkpoint's scheme: per config group (targets, bits, group size or None for channel),
    and the ignore list."""

    groups: tuple[tuple[tuple[str, ...], int, int | None], ...]
    ignore: tuple[str, ...]
    # FP8 config groups: (targets, strategy, block_structure [bn, bk] or None)
    fp8_groups: tuple[tuple[tuple[str, ...], str, tuple[int, int] | None], ...] = ()
    fp8_scale_name: str = "weight_scale"  # an FP8 layer X's scale tensor: X.<this>
    packed_int: PackedInt | None = None  # GPTQ / AWQ: every layer stored with a qweight
    # compressed-tensors pack-quantized groups with zero points (dequantized as read): (targets, bits, group or None)
    asymmetric: tuple[tuple[tuple[str, ...], int, int | None], ...] = ()

    def asymmetric_for(self, module: str) -> PackedInt | None:
        """Module ``module``'s pack-quantized scheme where a config group with zero points covers it."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, bits, group in self.asymmetric:
            if _targeted(targets, module):
                return PackedInt("pack-quantized", bits, -1 if group is None else group)
        return None

    def format_for(self, module: str, in_features: int) -> QuantFormat | None:
        """The stored format of module ``module`` (full checkpoint name, no ``.weight``); None: not quantized."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, bits, group in self.groups:
            if _targeted(targets, module):
                if bits == 8:
                    return QuantFormat(8, group).for_inputs(in_features)
                return QuantFormat(4, group if group is not None else in_features)
        return None

    def fp8_scheme(self, module: str) -> Fp8Scale | None:
        """How module ``module``'s FP8 weight is scaled, where an FP8 config group covers it."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, strategy, block in self.fp8_groups:
            if _targeted(targets, module):
                return Fp8Scale(strategy, block, self.fp8_scale_name)
        return None


@dataclass(frozen=True)
class Fp8Scale:
    """An FP8 weight's scaling: ``strategy`` tensor / channel / block (``block`` [bn, bk] for the last), read from
    the layer's tensor ``scale_name``."""

    strategy: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.strategy not in FP8_STRATEGIES:
            raise UnsupportedQuantization(f"FP8 strategy {self.strategy!r} is not supported ({list(FP8_STRATEGIES)})")
        if (self.strategy == "block") != (self.block is not None):
            raise UnsupportedQuantization("FP8 strategy block needs block_structure [rows, columns] (and only it)")

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """FP8 ``weight`` [..., N, K] (stacked experts: [E, N, K]) and its scale -> float32 ``weight * scale``;
        raises UnsupportedQuantization where the scale's shape does not fit the strategy."""
        if weight.dim() < 2:
            raise UnsupportedQuantization(f"FP8 weight of shape {list(weight.shape)}: expected [..., N, K]")
        *lead, n, k = weight.shape
        s = (scale.float() - 127).exp2() if scale.dtype == torch.uint8 else scale.float()  # (uint8: E8M0 bytes)
        blocks = self.strategy == "block" and s.numel() > 1
        if self.strategy == "channel":
            expected: tuple[int, ...] = (*lead, n, 1)
        elif blocks:
            expected = (*lead, -(-n // self.block[0]), -(-k // self.block[1]))
        else:  # one scale for the tensor (transformers' FP8 also stores one under a block config)
            expected = (1,)
        if (tuple(s.shape) != expected) if blocks else (s.numel() != math.prod(expected)):
            raise UnsupportedQuantization(f"FP8 {self.scale_name} of shape {list(scale.shape)} does not fit a "
                                          f"{list(weight.shape)} weight under strategy {self.strategy} (expected "
                                          f"{list(expected)})")
        if blocks:  # each scale over its block's values
            s = s.repeat_interleave(self.block[0], -2)[..., :n, :].repeat_interleave(self.block[1], -1)[..., :k]
        else:
            s = s.reshape(expected)
        return weight.float() * s


@dataclass(frozen=True)
class PackedInt:
    """Integer weights with zero points, dequantized as read (the module docstring): ``method`` gptq, awq, or
    pack-quantized (compressed-tensors' with ``symmetric: false``), ``bits``, ``group_size`` (-1: one group over the
    inputs), ``zero_offset`` added to each stored zero point (1 in GPTQ's original format)."""

    method: str
    bits: int
    group_size: int
    zero_offset: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """A layer's stored tensors, the first bringing its weight in (``X.<name>``)."""
        if self.method == "pack-quantized":
            return ("weight_packed", "weight_zero_point", "weight_scale", "weight_shape")
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")

    def weight_shape(self, packed_shape: tuple[int, ...]) -> tuple[int, int]:
        """[N, K] of the float weight a ``qweight`` (``weight_packed``) of this shape stands for."""
        rows, cols = packed_shape
        per = 32 // self.bits
        if self.method == "awq":
            return cols * per, rows
        return (cols, rows * per) if self.method == "gptq" else (rows, cols * per)

    def dequantize(self, read: Any, module: str) -> torch.Tensor:
        """Layer ``module``'s float32 weight [N, K] from its stored tensors (``read(name)``)."""
        return self._weight(*self._unpacked(read, module))

    def for_format(self, read: Any, module: str,
                   fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Layer ``module`` for a quantizing load into ``fmt``: as stored, (values [N, K] in [-8, 7], float32 scales
        [N, groups]), where it is exactly ``fmt``'s symmetric int4 (every zero point 8, each input in group
        index // group_size, the same group size: a symmetric GPTQ layer without act-order), so its values are
        not rounded a second time; else its float32 weight (``dequantize``), which the load quantizes."""
        values, zeros, scales, group = self._unpacked(read, module)
        k = values.shape[0]
        if (fmt.bits == self.bits == 4 and fmt.group_size == self.group_size and bool((zeros == 8).all())
                and torch.equal(group, torch.arange(k) // self.group_size)):
            return (values - 8).to(torch.int8).t().contiguous(), scales.float().t().contiguous()
        return self._weight(values, zeros, scales, group)

    @staticmethod
    def _weight(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        weight = (values - zeros[group]).float() * scales.float()[group]  # [K, N]
        return weight.to(scales.dtype).float().t().contiguous()

    def _unpacked(self, read: Any, module: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values [K, N], zero points [groups, N], scales [groups, N] as stored, each input's group [K])."""
        if sys.byteorder != "little":
            raise UnsupportedQuantization(f"reading {self.method} weights needs a little-endian host")
        packed, qzeros, scales = (read(f"{module}.{name}") for name in self.names[:3])
        n, k = self.weight_shape(tuple(packed.shape))
        if self.method == "pack-quantized":  # (values and zero points both offset by 2^(bits-1): it cancels)
            n, k = (int(d) for d in read(f"{module}.weight_shape").tolist())
            values = _unpack_words(packed, self.bits)[:, :k].t()  # [K, N]
            zeros = _unpack_words(qzeros.t(), self.bits)[:, :n]  # [groups, N] (packed down the outputs)
            scales = scales.t()
        elif self.method == "gptq":
            values = _unpack_words(packed.t(), self.bits).t()  # [K, N]
            zeros = _unpack_words(qzeros, self.bits) + self.zero_offset  # [groups, N]
        else:
            values = _awq_order(_unpack_words(packed, self.bits))  # [K, N]
            zeros = _awq_order(_unpack_words(qzeros, self.bits))
        groups = 1 if self.group_size == -1 else -(-k // self.group_size)
        if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
            raise UnsupportedQuantization(
                f"{module}: {self.names[2]} {list(scales.shape)} / {self.names[1]} {list(qzeros.shape)} do not fit a "
                f"[{n}, {k}] weight in groups of {self.group_size} ({groups} groups)")
        if self.method == "gptq":
            group = read(f"{module}.g_idx").long()
            if tuple(group.shape) != (k,) or int(group.min()) < 0 or int(group.max()) >= groups:
                raise UnsupportedQuantization(f"{module}: g_idx must give each of the {k} inputs a group below "
                                              f"{groups}")
        else:
            group = torch.arange(k) // (k if self.group_size == -1 else self.group_size)
        return values, zeros, scales, group


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * 32 / bits]: value j of word c is bits j * bits.. (lowest first)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)


def _awq_order(values: torch.Tensor) -> torch.Tensor:
    """AWQ's packing order (0 2 4 6 1 3 5 7 within each word) back to the columns' order."""
    cols = values.shape[-1]
    return values[..., torch.arange(cols).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].flatten()]


def _packed_int(config: Mapping[str, Any]) -> StoredQuantization:
    """transformers' GPTQ / AWQ ``quantization_config`` (what gptqmodel writes): every layer stored with a
    ``qweight`` is dequantized as read."""
    method = config["quant_method"]
    bits, group = config.get("bits", 4), config.get("group_size", 128)
    fmt = config.get("checkpoint_format") or config.get("format") or ("gptq" if method == "gptq" else "gemm")
    if method == "awq":
        fmt = config.get("version", fmt)
    problems = []
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        problems.append(f"bits {bits!r}")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        problems.append(f"group_size {group!r}")
    if fmt not in (("gptq", "gptq_v2") if method == "gptq" else ("gemm",)):
        problems.append(f"{'checkpoint_format' if method == 'gptq' else 'version'} {fmt!r}")
    if method == "awq" and config.get("zero_point", True) is not True:
        problems.append("zero_point false")
    if problems:
        raise UnsupportedQuantization(f"{method} quantization_config: {'; '.join(problems)} is not supported "
                                      f"(omnistage reads {'4 or 8 bits, checkpoint_format gptq or gptq_v2' if method == 'gptq' else '4 bits, version gemm, with zero points'})")
    return StoredQuantization((), (), packed_int=PackedInt(method, bits, group, 1 if fmt == "gptq" else 0))


def _targeted(targets: tuple[str, ...], module: str) -> bool:
    return any(t == "Linear" or _matches(t, module) for t in targets)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def read_stored(model_dir: str | Path) -> StoredQuantization | None:
    """The checkpoint's ``quantization_config`` (None: a float checkpoint); raises UnsupportedQuantization
    naming what it cannot read."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    return None if config is None else parse_config(config)


def parse_config(config: Mapping[str, Any]) -> StoredQuantization:
    method = config.get("quant_method")
    if method == "fp8":
        return _fine_grained_fp8(config)
    if method in ("gptq", "awq"):
        return _packed_int(config)
    if method != "compressed-tensors":
        raise UnsupportedQuantization(f"checkpoint quantization method {method!r} is not supported (omnistage reads "
                                      "compressed-tensors pack-quantized and float-quantized checkpoints, "
                                      "transformers' fp8, gptq and awq)")
    fmt = config.get("format")
    groups, fp8_groups, asymmetric = [], [], []
    for name, group in (config.get("config_groups") or {}).items():
        group_format = group.get("format") or fmt
        w = group.get("weights") or {}
        scheme = {k: w.get(k) for k in ("num_bits", "type", "symmetric", "strategy", "group_size")}
        if group_format in ("float-quantized", "naive-quantized") and w.get("type") == "float":
            fp8_groups.append(_fp8_group(name, group, w, scheme))
            continue
        if group_format != "pack-quantized":
            raise UnsupportedQuantization(f"compressed-tensors format {group_format!r} (config group {name!r}) is not "
                                          "supported; omnistage reads pack-quantized and float-quantized (FP8)")
        if (group.get("input_activations") or group.get("output_activations") or w.get("type") != "int"
                or w.get("symmetric") not in (True, False) or w.get("num_bits") not in (4, 8)
                or w.get("strategy") not in ("group", "channel")
                or (w.get("strategy") == "group" and not isinstance(w.get("group_size"), int))):
            activations = {k: group.get(k) for k in ("input_activations", "output_activations") if group.get(k)}
            raise UnsupportedQuantization(f"compressed-tensors scheme of config group {name!r} is not supported: "
                                          f"weights {scheme}{f', activations {activations}' if activations else ''} "
                                          f"(supported: {_SUPPORTED})")
        group_size = w["group_size"] if w["strategy"] == "group" else None
        entry = (tuple(group.get("targets") or ()), int(w["num_bits"]), group_size)
        (groups if w["symmetric"] else asymmetric).append(entry)
    if not groups and not fp8_groups and not asymmetric:
        raise UnsupportedQuantization("compressed-tensors quantization_config has no config_groups")
    return StoredQuantization(tuple(groups), tuple(config.get("ignore") or ()), tuple(fp8_groups),
                              asymmetric=tuple(asymmetric))


def _fine_grained_fp8(config: Mapping[str, Any]) -> StoredQuantization:
    """transformers' ``quant_method: fp8``: every weight stored with a ``weight_scale_inv`` is an FP8 layer, scaled
    per block of ``weight_block_size`` (null: per tensor)."""
    block = config.get("weight_block_size")
    problems = []
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        problems.append(f"weight_block_size {block!r} (two positive ints, or null)")
    if config.get("expert_dtype", "fp8") != "fp8":
        problems.append(f"expert_dtype {config.get('expert_dtype')!r} (FP4-packed experts)")
    if config.get("scale_fmt", "float") not in ("float", "ue8m0"):
        problems.append(f"scale_fmt {config.get('scale_fmt')!r}")
    if problems:
        raise UnsupportedQuantization(f"fp8 quantization_config: {'; '.join(problems)} is not supported")
    strategy = "tensor" if block is None else "block"
    return StoredQuantization((), (), ((("Linear",), strategy, None if block is None else tuple(block)),),
                              fp8_scale_name="weight_scale_inv")


def _fp8_group(name: str, group: Mapping[str, Any], w: Mapping[str, Any],
               scheme: Mapping[str, Any]) -> tuple[tuple[str, ...], str, tuple[int, int] | None]:
    """An FP8 config group as (targets, strategy, block), or UnsupportedQuantization naming what it is. Its
    activation scheme, float 8-bit where present, is not applied (weight-only: the module docstring)."""
    block = w.get("block_structure")
    acts = [group.get(k) for k in ("input_activations", "output_activations") if group.get(k)]
    ok = (w.get("num_bits") == 8 and w.get("symmetric") is True and w.get("strategy") in FP8_STRATEGIES
          and (w.get("strategy") != "block" or (isinstance(block, list) and len(block) == 2
                                                 and all(isinstance(b, int) and b > 0 for b in block)))
          and all(a.get("type") == "float" and a.get("num_bits") == 8 for a in acts))
    if not ok:
        raise UnsupportedQuantization(f"compressed-tensors scheme of config group {name!r} is not supported: weights "
                                      f"{dict(scheme, block_structure=block)}"
                                      f"{f', activations {acts}' if acts else ''} (supported: {_SUPPORTED})")
    return tuple(group.get("targets") or ()), w["strategy"], tuple(block) if w["strategy"] == "block" else None


@dataclass(frozen=True)
class StoredLayers:
    """A pre-quantized checkpoint's layers as the float weights they stand for (names as in its files):
    ``packed`` ``X.weight`` -> ([N, K], format), read from ``X.weight_packed``; ``fp8`` ``X.weight`` -> its
    scaling, dequantized as read; ``aux``: the names read with their layer, not tensors of a module."""

    packed: dict[str, tuple[tuple[int, int], QuantFormat]]
    fp8: dict[str, Fp8Scale]
    aux: frozenset[str]
    # GPTQ / AWQ / pack-quantized with zero points: ``X.weight`` -> ([N, K], scheme), dequantized as read (the
    # scheme's first stored tensor, ``X.qweight`` or ``X.weight_packed``, brings it in)
    packed_int: dict[str, tuple[tuple[int, int], PackedInt]] = field(default_factory=dict)

    def stand_in(self, shapes: dict[str, Any], packed_value: Any) -> None:
        """``shapes`` (name -> anything, e.g. a shape) as the float checkpoint would list it: the aux names
        dropped, each packed layer's ``X.weight`` in as ``packed_value(shape)``."""
        for name in self.aux:
            shapes.pop(name, None)
        for name, (shape, _) in (*self.packed.items(), *self.packed_int.items()):
            shapes[name] = packed_value(shape)


def stored_layers(shapes: Mapping[str, tuple[int, ...]], stored: StoredQuantization,
                  prefix: str = "") -> StoredLayers:
    """The checkpoint's packed, FP8 and dequantized-integer layers, from the files' headers (packed: K = words * 32
    / bits), named as in ``shapes`` (relative to ``prefix``; the config's targets match the full names). Raises
    UnsupportedQuantization for a packed layer no config group covers, or one without its scale."""
    packed, fp8, aux, packed_int = {}, {}, set(), {}
    for name, shape in shapes.items():
        scheme = None
        if stored.packed_int is not None and name.endswith(".qweight"):
            scheme, module = stored.packed_int, name[: -len(".qweight")]
        elif stored.asymmetric and name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            scheme = stored.asymmetric_for(prefix + module)
        if scheme is not None:
            absent = [n for n in scheme.names if f"{module}.{n}" not in shapes]
            if absent or len(shape) != 2:
                raise UnsupportedQuantization(f"{prefix}{module}: a {scheme.method} layer needs "
                                              f"{', '.join(scheme.names)} (2-D {scheme.names[0]}); "
                                              f"{absent or list(shape)}")
            packed_int[module + ".weight"] = (scheme.weight_shape(shape), scheme)
            aux.update(f"{module}.{n}" for n in scheme.names)
            continue
        if name.endswith(".weight") and name[: -len("weight")] + stored.fp8_scale_name in shapes:
            module = name[: -len(".weight")]
            scale = stored.fp8_scheme(prefix + module)
            if scale is not None:
                fp8[name] = scale
                aux.update(n for n in (f"{module}.{suffix}" for suffix in (scale.scale_name, *FP8_SUFFIXES))
                           if n in shapes)
            continue
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        if module + ".weight_scale" not in shapes:
            raise UnsupportedQuantization(f"{prefix}{module}: weight_packed without weight_scale")
        for bits in (4, 8):
            fmt = stored.format_for(prefix + module, shape[-1] * 32 // bits)
            if fmt is not None and fmt.bits == bits:
                break
        else:
            raise UnsupportedQuantization(f"{prefix}{module} is stored packed but no config group of its quantization_config "
                                          "covers it (or it is listed in ignore)")
        packed[module + ".weight"] = ((shape[0], shape[-1] * 32 // fmt.bits), fmt)
        aux.update(n for n in (f"{module}.{suffix}" for suffix in SUFFIXES) if n in shapes)
    return StoredLayers(packed, fp8, frozenset(aux), packed_int)


def unpack(packed: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (weight_packed, weight_scale) -> (int8 values [N, K] in the format's range, float32 scales
    [N, groups])."""
    if sys.byteorder != "little":
        raise UnsupportedQuantization("reading pack-quantized weights needs a little-endian host")
    data = packed.contiguous().view(torch.uint8)
    if fmt.bits == 4:
        low = (data & 0x0F).to(torch.int8) - 8
        high = (data >> 4).to(torch.int8) - 8
        values = torch.stack((low, high), dim=-1).flatten(-2)
    else:
        values = (data.to(torch.int16) - 128).to(torch.int8)
    return values, scale.float().reshape(values.shape[0], -1)


def pack(values: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """int8 values [N, K] in the format's range -> ``weight_packed`` (int32 [N, K * bits / 32]; ``unpack``'s
    inverse)."""
    if sys.byteorder != "little":
        raise UnsupportedQuantization("writing pack-quantized weights needs a little-endian host")
    if fmt.bits == 4:
        data = pack_nibbles(values)
    else:
        data = (values.to(torch.int16) + 128).to(torch.uint8)
    if data.shape[-1] % 4:
        raise ValueError(f"{values.shape[-1]} values per row do not fill whole int32 words at {fmt.bits} bits")
    return data.contiguous().view(torch.int32)


def stored_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float scales ([N] per channel, [N, groups]) -> ``weight_scale`` ([N, 1] or [N, groups])."""
    return (scales[:, None] if scales.dim() == 1 else scales).to(dtype).contiguous()


def quantization_config(groups: list[tuple[list[str], QuantFormat]], ignore: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``groups`` (module targets, format) and ``ignore``."""
    config_groups = {}
    for i, (targets, fmt) in enumerate(groups):
        config_groups[f"group_{i}"] = {
            "targets": list(targets),
            "weights": {"num_bits": fmt.bits, "type": "int", "symmetric": True, "dynamic": False,
                        "strategy": "channel" if fmt.per_channel else "group",
                        "group_size": fmt.group_size, "observer": "minmax",
                        "actorder": None},
            "input_activations": None, "output_activations": None, "format": "pack-quantized",
        }
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": list(ignore), "kv_cache_scheme": None}
