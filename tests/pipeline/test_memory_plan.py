"""The memory plan: what each stage will hold (weights from the checkpoint's headers, the KV pool as its
scheduler sizes it) before anything loads, equal to what the loaded engine holds; a pipeline that does not fit
the device is refused with an error naming the stage, the bytes and the options."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from omnistage.config import ConfigError
from omnistage.models.registry import family_for_checkpoint, load_pipeline_config
from omnistage.pipeline import memory_plan
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.runtime_env import cpu_computes_bf16


def _held_bytes(stage_model) -> int:
    """Bytes of the distinct parameters of every module a stage model holds (one level of helper objects deep:
    e.g. the Thinker's media encoders); buffers are derived tables (rotary, sinusoids), not checkpoint weights."""
    tensors: dict[int, int] = {}
    holders = [stage_model, *(v for v in vars(stage_model).values() if type(v).__module__.startswith("omnistage"))]
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, nn.Module):
                for t in value.parameters():
                    tensors[t.data_ptr()] = t.numel() * t.element_size()
    return sum(tensors.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_equals_what_the_loaded_engine_holds(tiny_ckpt, dtype):
    engine = OmniEngine(EngineArgs(str(tiny_ckpt), dtype=dtype, fast=False), load_pipeline_config("qwen3_omni"))
    try:
        plans = {p.stage: p for p in engine.memory_plan}
        assert list(plans) == ["thinker", "talker", "code2wav"]
        for name, stage in engine.orchestrator.stages.items():
            plan = plans[name]
            kv = sum(t.numel() * t.element_size() for t in getattr(stage.runner, "kv_caches", None) or [])
            assert plan.kv_bytes == kv and (kv > 0) == (name != "code2wav"), name
            held = _held_bytes(stage.runner.model)
            assert plan.weight_bytes == held, (name, plan.weight_bytes, held)
            assert plan.device == "cpu"
    finally:
        engine.shutdown()
    # bfloat16 halves the weights and the KV of float32 (Code2Wav's weights: where this CPU has bfloat16
    # arithmetic; without it Code2Wav runs in float32, its weights as in a float32 engine).
    if dtype == "bfloat16":
        f32 = memory_plan.plan_memory(engine.family, engine.pipeline, torch.float32, "cpu")
        for a, b in zip(engine.memory_plan, f32, strict=True):
            halved = a.stage != "code2wav" or cpu_computes_bf16()
            assert abs((2 if halved else 1) * a.weight_bytes - b.weight_bytes) <= 64, a.stage
            assert 2 * a.kv_bytes == b.kv_bytes


class _Built(Exception):
    pass


def test_a_pipeline_that_does_not_fit_is_refused_before_loading(tiny_ckpt, monkeypatch):
    def build_stage(*args, **kwargs):
        raise _Built

    monkeypatch.setattr("omnistage.pipeline.engine.build_stage", build_stage)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: 64 << 20)  # 64 MiB free
    with pytest.raises(ConfigError) as info:
        OmniEngine(EngineArgs(str(tiny_ckpt)), load_pipeline_config("qwen3_omni"))
    family = family_for_checkpoint(str(tiny_ckpt))(str(tiny_ckpt))
    plans = memory_plan.plan_memory(family, load_pipeline_config("qwen3_omni"), torch.float32, "cpu")
    worst = max(plans, key=lambda p: p.total)
    assert info.value.stage == worst.stage  # the stage needing the most is named
    text = str(info.value)
    need = sum(p.total for p in plans) / (1 << 30)
    assert f"needs {need:.2f} GiB on cpu" in text and "0.06 GiB is available" in text
    assert all(f"{p.stage} {p.weight_bytes / (1 << 30):.2f} GiB weights" in text for p in plans)
    assert "--dtype bfloat16" in text and "kv_cache_bytes" in text and memory_plan.SKIP_ENV in text
    # The override loads anyway: the engine goes on to build its stages.
    monkeypatch.setenv(memory_plan.SKIP_ENV, "1")
    with pytest.raises(_Built):
        OmniEngine(EngineArgs(str(tiny_ckpt)), load_pipeline_config("qwen3_omni"))


def test_stages_on_different_devices_are_checked_per_device():
    plans = [memory_plan.StageMemory("a", "cpu", 3 << 30, 0), memory_plan.StageMemory("b", "cuda:1", 5 << 30, 1 << 30)]
    memory_plan.check_fits(plans, available=lambda d: {"cpu": 4 << 30, "cuda:1": 8 << 30}[d])
    with pytest.raises(ConfigError, match="needs 6.00 GiB on cuda:1"):
        memory_plan.check_fits(plans, available=lambda d: {"cpu": 4 << 30, "cuda:1": 5 << 30}[d])
    memory_plan.check_fits(plans, available=lambda d: None)  # unknown: not refused


def test_the_refusal_names_the_options_beyond_those_already_chosen():
    plans = [memory_plan.StageMemory("thinker", "cpu", 3 << 30, 1 << 30)]

    def refusal(**chosen) -> str:
        with pytest.raises(ConfigError) as err:
            memory_plan.check_fits(plans, available=lambda d: 1 << 30, **chosen)
        return str(err.value)

    assert "--dtype bfloat16" in refusal() and "--quantization int4 or int8" in refusal()
    text = refusal(dtype="bfloat16", quantization="int8")
    assert "--dtype" not in text and "--quantization int4 (" in text
    text = refusal(dtype="bfloat16", quantization="int4")
    assert "--dtype" not in text and "--quantization" not in text and "kv_cache_bytes" in text


def test_the_full_released_model_is_planned_from_its_headers(tmp_path):
    """Qwen3-Omni-30B-A3B at full depth (35 B parameters, headers only: no data on disk): in bfloat16 the plan
    is the checkpoint's bytes (Code2Wav in float32 where the CPU has no bfloat16 arithmetic); with int4 the
    whole model and its default KV budgets fit in 21.5 GiB, the headline's 24 GiB machine."""
    from omnistage.pipeline.engine import plan_engine
    from omnistage.testing.header_checkpoint import header_only_checkpoint

    try:
        ckpt = header_only_checkpoint(tmp_path / "full")
    except OSError as exc:  # (no holes in files here)
        pytest.skip(str(exc))
    sizes = memory_plan.tensor_sizes(ckpt)
    assert len(sizes) > 28_000 and sum(p.stat().st_blocks * 512 for p in ckpt.iterdir()) < 64 << 20

    def stored(prefix: str) -> int:
        return sum(2 * math.prod(shape) for name, (shape, _) in sizes.items() if name.startswith(prefix))

    assert 70.4e9 < stored("") < 70.6e9  # the released checkpoint's 70.5 GB
    bf16 = {p.stage: p for p in plan_engine(EngineArgs(str(ckpt), dtype="bfloat16")).memory}
    assert bf16["thinker"].weight_bytes == stored("thinker.") and bf16["talker"].weight_bytes == stored("talker.")
    assert bf16["code2wav"].weight_bytes == stored("code2wav.") * (1 if cpu_computes_bf16() else 2)
    int4 = plan_engine(EngineArgs(str(ckpt), dtype="bfloat16", quantization="int4")).memory
    assert sum(p.total for p in int4) < 21.5 * (1 << 30)
    assert all(q.weight_bytes < bf16[q.stage].weight_bytes / 3.4 for q in int4 if q.stage != "code2wav")
