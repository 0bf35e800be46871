import ctypes.util
import subprocess
import sys

import pytest

from omnistage import runtime_env
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs


def test_configure_allocator_applies_once_and_is_idempotent(monkeypatch):
    first = runtime_env.configure_allocator()
    if ctypes.util.find_library("c") and runtime_env._glibc() is not None:
        assert first.applied and first.mmap_max == 0
        assert first.mmap_threshold == runtime_env.MMAP_THRESHOLD_BYTES
    # Later calls return the first result without touching the C library again.
    monkeypatch.setattr(runtime_env, "_glibc", lambda: pytest.fail("allocator configured twice"))
    assert runtime_env.configure_allocator() is first


def test_configure_allocator_is_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(runtime_env, "_result", None)
    monkeypatch.setattr(runtime_env, "_glibc", lambda: None)
    settings = runtime_env.configure_allocator()
    assert not settings.applied and settings.mmap_threshold is None
    assert runtime_env.configure_allocator() is settings


_DECODE_TWICE = """
import sys, torch
from omnistage import runtime_env
from omnistage.models.loader import load_into
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
torch.set_num_threads(1)
model = Code2Wav(Code2WavConfig.from_checkpoint(sys.argv[1])).eval()
load_into(model, sys.argv[1], "code2wav.")
codes = torch.randint(0, model.config.codebook_size, (3, model.config.num_quantizers, 60),
                      generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    before = model(codes)
    settings = runtime_env.configure_allocator()
    after = [model(codes) for _ in range(2)]  # the second call reuses the blocks the first one freed
print(settings.applied, all(torch.equal(before, a) for a in after), before.numel())
"""


def test_allocator_setting_leaves_code2wav_output_unchanged(tiny_ckpt):
    """Code2Wav's audio is the same bits before and after the setting (a fresh process: this one may have
    applied it already, engines do at start)."""
    done = subprocess.run([sys.executable, "-c", _DECODE_TWICE, str(tiny_ckpt)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    applied, same, samples = done.stdout.split()
    assert same == "True" and int(samples) > 0
    assert applied == str(runtime_env._glibc() is not None)


class _FakeLibc:
    """The glibc calls runtime_env makes, recorded (and nothing changed in this process's allocator)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gnu_get_libc_version = lambda: b"2.36"
        self.mallopt = lambda param, value: self.calls.append(f"mallopt {param}") or 1
        self.malloc_trim = lambda pad: self.calls.append("malloc_trim") or 1


def test_building_a_stage_applies_the_allocator_setting_once(tiny_ckpt, monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(runtime_env, "_result", None)
    monkeypatch.setattr(runtime_env, "_glibc", lambda: libc)
    OmniEngine(EngineArgs(str(tiny_ckpt)))
    # three stages, one process: the three settings once; the loads' freed weights handed back as they go
    assert [c for c in libc.calls if c.startswith("mallopt")] == ["mallopt -3", "mallopt -1", "mallopt -4"]
    assert "malloc_trim" in libc.calls


def test_release_free_heap_trims_without_configure_allocator(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(runtime_env, "_result", None)
    monkeypatch.setattr(runtime_env, "_glibc", lambda: libc)
    assert runtime_env.release_free_heap() and libc.calls == ["malloc_trim"]
    monkeypatch.setattr(runtime_env, "_glibc", lambda: None)  # off glibc: nothing to call
    assert not runtime_env.release_free_heap()


def test_freeze_loaded_objects_moves_live_objects_out_of_the_collector():
    """What is alive when a serving process finishes its load is frozen (full collections skip it); garbage
    made before is collected first, not frozen with it."""
    import gc

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = Cycle()
    alive = Cycle()
    collected = []
    import weakref

    ref = weakref.ref(garbage, lambda r: collected.append(r))
    del garbage
    try:
        frozen = runtime_env.freeze_loaded_objects()
        assert collected and ref() is None  # the cycle was collected before the freeze
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # frozen objects are not in any generation
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
