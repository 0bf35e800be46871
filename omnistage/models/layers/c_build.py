"""Build a C source of omnistage's CPU kernels into a shared library for this host, once, cached by source,
flags and CPU (``cc -O3 -march=native -fopenmp``; the library links the ``libgomp.so.1`` torch has loaded)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from omnistage.core.cache_dir import cache_root

log = logging.getLogger(__name__)

# Per Python thread: scratch buffers reused across calls (a decode step makes hundreds of small calls;
# allocating their scratch each time cost as much as a small call's arithmetic).
_local = threading.local()
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def build_library(source: Path, libs: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``source`` compiled and loaded (ctypes releases the GIL during calls); raises on a failed build."""
    text = source.read_bytes()
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    # The build depends on the source, the flags and the host CPU (-march=native).
    cpuinfo = Path("/proc/cpuinfo")
    cpu = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), "")
    key = hashlib.sha256(text + " ".join(FLAGS + libs).encode() + cpu_flags.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(source), *libs], check=True,
                           capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: another process may build the same file at once
    return ctypes.CDLL(str(target))


def scratch(name: str, numel: int, dtype: torch.dtype, fill: float | None = None) -> torch.Tensor:
    """A flat CPU buffer of at least ``numel`` elements, this thread's own, reused by later calls (so only valid
    until this thread's next call with the same name); ``fill``: its value everywhere."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)), dtype=dtype)
        if fill is not None:
            buf.fill_(fill)
        buffers[name] = buf
    return buf


class LazyLibrary:
    """A kernel library built on first use, once per process (``build`` compiles and declares it). Unavailable,
    logged once as ``what`` + its fallback, when it cannot be built (no compiler, a failed build), and while
    ``OMNISTAGE_CPU_KERNELS=0``."""

    def __init__(self, build: Callable[[], ctypes.CDLL], what: str, fallback: str) -> None:
        self._build, self._what, self._fallback = build, what, fallback
        self._lock = threading.Lock()
        self.library: ctypes.CDLL | None = None
        self.failure: str | None = None

    # A constant to torch.compile: traced where a layer asks first inside a compiled graph (a quantized code
    # predictor's frame), the build runs at trace time instead of breaking the graph (dynamo cannot enter the lock).
    @torch.compiler.assume_constant_result
    def available(self) -> bool:
        if os.environ.get("OMNISTAGE_CPU_KERNELS", "1") == "0":
            return False
        if self.library is not None or self.failure is not None:
            return self.library is not None
        with self._lock:
            if self.library is None and self.failure is None:
                try:
                    self.library = self._build()
                except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the fallback serves
                    stderr = getattr(exc, "stderr", b"") or b""
                    self.failure = f"{type(exc).__name__}: {exc} {stderr.decode(errors='replace')[-500:]}".strip()
                    log.warning("%s unavailable, %s: %s", self._what, self._fallback, self.failure)
        return self.library is not None

    def require(self) -> ctypes.CDLL:
        if not self.available():
            raise RuntimeError(f"the {self._what} are unavailable: {self.failure or 'OMNISTAGE_CPU_KERNELS=0'}")
        return self.library
