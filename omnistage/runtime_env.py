"""Process-wide runtime settings an engine applies once when it loads its models.

glibc's malloc returns large freed blocks to the kernel (``munmap`` above the mmap threshold, heap trimming
above the trim threshold) and faults fresh zero pages back in on the next allocation. Code2Wav allocates and
frees tens to hundreds of megabytes of activations per call, so with the defaults every call pays those
page faults again: measured on the small preset (1 thread), 16 rows x 25 frames took 116k minor faults per
call, 4 rows x 300 frames 5M; with ``configure_allocator`` 600 and 1.2k, and the 300-frame decode needs
1.7x less CPU time. Freed blocks stay in the process for reuse, so its resident size stays at its peak;
that is what a serving process wants. No effect (and no error) on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading
from dataclasses import dataclass
from pathlib import Path

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit; larger values are rejected.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1 << 30


@dataclass(frozen=True)
class AllocatorSettings:
    applied: bool  # False off glibc (nothing changed)
    mmap_threshold: int | None = None
    trim_threshold: int | None = None
    mmap_max: int | None = None


_lock = threading.Lock()
_result: AllocatorSettings | None = None


@functools.cache  # find_library searches the linker paths (~2 ms); release_free_heap asks once per 256 MB at load
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def configure_allocator() -> AllocatorSettings:
    """Keep freed large blocks in the process (glibc only). Idempotent: the first call applies the settings,
    later calls return the same result without touching the allocator again."""
    global _result
    with _lock:
        if _result is not None:
            return _result
        libc = _glibc()
        if libc is None:
            _result = AllocatorSettings(applied=False)
            return _result
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        # Setting either threshold explicitly also turns off glibc's dynamic threshold adjustment.
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
        # Blocks above the (capped) mmap threshold would still be mapped and unmapped per call: serve them
        # from the heap too. glibc still maps memory when the heap cannot grow (and for thread arenas'
        # blocks larger than their heaps), so no allocation fails because of it.
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and ok
        _result = AllocatorSettings(
            applied=ok,
            mmap_threshold=MMAP_THRESHOLD_BYTES if ok else None,
            trim_threshold=TRIM_THRESHOLD_BYTES if ok else None,
            mmap_max=0 if ok else None,
        )
        return _result


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim``); False off glibc.

    ``configure_allocator`` keeps freed blocks for reuse, which is right for activations but not for weights
    released at load: a linear layer packed for the fast kernels frees its unpacked copy, and its packed copy
    may live elsewhere (2 MB-page mappings), so without a trim the process would keep both (measured on the
    small preset, float32 with the panel kernels: 0.8 GB resident beyond one copy of its 1.4 GB of weights).
    glibc's own trimming only returns the top of the main heap, so free pages between live blocks stay
    resident without ``configure_allocator`` too: transformers' float32 model at the released widths (2 layers
    per stack, 12.8 GB) left 2.0 GB resident after it was freed, 0.32 GB after a trim."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    libc.malloc_trim(0)
    return True


def freeze_loaded_objects() -> int:
    """Move every object alive now (torch's and transformers' modules, the model, the tokenizer) out of the
    cyclic garbage collector's generations (``gc.freeze``, after a collection), once a stage is built: the full
    collections that serving's short-lived objects trigger then walk only what serving made. A built small-preset
    pipeline holds ~450k tracked objects; 16 requests through it took 0.986x the time frozen (median of 4
    alternating runs). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def resident_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``: weights, KV pools, activations; the checkpoint's
    file pages, which the kernel can drop, left out); 0 where /proc is unavailable."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0
    line = next((x for x in status.read_text().splitlines() if x.startswith("RssAnon:")), "RssAnon: 0 kB")
    return int(line.split()[1]) * 1024


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX) that torch's CPU kernels use; without it
    bfloat16 GEMMs and convolutions are emulated (widened per call, some on slow reference paths)."""
    import torch

    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
