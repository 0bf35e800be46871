"""The stage-worker protocol without model processes: every message type and every tensor dtype round-trips
through the wire encoding; a worker (in a thread, with a scripted stage) and its ``RemoteStage`` proxy keep
commands and events in order, drop events of an aborted request, report rejections and failures."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from types import MappingProxyType

import msgspec
import pytest
import torch
import zmq

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import StageRequest
from omnistage.pipeline import wire
from omnistage.pipeline.remote_stage import RemoteStage, StageWorkerError
from omnistage.pipeline.stage import StepEvents
from omnistage.pipeline.worker import Worker

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32,
          torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def roundtrip(message, kind, device=None):
    frames = wire.Codec(kind).encode(message)
    # What zmq hands the receiver: read-only buffers.
    return wire.Codec(kind, device).decode([bytes(memoryview(f)) for f in frames])


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 255, (*shape, torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).reshape(shape)  # every bit pattern, not just values a float cast would produce


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN patterns included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_of_every_dtype_round_trip_bit_exact(dtype):
    t = sample(dtype)
    cases = {"plain": t, "non_contiguous": t.t(), "strided": t[::2, 1::2], "empty": t[:0], "scalar": t[0, 0],
             "empty_3d": torch.empty(2, 0, 4, dtype=dtype)}
    got = roundtrip(wire.AddInput("r", "up", cases), wire.ToWorker).payload
    for key, value in cases.items():
        assert same(got[key], value), key
        assert got[key].device.type == "cpu"
        if got[key].numel():
            got[key].reshape(-1).view(torch.uint8)[0] = 1  # received tensors own writable memory


def test_every_message_type_round_trips():
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=9, stop_token_ids=(4, 2))
    request = StageRequest("req-1", params, (1, 2, 3), (7,),
                           MappingProxyType({"mask": torch.tensor([True, False]), "ids": (5, 6), "n": 2,
                                             "nested": {"x": [torch.arange(3), None, 1.5, "s", b"\x00"]}}))
    init = wire.Init({"name": "talker", "scheduler": {"block_size": 4}}, "eager", "qwen3_omni",
                     "omnistage.models.qwen3_omni.family", "/ckpt", "bfloat16", "cuda:0", True, "int4", 64, 3,
                     ["/a", "/b"])
    events = StepEvents("talker", client_outputs={"a": {"token_ids": [1, 2], "codes": torch.ones(16, 2, dtype=torch.long)}},
                        stage_outputs={"a": {"frames": torch.zeros(2, 16, dtype=torch.long)}},
                        finished={"b": "length"}, errors={"c": "bad input"}, step_time=0.25, num_tokens=7,
                        started=12.5)
    to_worker = [init, wire.AddRequest(request), wire.AddInput("a", "thinker", {"embeds": torch.randn(2, 3)}),
                 wire.EndInput("a", "thinker"), wire.Abort("a"), wire.StatsQuery(4), wire.Shutdown()]
    from_worker = [wire.Ready("talker", 123, "cuda:0", 4), wire.StartupError("talker", "OSError: x", "Traceback..."),
                   wire.Events(events, 5, 2, 99.5), wire.StatsReply(4, {"records": 0, "worker": {"pid": 1}}),
                   wire.Fatal("talker", "RuntimeError: boom", "Traceback...")]
    for kind, messages in ((wire.ToWorker, to_worker), (wire.FromWorker, from_worker)):
        for m in messages:
            got = roundtrip(m, kind)
            assert type(got) is type(m)
            assert _plain(got) == _plain(m), type(m).__name__


def test_accelerator_tensors_routed_through_the_api_process_reach_the_next_stage_on_its_device():
    """Thinker (GPU) -> API process (no device) -> Talker (GPU): the rows reach the Talker on its device, host
    tensors stay on the host. Without a GPU here, a host tensor marked as a CUDA tensor's copy stands for the
    Thinker's output, and the Talker's device is "meta" (only placement is checked)."""
    rows, mask = torch.randn(2, 3), torch.tensor([True, False])
    setattr(rows, wire.ORIGIN_ATTR, "cuda")
    events = StepEvents("thinker", stage_outputs={"a": {"rows": rows, "mask": mask}})
    at_api = roundtrip(wire.Events(events, 1, 0, 0.0), wire.FromWorker).events.stage_outputs["a"]
    assert at_api["rows"].device.type == "cpu" and torch.equal(at_api["rows"], rows)
    at_talker = roundtrip(wire.AddInput("a", "thinker", at_api), wire.ToWorker, device="meta").payload
    assert at_talker["rows"].device.type == "meta" and at_talker["rows"].shape == (2, 3)
    assert at_talker["mask"].device.type == "cpu" and torch.equal(at_talker["mask"], mask)
    # A worker on the host takes such a tensor as a host tensor, and sends on what it makes as host tensors.
    on_cpu = roundtrip(wire.AddInput("a", "thinker", at_api), wire.ToWorker, device="cpu").payload["rows"]
    assert on_cpu.device.type == "cpu" and not hasattr(on_cpu, wire.ORIGIN_ATTR)


def _plain(value):
    """Comparable form: tensors as (dtype, shape, values), tuples as lists (msgpack has one array type)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, msgspec.Struct):
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__}
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (dict, MappingProxyType)):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def test_the_familys_dataclasses_and_tuples_come_back_as_themselves():
    from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
    from omnistage.models.qwen3_omni.mrope import MediaSpan
    from omnistage.models.qwen3_omni.processor import MediaItem, ThinkerMedia, media_data

    items = (MediaItem("audio", "k1", torch.tensor([3, 4]), features=torch.randn(128, 40), pad_frames=100),
             MediaItem("image", "k2", torch.tensor([5, 6, 7]), pixels=torch.randn(12, 8), grid=(1, 2, 6)))
    spans = (MediaSpan("audio", 2, num_audio=2), MediaSpan("image", 4, grid_thw=(1, 2, 6)))
    media = ThinkerMedia(items, torch.randn(9, 3), rope_delta=-2.0, flat=False, spans=spans)
    data = {**media_data(media), "prompt_ids": (1, 2, 3), "rows": [(1, 2), (3,)]}
    types = Qwen3OmniFamily.wire_types
    msg = wire.AddRequest(StageRequest("r", prompt_token_ids=(1, 2, 3), data=data))
    got = wire.Codec(wire.ToWorker, types=types).decode(
        [bytes(memoryview(f)) for f in wire.Codec(wire.ToWorker, types=types).encode(msg)]).request.data
    assert got["prompt_ids"] == (1, 2, 3) and got["rows"] == [(1, 2), (3,)]
    back = got["media"]
    assert type(back) is ThinkerMedia and isinstance(back.items, tuple) and back.rope_delta == -2.0
    assert back.spans == spans and all(type(x) is MediaSpan for x in back.spans)
    assert torch.equal(back.positions, media.positions)
    for a, b in zip(back.items, items):
        assert type(a) is MediaItem and a.kind == b.kind and a.key == b.key and a.grid == b.grid
        assert a.pad_frames == b.pad_frames and torch.equal(a.rows, b.rows)
        for f in ("features", "pixels"):
            assert (getattr(a, f) is None) == (getattr(b, f) is None)
            assert getattr(a, f) is None or torch.equal(getattr(a, f), getattr(b, f))
    # A process that does not declare the type refuses it (no object is built from a name it does not know).
    frames = wire.Codec(wire.ToWorker, types=types).encode(msg)
    with pytest.raises(msgspec.ValidationError, match="does not declare"):
        wire.Codec(wire.ToWorker).decode(frames)


def test_values_that_are_not_plain_data_are_refused_before_sending():
    with pytest.raises(TypeError, match="plain data, torch tensors and the family's wire_types only"):
        wire.Codec(wire.ToWorker).encode(wire.AddInput("r", "up", {"obj": object()}))

    @dataclasses.dataclass
    class Undeclared:
        x: int

    with pytest.raises(TypeError, match="declare it in the model family's wire_types"):
        wire.Codec(wire.ToWorker).encode(wire.AddInput("r", "up", {"obj": [Undeclared(1)]}))


def test_a_corrupt_tensor_frame_is_an_error_not_garbage():
    frames = wire.Codec(wire.ToWorker).encode(wire.AddInput("r", "up", {"t": torch.ones(4)}))
    with pytest.raises(msgspec.ValidationError, match="holds 15 bytes"):
        wire.Codec(wire.ToWorker).decode([frames[0], bytes(memoryview(frames[1]))[:-1]])


# ---- a worker in a thread with a scripted stage, and its proxy ---------------------------------------------
class ScriptedStage:
    """Each input {"x": t} gives a client output {"y": 2 t} in the next step; end of input finishes."""

    name = "scripted"

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.todo: list[tuple[str, str, torch.Tensor | None]] = []
        self.crash = False

    def add_request(self, request):
        if request.req_id.startswith("bad"):
            raise ValueError(f"cannot serve {request.req_id}")
        self.live.add(request.req_id)

    def add_input(self, req_id, source, payload):
        if req_id in self.live:
            self.todo.append(("out", req_id, payload["x"]))

    def end_input(self, req_id, source):
        if req_id in self.live:
            self.todo.append(("end", req_id, None))

    def abort(self, req_id):
        self.live.discard(req_id)
        self.todo = [t for t in self.todo if t[1] != req_id]

    def has_work(self):
        return bool(self.todo)

    def step(self):
        if self.crash:
            raise RuntimeError("the whole batch broke")
        ev = StepEvents(self.name, num_tokens=1)
        kind, req_id, x = self.todo.pop(0)
        if kind == "out":
            ev.client_outputs[req_id] = {"y": 2 * x}
        else:
            ev.finished[req_id] = "stop"
            self.live.discard(req_id)
        return ev

    def stats(self):
        return {"records": len(self.live), "waiting": 0}


@pytest.fixture
def pair():
    """(proxy, scripted stage, worker thread) over abstract ipc sockets."""
    ctx = zmq.Context()
    tag = uuid.uuid4().hex
    commands, events = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind(f"ipc://@omnistage-test-{tag}-cmd")
    events.bind(f"ipc://@omnistage-test-{tag}-evt")
    stage = ScriptedStage()
    worker = Worker(f"ipc://@omnistage-test-{tag}-cmd", f"ipc://@omnistage-test-{tag}-evt", build=lambda init: (stage, ()))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", worker.run()), daemon=True)
    thread.start()
    proxy = RemoteStage("scripted", commands, events, on_wait=lambda: None)
    proxy.send(wire.Init({"name": "scripted"}, "eager", "f", "m", "/", "float32", "cpu", False, "none", 128, 1, []))
    while proxy.ready is None:
        events.poll(100)
        proxy.drain()
    yield proxy, stage, thread, result
    if thread.is_alive():
        proxy.send(wire.Shutdown())
        thread.join(10)
    commands.close(0)
    events.close(0)
    ctx.term()


def next_events(proxy: RemoteStage) -> StepEvents:
    for _ in range(100):
        if proxy.has_work():
            return proxy.step()
        proxy.events.poll(100)
    raise AssertionError("no events within 10 s")


def test_commands_and_events_stay_in_order_and_stats_reflect_every_command(pair):
    proxy, _, _, _ = pair
    proxy.add_request(StageRequest("a"))
    proxy.add_request(StageRequest("bad-1"))
    proxy.add_input("a", "up", {"x": torch.tensor([1.0, 2.0])})
    proxy.end_input("a", "up")
    assert next_events(proxy).errors == {"bad-1": "cannot serve bad-1"}  # the rejection, in order
    assert torch.equal(next_events(proxy).client_outputs["a"]["y"], torch.tensor([2.0, 4.0]))
    assert next_events(proxy).finished == {"a": "stop"}
    proxy.add_request(StageRequest("b"))
    stats = proxy.stats()
    assert stats["records"] == 1 and stats["worker"]["recv_msgs"] >= 6
    proxy.abort("b")
    assert proxy.stats()["records"] == 0


def test_events_the_worker_produced_before_an_abort_never_reach_a_request_reusing_the_id(pair):
    proxy, _, _, _ = pair
    proxy.add_request(StageRequest("r"))
    proxy.add_input("r", "up", {"x": torch.tensor([1.0])})
    assert proxy.events.poll(10_000)  # the old incarnation's output is on its way, not yet taken in
    proxy.abort("r")
    proxy.add_request(StageRequest("r"))
    proxy.add_input("r", "up", {"x": torch.tensor([5.0])})
    first = next_events(proxy)
    if "r" not in first.client_outputs:  # the stale step arrives emptied
        first = next_events(proxy)
    assert torch.equal(first.client_outputs["r"]["y"], torch.tensor([10.0]))


def test_admission_counts_requests_the_worker_has_not_reported_yet(pair):
    proxy, _, _, _ = pair
    assert proxy.num_waiting() == 0
    proxy.add_request(StageRequest("w1"))
    proxy.add_request(StageRequest("w2"))
    assert proxy.num_waiting() == 2  # sent, not yet acknowledged by any event
    proxy.add_input("w1", "up", {"x": torch.tensor([1.0])})
    next_events(proxy)
    assert proxy.num_waiting() == 0  # the worker had both when it stepped; the scripted stage waits for none


def test_a_failure_of_the_whole_stage_reaches_the_api_process_with_its_traceback(pair, caplog):
    proxy, stage, thread, result = pair
    stage.crash = True
    proxy.add_request(StageRequest("a"))
    proxy.add_input("a", "up", {"x": torch.tensor([1.0])})
    with caplog.at_level("ERROR", "omnistage.workers"), pytest.raises(
            StageWorkerError, match="^stage 'scripted' failed: RuntimeError: the whole batch broke$"):
        next_events(proxy)
    assert "worker traceback" in caplog.text and "in step" in caplog.text  # the traceback is logged here
    thread.join(10)
    assert result["code"] == 1
    with pytest.raises(StageWorkerError):  # nothing more is sent to a failed worker
        proxy.abort("a")


def test_shutdown_ends_the_worker_loop(pair):
    proxy, _, thread, result = pair
    proxy.send(wire.Shutdown())
    thread.join(10)
    assert not thread.is_alive() and result["code"] == 0
