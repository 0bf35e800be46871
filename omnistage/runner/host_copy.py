"""A batch of device->host copies with one explicit completion point.

`copy()` only *issues* a copy (non_blocking, into pinned memory on CUDA); the values are ready after
`wait()`. "copy() returned" is not "the values are ready", so a handle refuses to give its value before
the batch has been waited on. On CPU the copies are plain and synchronous but the interface, including
the wait, is the same so callers cannot come to rely on the CPU timing.
"""

from __future__ import annotations

import torch


class HostCopyNotReadyError(RuntimeError):
    """A host copy was read before its batch's wait()."""


class HostCopyHandle:
    """The host-side destination of one copy; `value` is readable after the batch's wait()."""

    __slots__ = ("_value", "_ready", "_keepalive")

    def __init__(self, value: torch.Tensor, keepalive: torch.Tensor | None) -> None:
        self._value = value
        self._ready = False
        # Device source (or its contiguous temporary) kept alive until the copy has completed.
        self._keepalive = keepalive

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def value(self) -> torch.Tensor:
        if not self._ready:
            raise HostCopyNotReadyError(
                "host copy read before HostCopyBatch.wait(); values may be incomplete"
            )
        return self._value

    def _mark_ready(self) -> None:
        self._ready = True
        self._keepalive = None


class HostCopyBatch:
    """Issue device->host copies, then wait once before any CPU read.

    `stream`: a CUDA stream to issue the copies on (it first waits for the stream that is current at
    copy() time, which produced the source). None => copies go on the current stream at copy() time.
    The batch records an event after the copies on every stream it used; wait() synchronizes those.
    The batch may be reused: copies issued after a wait() need another wait().
    """

    def __init__(self, *, stream: torch.cuda.Stream | None = None, pin_memory: bool = True) -> None:
        self._stream = stream
        self._pin_memory = pin_memory
        self._pending: list[HostCopyHandle] = []
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}  # (device, stream id) -> last event

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def copy(self, t: torch.Tensor) -> HostCopyHandle:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"HostCopyBatch.copy expects a tensor, got {type(t).__name__}")
        t = t.detach()
        if t.device.type == "cuda":
            handle = self._copy_cuda(t)
        else:
            # The destination is always a fresh contiguous tensor with the source's logical shape, so a
            # transposed or sliced source keeps its element order.
            dst = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            dst.copy_(t)
            handle = HostCopyHandle(dst, keepalive=None)
        self._pending.append(handle)
        return handle

    def _copy_cuda(self, t: torch.Tensor) -> HostCopyHandle:
        producer = torch.cuda.current_stream(t.device)
        stream = self._stream if self._stream is not None else producer
        if stream.device != t.device:
            raise ValueError(f"copy stream is on {stream.device}, source tensor on {t.device}")
        if stream != producer:
            # Order the copy after the producer's writes, and tell the caching allocator the source is
            # in use on the copy stream so its memory is not handed out before the copy finishes.
            stream.wait_stream(producer)
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            # Gather a non-contiguous source on the device first: the DMA then moves one dense block.
            src = t if t.is_contiguous() else t.contiguous()
            dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin_memory)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events[(stream.device.index, stream.stream_id)] = event
        return HostCopyHandle(dst, keepalive=src)

    def wait(self) -> None:
        """Block until every copy issued so far has landed in host memory."""
        for event in self._events.values():
            event.synchronize()
        self._events.clear()
        for handle in self._pending:
            handle._mark_ready()
        self._pending.clear()
