"""The ``fast`` option's kernel for routed experts on the CPU: ``csrc/moe_experts.c``, one call per MoE layer.

A decode batch gives each expert a few rows. GEMM libraries then stream an expert's weights at a fraction of
the machine's read bandwidth and cost a call per expert (oneDNN: 2 per expert per layer). This kernel sorts
the selections by expert, then streams each expert's weights once while all of its rows take their dot
products in registers (SwiGLU in between), weights and sums each token's slots in top-k order, and splits
the work over ``torch.get_num_threads()`` OpenMP threads (torch's own runtime: the library is linked against
the ``libgomp.so.1`` torch has loaded). With many rows per expert it runs at the FMA units' pace, so one copy
of the weights, in its panel layout (``pack``), serves decode and prefill.

It is compiled at first use for the host CPU (``cc -O3 -march=native -fopenmp``, about a second, cached under
the omnistage cache directory). Without a C compiler it is unavailable (logged once), and ``OMNISTAGE_EXPERT_KERNEL=0``
turns it off; the experts then keep a oneDNN GEMM per expert. Float rounding differs from the GEMMs' (sums in another order; in bfloat16 the SwiGLU
intermediate and the slot sums stay float32).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "moe_experts.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_FUNCTIONS = {torch.float32: "moe_experts_f32", torch.bfloat16: "moe_experts_bf16"}
_DOT_BF16 = "moe_experts_bf16dp"  # built where the CPU has AVX512-BF16 dot products
# Panel widths the layout needs: gate/up panels of 16 intermediate columns, down panels of 32 hidden ones.
UP_PANEL, DOWN_PANEL = 16, 32

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage")) / "kernels"


def _build() -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    # The build depends on the source, the flags and the host CPU (-march=native).
    cpuinfo = Path("/proc/cpuinfo")
    cpu = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), "")
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + cpu_flags.encode()).hexdigest()[:16]
    target = _cache_dir() / f"moe_experts-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: another process may build the same file at once
    library = ctypes.CDLL(str(target))  # ctypes releases the GIL during calls
    for name in (*_FUNCTIONS.values(), _DOT_BF16):
        if not hasattr(library, name):
            continue
        fn = getattr(library, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 6 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [
            ctypes.c_int]
    return library


def available() -> bool:
    """Whether the kernel is built (building it on the first call); False, logged once, when it cannot be, and
    while ``OMNISTAGE_EXPERT_KERNEL=0`` (weights packed meanwhile keep oneDNN's per-expert layout)."""
    global _library, _failure
    if os.environ.get("OMNISTAGE_EXPERT_KERNEL", "1") == "0":
        return False
    if _library is not None or _failure is not None:
        return _library is not None
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _build()
            except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the oneDNN kernels serve
                stderr = getattr(exc, "stderr", b"") or b""
                _failure = f"{type(exc).__name__}: {exc} {stderr.decode(errors='replace')[-500:]}".strip()
                log.warning("expert kernel unavailable, experts keep their oneDNN kernels: %s", _failure)
    return _library is not None


def _require() -> None:
    if not available():
        raise RuntimeError(f"the expert kernel is unavailable: {_failure or 'OMNISTAGE_EXPERT_KERNEL=0'}")


def supports(weight: torch.Tensor) -> bool:
    """Whether stacked expert weights of this dtype and device can take the kernel (CPU, float32/bfloat16)."""
    return weight.device.type == "cpu" and weight.dtype in _FUNCTIONS


def _dot_bf16(dtype: torch.dtype, hidden: int) -> bool:
    """Whether bfloat16 weights take the dot-product variant (pairs of hidden indices: an even hidden size)."""
    return dtype == torch.bfloat16 and hidden % 2 == 0 and hasattr(_library, _DOT_BF16)


def serves_any_batch(dtype: torch.dtype, hidden: int) -> bool:
    """Whether the kernel is at least as fast as oneDNN's per-expert GEMMs at every row count (float32, and
    bfloat16 with dot products); the widened bfloat16 variant loses from about 16 rows per expert."""
    return available() and (dtype == torch.float32 or _dot_bf16(dtype, hidden))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights gate_up [E, 2I, H], down [E, H, I] -> the kernel's panels: gate/up [E, I'/16, H, 32]
    (16 gate then 16 up columns per hidden index), down [E, H'/32, I', 32], with I and H padded to I', H'
    (multiples of 16 and 32) by zero weights. For the bfloat16 dot-product variant, each panel's rows go in
    pairs of consecutive indices, interleaved per column (``[K/2][32][2]``; same shapes)."""
    _require()  # the layout depends on the variants built for this CPU
    experts, hidden, inter = down.shape
    inter_p, hidden_p = _round_up(inter, UP_PANEL), _round_up(hidden, DOWN_PANEL)
    halves = gate_up.new_zeros(experts, 2, inter_p, hidden)
    halves[:, :, :inter] = gate_up.reshape(experts, 2, inter, hidden)
    padded = down.new_zeros(experts, hidden_p, inter_p)
    padded[:, :hidden, :inter] = down
    if _dot_bf16(gate_up.dtype, hidden):
        halves = halves.view(experts, 2, inter_p // UP_PANEL, UP_PANEL, hidden // 2, 2).permute(0, 2, 4, 1, 3, 5)
        padded = padded.view(experts, hidden_p // DOWN_PANEL, DOWN_PANEL, inter_p // 2, 2).permute(0, 1, 3, 2, 4)
    else:
        halves = halves.view(experts, 2, inter_p // UP_PANEL, UP_PANEL, hidden).permute(0, 2, 4, 1, 3)
        padded = padded.view(experts, hidden_p // DOWN_PANEL, DOWN_PANEL, inter_p).transpose(2, 3)
    panels_up = halves.reshape(experts, inter_p // UP_PANEL, hidden, 2 * UP_PANEL).contiguous()
    panels_down = padded.reshape(experts, hidden_p // DOWN_PANEL, inter_p, DOWN_PANEL).contiguous()
    return panels_up, panels_down


def moe_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, panels: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """x [T, H], ids [T, K] selected experts, weights [T, K] routing weights -> [T, H] in x's dtype: each
    token's selected experts' SwiGLU outputs, weighted, summed in slot order. ``panels``: ``pack``'s result."""
    _require()
    panels_up, panels_down = panels
    experts, inter, hidden = panels_up.shape[0], panels_up.shape[1] * UP_PANEL, panels_up.shape[2]
    hidden_p = panels_down.shape[1] * DOWN_PANEL
    tokens, top_k = ids.shape
    if x.shape != (tokens, hidden) or x.device.type != "cpu" or x.dtype != panels_up.dtype:
        raise ValueError(f"x must be [{tokens}, {hidden}] {panels_up.dtype} on the CPU, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    threads = torch.get_num_threads()
    n = tokens * top_k
    dot = _dot_bf16(x.dtype, hidden)  # rows and intermediates stay bfloat16; else float32
    rows = x.contiguous() if dot else x.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    out = x.new_empty(tokens, hidden_p)
    h = rows.new_empty(n, inter)
    y = torch.empty(threads, n, DOWN_PANEL)
    sort = torch.empty(2 * n + 2 * experts + 2, dtype=torch.int64)
    pointers = torch.empty(threads * 2 * n, dtype=torch.int64)
    getattr(_library, _DOT_BF16 if dot else _FUNCTIONS[x.dtype])(
        tokens, top_k, experts, hidden, hidden_p, inter, rows.data_ptr(), ids.data_ptr(), weights.data_ptr(),
        panels_up.data_ptr(), panels_down.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
        h.data_ptr(), y.data_ptr(), sort.data_ptr(), pointers.data_ptr(), threads,
    )
    return out if hidden_p == hidden else out[:, :hidden]
