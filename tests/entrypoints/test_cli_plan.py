"""``omnistage plan``: the memory the engine would plan for a checkpoint and configuration (per stage weights and
KV cache, per device against what it has available), printed without loading anything; exit 1 and the engine's
refusal (naming the stage and the options) where it does not fit, exit 2 for a configuration the engine refuses."""

from __future__ import annotations

import re

import pytest

from omnistage.entrypoints import cli
from omnistage.pipeline import memory_plan
from omnistage.pipeline.engine import plan_engine
from omnistage.pipeline.omni import engine_args


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(out: str, stage: str) -> tuple[str, str, str]:
    return re.search(rf"^{stage} +(\S+) +([\d.]+ [MG]iB) +([\d.]+ [MG]iB)$", out, re.M).groups()


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "int4")])
def test_plan_prints_the_engines_memory_plan_and_fits(tiny_ckpt, capsys, dtype, quantization):
    code, out, _ = _plan(capsys, "--model", str(tiny_ckpt), "--dtype", dtype, "--quantization", quantization)
    assert code == 0 and "cpu: needs" in out and out.rstrip().endswith("fits")
    want = plan_engine(engine_args(tiny_ckpt, None, dtype, "cpu", True, None, quantization)).memory
    assert [p.stage for p in want] == ["thinker", "talker", "code2wav"]
    for p in want:
        device, weights, kv = _row(out, p.stage)
        assert device == "cpu" and weights == cli._size(p.weight_bytes) and kv == cli._size(p.kv_bytes)
    assert f"needs {cli._size(sum(p.total for p in want))}" in out


def test_plan_that_does_not_fit_exits_1_naming_the_options(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: 1 << 20)  # 1 MiB available
    code, out, err = _plan(capsys, "--model", str(tiny_ckpt))
    assert code == 1 and "available 1.0 MiB: does not fit" in out
    assert "--quantization int4" in err and "--dtype bfloat16" in err


def test_plan_of_a_configuration_the_engine_refuses_exits_2(tiny_ckpt, capsys):
    code, _, err = _plan(capsys, "--model", str(tiny_ckpt), "--stage-config", "qwen2_5_omni")
    assert code == 2 and "model family 'qwen2_5_omni'" in err
