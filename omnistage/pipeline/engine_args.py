"""EngineArgs: what an engine is built from (checkpoint, pipeline preset, dtype, device, kernels, backend),
validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.config.quantization import Quantization
from omnistage.config.stage_config import EXECUTOR_BACKENDS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineArgs:
    model: str
    stage_config: str | None = None  # preset name or YAML path; None: the checkpoint family's preset
    dtype: str = "float32"
    device: str = "cpu"
    fast: bool = True  # packed oneDNN kernels on CPU (rounding differs from the reference's; False: reference kernels)
    distributed_executor_backend: str | None = None  # inproc | mp | ray; None: the pipeline config's
    worker_startup_timeout: float = 600.0  # seconds every stage worker has to load and answer Ready
    quantization: str = "none"  # none | int8 | int4: weight-only, online while loading (a stage may override)
    quantization_group_size: int | None = None  # inputs per scale (None: int4 128, int8 per output channel)
    enable_prefix_caching: bool = True  # False: no AR stage shares KV blocks (overrides the stage configs)

    @property
    def quant(self) -> Quantization:
        return Quantization(self.quantization, self.quantization_group_size)

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if not (isinstance(self.worker_startup_timeout, (int, float)) and self.worker_startup_timeout > 0):
            raise ValueError(f"worker_startup_timeout must be > 0, got {self.worker_startup_timeout!r}")
        Quantization(self.quantization, self.quantization_group_size)  # raises on a bad method or group size
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not Path(self.model).is_dir():
            raise ValueError(f"model directory {self.model!r} does not exist")
