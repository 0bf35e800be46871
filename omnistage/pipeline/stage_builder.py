"""Build one stage in this process (the engine's in-process backend, and every stage worker): its model from the
family and the checkpoint, its scheduler, its runner (eager or CUDA graphs) with a KV pool sized by the config,
and the bridge of its incoming edge."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from omnistage.config import ConfigError, ExecutionType, StageConfig
from omnistage.core.generation_scheduler import GenerationScheduler
from omnistage.core.scheduler import ARScheduler
from omnistage.models.family import BuildContext, ModelFamily
from omnistage.pipeline.ar_stage import ARStage
from omnistage.pipeline.engine_args import DTYPES, EngineArgs
from omnistage.pipeline.faults import FaultInjector
from omnistage.pipeline.generation_stage import GenerationStage
from omnistage.pipeline.memory_plan import kv_block_bytes
from omnistage.pipeline.stage import Stage
from omnistage.runner.ar_runner import ARRunner
from omnistage.runner.generation_runner import GenerationRunner
from omnistage.runner.graph_runner import CUDAGraphARRunner, GraphRunnerConfig
from omnistage.runtime_env import configure_allocator, release_free_heap


def kv_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
    return kv_block_bytes(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype)


def build_stage(family: ModelFamily, stage: StageConfig, runner: str, args: EngineArgs,
                faults: FaultInjector | None = None) -> Stage:
    """One stage: its model (built by the family from the checkpoint), scheduler, runner and bridge."""
    configure_allocator()  # once per process that holds a stage: freed large blocks stay for reuse
    dtype = DTYPES[args.dtype]
    model = family.build_model(BuildContext(Path(args.model), dtype, args.device, stage, args.fast,
                                            args.quant.for_stage(stage.quantization)))
    release_free_heap()  # the loader's and the packing's temporaries (e.g. a float32 copy of a bfloat16 tensor)
    bridge = family.build_bridge(stage.bridge, model, stage.bridge_args) if stage.bridge else None
    s = stage.scheduler
    if stage.execution is ExecutionType.GENERATION:
        return GenerationStage(stage.name, GenerationScheduler(s.max_num_seqs), GenerationRunner(model), bridge,
                               faults)
    try:
        num_blocks = s.resolve_num_blocks(kv_bytes_per_block(model, s.block_size, dtype))
    except ValueError as exc:
        raise ConfigError(str(exc), stage=stage.name, field="scheduler") from None
    if runner == "cuda_graph":
        buckets = tuple(1 << i for i in range((s.max_num_seqs - 1).bit_length() + 1))
        graph = GraphRunnerConfig(decode_buckets=buckets, max_model_len=s.max_model_len)
        ar_runner: ARRunner = CUDAGraphARRunner(model, num_blocks=num_blocks, block_size=s.block_size,
                                                dtype=dtype, device=args.device, graph_config=graph)
    else:
        ar_runner = ARRunner(model, num_blocks=num_blocks, block_size=s.block_size, dtype=dtype, device=args.device)
    if s.enable_prefix_caching and not hasattr(model, "block_extra_key"):
        # A model that does not say what besides token ids decides its KV cannot share blocks safely.
        s = dataclasses.replace(s, enable_prefix_caching=False)
    return ARStage(stage.name, ARScheduler(s, num_blocks), ar_runner, bridge, faults)
