import ctypes.util

import pytest

from omnistage import runtime_env


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
