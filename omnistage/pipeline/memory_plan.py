"""What a pipeline will hold in memory, planned before any weight is read, and refused when it cannot fit.

Per stage: the weights its part declares (``PartSpec.weight_prefixes``), sized from the files' headers in
the serving dtype, and its paged KV pool as the scheduler will size it (``resolve_num_blocks`` over the family's
``kv_geometry``). The stages sharing a device are summed and compared with what that device has available
(``MemAvailable`` for the CPU, ``torch.cuda.mem_get_info`` for a GPU): a pipeline that needs more is refused
with an error naming the stage that needs the most, the bytes and the options, instead of being killed by the
OOM killer halfway through loading. Activations and encoder caches come on top (they are bounded by the
batch limits), so the plan is a floor, not a ceiling. ``OMNISTAGE_SKIP_MEMORY_CHECK=1`` skips the refusal.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.config import ConfigError, ExecutionType, PipelineConfig
from omnistage.config.quantization import NO_QUANTIZATION, Quantization
from omnistage.models.family import ModelFamily
from omnistage.models.layers.quant import QuantFormat
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.loader import checkpoint_files, open_weights
from omnistage.models.prequantized import read_stored, stored_layers

SKIP_ENV = "OMNISTAGE_SKIP_MEMORY_CHECK"
_GIB = 1 << 30


@dataclass(frozen=True)
class StageMemory:
    stage: str
    device: str
    weight_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


# Bytes per element of the safetensors dtypes that are not floating point (floats load in the serving dtype).
_STORED_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one paged KV block: keys and values of ``block_size`` tokens in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def tensor_sizes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Every checkpoint tensor's (shape, stored bytes per element, None for floating point: those load in the
    serving dtype), from the files' headers (no data read)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_files(model_dir).items():
        by_file.setdefault(path, []).append(name)
    out: dict[str, tuple[tuple[int, ...], int | None]] = {}
    for path, names in by_file.items():
        with open_weights(path) as f:
            for name in names:
                view = f.get_slice(name)
                out[name] = (tuple(view.get_shape()), _STORED_BYTES.get(view.get_dtype()))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _weight_bytes(name: str, shape: tuple[int, ...], stored: int | None, width: int, prefixes: tuple[str, ...],
                  scheme: QuantScheme | None, device: str) -> int:
    """One tensor's bytes once loaded: quantized where the part's scheme quantizes it (names relative to the
    part's prefix), else its stored width (integers) or the serving width."""
    quantized = None
    if scheme is not None:
        prefix = next(p for p in prefixes if name.startswith(p))
        quantized = scheme.weight_bytes(name[len(prefix):], shape, width, torch.device(device))
    if quantized is not None:
        return quantized
    return _numel(shape) * (width if stored is None else stored)


def plan_memory(family: ModelFamily, pipeline: PipelineConfig, dtype: torch.dtype, device: str,
                placement: dict[str, str] | None = None,
                quantization: Quantization = NO_QUANTIZATION) -> list[StageMemory]:
    """Each stage's weights and KV pool in bytes; ``placement``: a stage's device where it is not ``device``;
    ``quantization``: the engine's (a stage's own ``quantization`` overrides it), sized by the family's scheme.
    Raises ConfigError naming the stage where the family cannot quantize its part."""
    declared = any(family.parts[pipeline.stage(n).model_part].weight_prefixes for n in pipeline.order)
    sizes = tensor_sizes(family.model_dir) if declared else {}  # (a family may declare no weights at all)
    stored = read_stored(family.model_dir) if declared else None
    packed: dict[str, QuantFormat] = {}
    if stored is not None:  # a pre-quantized checkpoint: each packed layer counted as the weight it stands for
        layers = stored_layers({n: s for n, (s, _) in sizes.items()}, stored)
        layers.stand_in(sizes, lambda shape: (shape, None))  # (FP8 weights load dequantized: the serving width)
        packed = {name: fmt for name, (_, fmt) in layers.packed.items()}
    plans = []
    for name in pipeline.order:
        stage = pipeline.stage(name)
        part = family.parts[stage.model_part]
        stage_device = (placement or {}).get(name, device)
        width = family.weight_dtype(stage.model_part, dtype, stage_device).itemsize
        try:
            scheme = family.quant_scheme(stage.model_part, quantization.for_stage(stage.quantization))
        except ValueError as exc:
            raise ConfigError(str(exc), stage=name, field="quantization") from None
        exact = {n[len(p):]: fmt for n, fmt in packed.items() for p in part.weight_prefixes[:1] if n.startswith(p)}
        if exact:
            scheme = QuantScheme(scheme.formats if scheme is not None else {}, exact=exact)
        weights = sum(
            _weight_bytes(tensor, shape, stored, width, part.weight_prefixes, scheme, stage_device)
            for tensor, (shape, stored) in sizes.items()
            if tensor.startswith(part.weight_prefixes) and not (part.weight_skip and tensor.startswith(part.weight_skip))
        ) if part.weight_prefixes else 0
        kv = 0
        geometry = family.kv_geometry(stage.model_part) if stage.execution is ExecutionType.AR else None
        if geometry is not None:
            s = stage.scheduler
            per_block = kv_block_bytes(*geometry, s.block_size, dtype)
            try:
                kv = (s.resolve_num_blocks(per_block) + 1) * per_block  # (+ the scratch block padded rows write)
            except ValueError:
                kv = 0  # a budget that cannot hold one request: the stage itself refuses it as it builds
        plans.append(StageMemory(name, stage_device, weights, kv))
    return plans


def available_bytes(device: str) -> int | None:
    """What ``device`` has free now: the host's MemAvailable for the CPU, the GPU's free memory; None unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(dev.index or 0)[0]
    if dev.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class DeviceNeed:
    """The stages placed on one device, what they need together and what the device has available (None:
    unknown)."""

    device: str
    stages: tuple[StageMemory, ...]
    have: int | None

    @property
    def need(self) -> int:
        return sum(p.total for p in self.stages)

    @property
    def fits(self) -> bool:
        return self.have is None or self.need <= self.have


def device_needs(plans: list[StageMemory], available: Callable[[str], int | None] | None = None) -> list[DeviceNeed]:
    """Per device (in stage order): its stages and what it has available (``available``, default
    ``available_bytes``)."""
    available = available or available_bytes
    devices = dict.fromkeys(p.device for p in plans)
    return [DeviceNeed(d, tuple(p for p in plans if p.device == d), available(d)) for d in devices]


def check_fits(plans: list[StageMemory], available: Callable[[str], int | None] | None = None,
               dtype: str = "float32", quantization: str = "none") -> None:
    """Raise ConfigError when the stages placed on one device need more than it has available
    (``available(device)``, default ``available_bytes``); the options it names are those beyond ``dtype`` and
    ``quantization``, the ones the plan was made with."""
    if os.environ.get(SKIP_ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
        return
    for need in device_needs(plans, available):
        if not need.fits:
            raise refusal(need, dtype, quantization)


def refusal(device_need: DeviceNeed, dtype: str = "float32", quantization: str = "none") -> ConfigError:
    """The error for a device whose stages do not fit: the bytes per stage, and the options beyond ``dtype`` and
    ``quantization``, the ones the plan was made with."""
    device, here, need, have = device_need.device, device_need.stages, device_need.need, device_need.have
    worst = max(here, key=lambda p: p.total)
    parts = ", ".join(f"{p.stage} {p.weight_bytes / _GIB:.2f} GiB weights + {p.kv_bytes / _GIB:.2f} GiB KV"
                      for p in here)
    options = []
    if dtype == "float32":
        options.append("--dtype bfloat16 (half the weight bytes of float32)")
    if quantization in ("none", "int8"):
        options.append(f"--quantization {'int4 or int8' if quantization == 'none' else 'int4'} (weight-only: the "
                       "decoders' weights in 4 or 8 bits)")
    options += ["a smaller kv_cache_bytes, max_model_len or max_num_seqs in the stage config",
                "stages on other devices (devices: in the stage config, with --distributed-executor-backend mp "
                "or ray)"]
    return ConfigError(
        f"the pipeline needs {need / _GIB:.2f} GiB on {device} ({parts}) but {have / _GIB:.2f} GiB is "
        f"available; options: {', '.join(options)}; {SKIP_ENV}=1 loads anyway", stage=worst.stage)
