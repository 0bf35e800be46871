"""The messages between the API process and a stage worker, and how they travel.

A message is one ZeroMQ multipart message: a msgspec msgpack header frame (the message struct), then one raw
frame per tensor it carries. In the header a tensor is a msgpack extension holding its frame index, dtype,
shape and device kind; its bytes are the tensor's contiguous host memory (any dtype, bfloat16 included,
through a byte view). No pickle: the per-request values a family passes (request data, payloads, outputs)
may hold None, bool, int, float, str, bytes, lists, tuples, dicts with str keys, torch tensors, and instances
of the dataclasses the family declares (``ModelFamily.wire_types``, rebuilt by name on the other side);
anything else is refused when it is sent.

Accelerator tensors are copied to the host to be sent and placed on the receiving process's device (when it
has one); host tensors stay on the host, so a stage sees its inputs where the in-process engine would put
them. A process without a device (the API process, which routes one stage's outputs to the next) holds an
accelerator tensor as a host copy marked with where it came from, and sends it on as an accelerator tensor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from omnistage.models.family import StageRequest
from omnistage.pipeline.stage import StepEvents

TENSOR_EXT, DATACLASS_EXT, TUPLE_EXT = 1, 2, 3
ORIGIN_ATTR = "_omnistage_wire_device"  # on a host copy of an accelerator tensor: its device kind
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
    quantization: str
    quantization_group_size: int | None
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


class _Obj:
    """A declared dataclass on its way out: its type's name and its init fields."""

    def __init__(self, name: str, fields: dict[str, Any]) -> None:
        self.name, self.fields = name, fields


class _Tuple:
    def __init__(self, items: list[Any]) -> None:
        self.items = items


class Codec:
    """Encodes and decodes messages of one direction. Not thread-safe: one per socket user.

    ``device``: where received accelerator tensors go (None: the host). ``types``: the dataclasses that may
    travel inside per-request values (the model family's ``wire_types``).
    """

    def __init__(self, kind: Any, device: str | torch.device | None = None, types: tuple[type, ...] = ()) -> None:
        self.device = torch.device(device) if device is not None else None
        self._types = {f"{t.__module__}.{t.__qualname__}": t for t in types}
        self._names = {t: name for name, t in self._types.items()}
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inner_encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=self._ext_hook)
        self._inner_decoder = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._out: list[Any] = []
        self._in: list[Any] = []

    # ---- encode ---------------------------------------------------------------------------------------
    def encode(self, message: msgspec.Struct) -> list[Any]:
        """Frames: the header, then each tensor's bytes."""
        self._out = []
        try:
            header = self._encoder.encode(self._faithful(message))
            return [header, *self._out]
        finally:
            self._out = []

    def _faithful(self, message: msgspec.Struct) -> msgspec.Struct:
        """The message with its free-form values marked so that tuples and declared dataclasses come back as
        such (msgpack alone has one array type and would send any dataclass as a plain dict)."""
        if isinstance(message, AddRequest):
            req = message.request
            return AddRequest(dataclasses.replace(req, data=self._mark(req.data)))
        if isinstance(message, AddInput):
            return AddInput(message.req_id, message.source, self._mark(message.payload))
        if isinstance(message, Events):
            ev = message.events
            ev = dataclasses.replace(ev, client_outputs=self._mark(ev.client_outputs),
                                     stage_outputs=self._mark(ev.stage_outputs))
            return Events(ev, message.acked, message.waiting, message.sent_at)
        return message

    def _mark(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, int, float, bool, torch.Tensor)) or value is None:
            return value
        if isinstance(value, Mapping):
            return {k: self._mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(v) for v in value]
        if isinstance(value, tuple):
            return _Tuple([self._mark(v) for v in value])
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            name = self._names.get(type(value))
            if name is None:
                raise TypeError(f"cannot send a {type(value).__qualname__} to or from a stage worker: declare it "
                                "in the model family's wire_types")
            return _Obj(name, {f.name: self._mark(getattr(value, f.name)) for f in dataclasses.fields(value)
                               if f.init})
        return value  # refused by _enc_hook below if msgspec cannot send it

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor_ext(obj)
        if isinstance(obj, _Obj):
            return msgspec.msgpack.Ext(DATACLASS_EXT, self._inner_encoder.encode([obj.name, obj.fields]))
        if isinstance(obj, _Tuple):
            return msgspec.msgpack.Ext(TUPLE_EXT, self._inner_encoder.encode(obj.items))
        if isinstance(obj, Mapping):  # e.g. MappingProxyType
            return dict(obj)
        raise TypeError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} to or from a stage "
                        "worker: plain data, torch tensors and the family's wire_types only")

    def _tensor_ext(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype}")
        host = t.detach().to("cpu").contiguous()
        self._out.append(host.reshape(-1).view(torch.uint8).numpy())
        info = [len(self._out) - 1, name, list(host.shape), getattr(t, ORIGIN_ATTR, None) or t.device.type]
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
        if code == TUPLE_EXT:
            return tuple(self._inner_decoder.decode(data))
        if code == DATACLASS_EXT:
            name, fields = self._inner_decoder.decode(data)
            cls = self._types.get(name)
            if cls is None:
                raise msgspec.ValidationError(f"received a {name} that this process's model family does not declare")
            return cls(**fields)
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
        if device_kind != "cpu":
            if self.device is not None and self.device.type != "cpu":
                t = t.to(self.device)
            elif self.device is None:  # routed on from here: the next stage gets it on its device
                setattr(t, ORIGIN_ATTR, device_kind)
        return t


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def new_counters() -> dict[str, float]:
    """Transport counters of one side of a stream pair (see ``encode_counted`` / ``decode_counted``)."""
    return {"sent_msgs": 0, "sent_bytes": 0, "encode_s": 0.0, "recv_msgs": 0, "recv_bytes": 0, "decode_s": 0.0}


def encode_counted(codec: Codec, message: msgspec.Struct, counters: dict[str, float]) -> list[Any]:
    """``codec.encode``, adding the message, its bytes and the encoding time to ``counters``."""
    t0 = time.perf_counter()
    frames = codec.encode(message)
    _count(counters, "sent", "encode_s", frames, t0)
    return frames


def decode_counted(codec: Codec, frames: list[Any], counters: dict[str, float]) -> Any:
    """``codec.decode``, adding the message, its bytes and the decoding time to ``counters``."""
    t0 = time.perf_counter()
    message = codec.decode(frames)
    _count(counters, "recv", "decode_s", frames, t0)
    return message


def _count(counters: dict[str, float], side: str, timer: str, frames: list[Any], t0: float) -> None:
    counters[timer] += time.perf_counter() - t0
    counters[f"{side}_msgs"] += 1
    counters[f"{side}_bytes"] += frame_bytes(frames)
