"""The messages between the API process and a stage worker, and how they travel.

A message is one ZeroMQ multipart message: a msgspec msgpack header frame (the message struct), then one raw
frame per tensor it carries. In the header a tensor is a msgpack extension holding its frame index, dtype,
shape and device kind; its bytes are the tensor's contiguous host memory (any dtype, bfloat16 included,
through a byte view). No pickle: a value that is not plain data (None, bool, int, float, str, bytes, lists,
tuples, dicts with str keys, dataclasses / structs of those) or a torch tensor is refused when it is sent.
Tuples arrive as lists.

Accelerator tensors are copied to the host to be sent and placed on the receiving process's device (when it
has one); host tensors stay on the host, so a stage sees its inputs where the in-process engine would put
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from omnistage.models.family import StageRequest
from omnistage.pipeline.stage import StepEvents

TENSOR_EXT = 1
HWM_MESSAGES = 1000  # messages a socket queues per direction before its sender waits (backpressure)
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "uint8", "int8", "int16",
                 "int32", "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


# ---- API process -> worker (one ordered stream per stage) -----------------------------------------------
class Init(msgspec.Struct, tag=True, array_like=True):
    """First message: what the worker builds (the stage exactly as the in-process engine would)."""

    stage: dict[str, Any]  # StageConfig.to_dict() of the family-validated stage
    runner: str
    family: str
    family_module: str  # imported when the family is not a built-in one
    model: str
    dtype: str
    device: str
    fast: bool
    threads: int
    sys_path: list[str]


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: StageRequest


class AddInput(msgspec.Struct, tag=True, array_like=True):
    req_id: str
    source: str
    payload: dict[str, Any]


class EndInput(msgspec.Struct, tag=True, array_like=True):
    req_id: str
    source: str


class Abort(msgspec.Struct, tag=True, array_like=True):
    req_id: str


class StatsQuery(msgspec.Struct, tag=True, array_like=True):
    token: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


# ---- worker -> API process ------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    stage: str
    pid: int
    device: str
    threads: int


class StartupError(msgspec.Struct, tag=True, array_like=True):
    stage: str
    error: str
    traceback: str


class Events(msgspec.Struct, tag=True, array_like=True):
    """One step's events. ``acked``: commands the worker had handled when the step ran (stale events of an
    aborted request are told apart by it); ``waiting``: the stage's waiting requests after the step."""

    events: StepEvents
    acked: int
    waiting: int
    sent_at: float  # time.monotonic() of the worker's host when sent


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    token: int
    stats: dict[str, Any]


class Fatal(msgspec.Struct, tag=True, array_like=True):
    """The stage failed as a whole (e.g. an error in a step that belongs to no single request); the worker
    exits after sending this."""

    stage: str
    error: str
    traceback: str


ToWorker = Init | AddRequest | AddInput | EndInput | Abort | StatsQuery | Shutdown
FromWorker = Ready | StartupError | Events | StatsReply | Fatal


class Codec:
    """Encodes and decodes messages of one direction. Not thread-safe: one per socket user.

    ``device``: where received accelerator tensors go (None: the host).
    """

    def __init__(self, kind: Any, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=self._ext_hook)
        self._out: list[Any] = []
        self._in: list[Any] = []

    # ---- encode ---------------------------------------------------------------------------------------
    def encode(self, message: msgspec.Struct) -> list[Any]:
        """Frames: the header, then each tensor's bytes."""
        self._out = []
        try:
            header = self._encoder.encode(message)
            return [header, *self._out]
        finally:
            self._out = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor_ext(obj)
        if isinstance(obj, Mapping):  # e.g. MappingProxyType
            return dict(obj)
        raise TypeError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} to or from a stage "
                        "worker: plain data and torch tensors only")

    def _tensor_ext(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype}")
        host = t.detach().to("cpu").contiguous()
        self._out.append(host.reshape(-1).view(torch.uint8).numpy())
        info = [len(self._out) - 1, name, list(host.shape), t.device.type]
        return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode(info))

    # ---- decode ---------------------------------------------------------------------------------------
    def decode(self, frames: list[Any]) -> Any:
        """``frames``: bytes-like objects (``zmq.Frame.buffer`` or bytes)."""
        self._in = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._in = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != TENSOR_EXT:
            raise msgspec.ValidationError(f"unknown extension type {code}")
        index, name, shape, device_kind = msgspec.msgpack.decode(data)
        dtype = _DTYPES.get(name)
        if dtype is None or not 0 < index + 1 < len(self._in):
            raise msgspec.ValidationError(f"bad tensor reference {name!r} / frame {index}")
        buf = self._in[index + 1]
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(buf) != numel * itemsize:
            raise msgspec.ValidationError(f"tensor frame {index} holds {len(buf)} bytes, expected "
                                          f"{numel * itemsize} for {name}{shape}")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:  # one copy into memory the tensor owns (frames are read-only and reused by zmq)
            t = torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(shape)
        if device_kind != "cpu" and self.device is not None and self.device.type != "cpu":
            t = t.to(self.device)
        return t


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)
