"""The stage protocol, in the API process, for a stage that runs in a worker (``omnistage.pipeline.worker``).

Requests, inputs, ends of input and aborts are sent in order on the stage's command stream and return at
once (a request the worker rejects comes back as an error event, in order). The worker steps on its own;
``has_work`` says a step's events have arrived and ``step`` hands over the oldest one, so the orchestrator
routes the worker's steps one by one, in the order they ran. ``stats`` asks the worker and waits for the
answer, which reflects every command sent before it (e.g. an abort has freed everything).

Events of a request that was aborted here but that the worker produced before it saw the abort are
dropped (each event message says how many commands the worker had handled), so a request id used again
after an abort never gets its predecessor's events.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from omnistage.models.family import StageRequest
from omnistage.pipeline import wire
from omnistage.pipeline.stage import StepEvents

logger = logging.getLogger("omnistage.workers")
STATS_TIMEOUT_S = 120.0


class StageWorkerError(RuntimeError):
    """A stage worker failed to start, died, or failed as a whole: the engine cannot go on."""


def startup_failure(message: wire.StartupError) -> StageWorkerError:
    """The whole story (the person starting the engine reads it)."""
    return StageWorkerError(f"stage {message.stage!r} failed to start: {message.error}\n"
                            f"--- worker traceback ---\n{message.traceback}")


def stage_failure(message: wire.Fatal) -> StageWorkerError:
    """One line for the clients whose requests it fails; the traceback goes to the log."""
    logger.error("stage %r failed: %s\n--- worker traceback ---\n%s", message.stage, message.error, message.traceback)
    return StageWorkerError(f"stage {message.stage!r} failed: {message.error}")


class RemoteStage:
    def __init__(self, name: str, commands: zmq.Socket, events: zmq.Socket, on_wait: Callable[[], None],
                 types: tuple[type, ...] = ()) -> None:
        self.name = name
        self.commands, self.events = commands, events
        self.on_wait = on_wait  # while blocked: keep every worker's events flowing, notice dead workers
        self._out = wire.Codec(wire.ToWorker, types=types)  # types: the model family's wire_types
        self._in = wire.Codec(wire.FromWorker, types=types)
        self._sent = 0  # commands sent
        self._acked = 0  # commands the worker had handled at its latest event message
        self._waiting = 0  # the stage's waiting requests at its latest event message
        self._adds: deque[int] = deque()  # command numbers of requests added, not yet acknowledged
        self._aborted: dict[str, int] = {}  # req_id -> command number of its abort, until acknowledged
        self._steps: deque[StepEvents] = deque()
        self._replies: dict[int, dict[str, Any]] = {}
        self._token = 0
        self.ready: wire.Ready | None = None
        self.startup_error: wire.StartupError | None = None
        self.fatal: wire.Fatal | None = None
        self.transport = {**wire.new_counters(), "events": 0, "transit_s": 0.0}

    # ---- the stage protocol ---------------------------------------------------------------------------
    def add_request(self, request: StageRequest) -> None:
        self.send(wire.AddRequest(request))
        self._adds.append(self._sent)

    def add_input(self, req_id: str, source: str, payload: Any) -> None:
        self.send(wire.AddInput(req_id, source, dict(payload)))

    def end_input(self, req_id: str, source: str) -> None:
        self.send(wire.EndInput(req_id, source))

    def abort(self, req_id: str) -> None:
        self.send(wire.Abort(req_id))
        self._aborted[req_id] = self._sent

    def has_work(self) -> bool:
        self.drain()
        return bool(self._steps)

    def step(self) -> StepEvents:
        self.drain()
        return self._steps.popleft() if self._steps else StepEvents(self.name)

    def stats(self) -> dict[str, Any]:
        self._token += 1
        token = self._token
        self.send(wire.StatsQuery(token))
        deadline = time.monotonic() + STATS_TIMEOUT_S
        while token not in self._replies:
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {self.name!r} did not answer a stats query within {STATS_TIMEOUT_S} s")
            self.on_wait()
            self.events.poll(100)
            self.drain()
        return self._replies.pop(token)

    def num_waiting(self) -> int:
        """Requests waiting in the stage as of its latest report, plus those sent since (no round trip)."""
        self.drain()
        return self._waiting + len(self._adds)

    # ---- transport ------------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        if self.fatal is not None:
            raise StageWorkerError(f"stage {self.name!r} failed: {self.fatal.error}")
        # A value that cannot be sent raises here, before anything is sent.
        frames = wire.encode_counted(self._out, message, self.transport)
        while True:
            try:
                self.commands.send_multipart(frames, flags=zmq.NOBLOCK)
                break
            except zmq.Again:  # the worker's queue is full (or it has not connected yet)
                self.on_wait()
                self.commands.poll(100, zmq.POLLOUT)
        self._sent += 1

    def drain(self) -> None:
        """Take in every message that has arrived from the worker."""
        while True:
            try:
                frames = self.events.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._take(wire.decode_counted(self._in, [f.buffer for f in frames], self.transport))

    def _take(self, message: Any) -> None:
        if isinstance(message, wire.Events):
            self.transport["events"] += 1
            self.transport["transit_s"] += max(0.0, time.monotonic() - message.sent_at)
            self._acked = max(self._acked, message.acked)
            while self._adds and self._adds[0] <= self._acked:
                self._adds.popleft()
            self._waiting = message.waiting
            self._steps.append(self._without_stale(message.events, message.acked))
        elif isinstance(message, wire.StatsReply):
            self._replies[message.token] = message.stats
        elif isinstance(message, wire.Fatal):
            self.fatal = message
            raise stage_failure(message)
        elif isinstance(message, wire.Ready):
            self.ready = message
        elif isinstance(message, wire.StartupError):
            self.startup_error = message

    def _without_stale(self, ev: StepEvents, acked: int) -> StepEvents:
        if self._aborted:
            stale = [r for r, n in self._aborted.items() if acked < n]
            for r in stale:
                for table in (ev.client_outputs, ev.stage_outputs, ev.finished, ev.errors):
                    table.pop(r, None)
            self._aborted = {r: n for r, n in self._aborted.items() if n > self._acked}
        return ev
