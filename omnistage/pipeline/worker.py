"""A stage worker: one stage, built exactly as the in-process engine builds it (the family builds its model
from the checkpoint, its own weights only, with the bridge of its incoming edge), in its own process.

It connects to two ZeroMQ streams the API process bound: commands in (``wire.ToWorker``, handled in the
order sent) and events out (``wire.FromWorker``). After ``Init`` it answers ``Ready`` (or ``StartupError``
with the traceback), then loops: handle every command that has arrived, step the stage when it has work,
send each step's events. It never waits for the API process while it has work, so stages overlap. A step
that ran nothing (e.g. every request waits for upstream input) makes it sleep until the next command.

It exits on ``Shutdown``, after a failure of the stage as a whole (``Fatal`` sent first), and on its own
when the process that started it is gone (its parent pid changes; checked at least twice a second).

    python -m omnistage.pipeline.worker --commands ADDR --events ADDR [--parent PID]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import zmq

from omnistage.pipeline import wire
from omnistage.runtime_env import resident_bytes

logger = logging.getLogger("omnistage.worker")
IDLE_POLL_S = 0.5  # longest sleep between parent checks
LINGER_MS = 2000  # how long a closing socket may still deliver (the last events, a Fatal)


class ParentGone(Exception):
    pass


def build_worker_stage(init: wire.Init) -> tuple[Any, tuple[type, ...]]:
    """The stage, and the dataclasses its family sends inside per-request values."""
    from omnistage.config import StageConfig
    from omnistage.models.registry import get_family
    from omnistage.pipeline.engine_args import EngineArgs
    from omnistage.pipeline.faults import FaultInjector
    from omnistage.pipeline.stage_builder import build_stage
    from omnistage.runtime_env import freeze_loaded_objects

    for p in init.sys_path:
        if p not in sys.path:
            sys.path.append(p)
    try:
        family_cls = get_family(init.family)
    except ValueError:
        importlib.import_module(init.family_module)  # a plug-in family registers itself on import
        family_cls = get_family(init.family)
    torch.set_num_threads(init.threads)
    stage_cfg = StageConfig.from_dict(init.stage)
    args = EngineArgs(init.model, dtype=init.dtype, device=init.device, fast=init.fast,
                      quantization=init.quantization, quantization_group_size=init.quantization_group_size)
    stage = build_stage(family_cls(init.model), stage_cfg, init.runner, args, FaultInjector.from_env())
    freeze_loaded_objects()  # this process holds the stage for its life: collections need not walk it
    return stage, family_cls.wire_types


def _empty(ev: Any) -> bool:
    return not (ev.num_tokens or ev.client_outputs or ev.stage_outputs or ev.finished or ev.errors)


class Worker:
    def __init__(self, commands: str, events: str, parent: int | None = None,
                 build: Callable[[wire.Init], tuple[Any, tuple[type, ...]]] = build_worker_stage) -> None:
        self.parent = parent
        self.build = build
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.PULL)
        self.cmd.setsockopt(zmq.RCVHWM, wire.HWM_MESSAGES)
        self.cmd.connect(commands)
        self.evt = self.ctx.socket(zmq.PUSH)
        self.evt.setsockopt(zmq.SNDHWM, wire.HWM_MESSAGES)
        self.evt.setsockopt(zmq.LINGER, LINGER_MS)
        self.evt.connect(events)
        self.out = wire.Codec(wire.FromWorker)
        self.inp = wire.Codec(wire.ToWorker)
        self.stage: Any = None
        self.name = "?"
        self.acked = 0  # commands handled
        self.started = time.monotonic()
        self.counters = {"steps": 0, "busy_s": 0.0, **wire.new_counters()}

    # ---- transport ------------------------------------------------------------------------------------
    def _check_parent(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            raise ParentGone

    def send(self, message: Any) -> None:
        frames = wire.encode_counted(self.out, message, self.counters)
        while True:
            try:
                self.evt.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # the API process is not reading: wait, but not for a dead parent
                self._check_parent()
                self.evt.poll(int(IDLE_POLL_S * 1000), zmq.POLLOUT)

    def recv(self, timeout_s: float) -> Any | None:
        if not self.cmd.poll(int(timeout_s * 1000)):
            return None
        frames = self.cmd.recv_multipart(copy=False)
        return wire.decode_counted(self.inp, [f.buffer for f in frames], self.counters)

    # ---- life -----------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            init = None
            while init is None:
                self._check_parent()
                init = self.recv(IDLE_POLL_S)
            if not isinstance(init, wire.Init):
                raise RuntimeError(f"expected Init first, got {type(init).__name__}")
            self.name = str(init.stage.get("name"))
            try:
                self.stage, types = self.build(init)
            except Exception as exc:
                logger.exception("stage %r failed to start", self.name)
                self.send(wire.StartupError(self.name, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
                return 1
            self.inp = wire.Codec(wire.ToWorker, init.device, types)
            self.out = wire.Codec(wire.FromWorker, types=types)
            self.send(wire.Ready(self.name, os.getpid(), init.device, torch.get_num_threads()))
            self.started = time.monotonic()
            return self._loop()
        except ParentGone:
            logger.warning("stage %r: the API process is gone; exiting", self.name)
            self.evt.setsockopt(zmq.LINGER, 0)  # nobody will read what is still queued
            return 2
        finally:
            self.cmd.close(linger=0)
            self.evt.close()
            self.ctx.term()

    def _loop(self) -> int:
        idle = True
        while True:
            try:
                message = self.recv(IDLE_POLL_S if idle else 0)
                while message is not None:
                    if isinstance(message, wire.Shutdown):
                        return 0
                    self._handle(message)
                    message = self.recv(0)
                self._check_parent()
                idle = not self._step()
            except ParentGone:
                raise
            except Exception as exc:  # the stage as a whole (or this worker) cannot go on
                logger.exception("stage %r failed", self.name)
                self.send(wire.Fatal(self.name, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
                return 1

    def _step(self) -> bool:
        """Step the stage if it has work; True if the step did something (then no sleep before the next)."""
        if not self.stage.has_work():
            return False
        t0 = time.monotonic()
        events = self.stage.step()
        if _empty(events):  # e.g. every request waits for upstream input: sleep until a command comes
            return False
        self.counters["steps"] += 1
        self.counters["busy_s"] += time.monotonic() - t0
        self._send_events(events)
        return True

    def _send_events(self, events: Any) -> None:
        waiting = int(self.stage.stats().get("waiting", 0))
        self.send(wire.Events(events, self.acked, waiting, time.monotonic()))

    def _handle(self, message: Any) -> None:
        self.acked += 1
        stage = self.stage
        if isinstance(message, wire.AddRequest):
            try:
                stage.add_request(message.request)
            except ValueError as exc:  # this request only, reported in order with the stage's events
                from omnistage.pipeline.stage import StepEvents

                self._send_events(StepEvents(self.name, errors={message.request.req_id: str(exc)}))
        elif isinstance(message, wire.AddInput):
            stage.add_input(message.req_id, message.source, message.payload)
        elif isinstance(message, wire.EndInput):
            stage.end_input(message.req_id, message.source)
        elif isinstance(message, wire.Abort):
            stage.abort(message.req_id)
        elif isinstance(message, wire.StatsQuery):
            stats = dict(stage.stats())
            stats["worker"] = {"pid": os.getpid(), "uptime_s": time.monotonic() - self.started,
                               "resident_bytes": resident_bytes(), **self.counters}
            self.send(wire.StatsReply(message.token, stats))
        else:
            raise RuntimeError(f"unexpected {type(message).__name__} after Init")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="omnistage stage worker (started by the engine)")
    ap.add_argument("--commands", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--parent", type=int, default=None, help="exit when this process is no longer the parent")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [stage worker %(process)d] %(message)s")
    return Worker(args.commands, args.events, args.parent).run()


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown (seconds with torch loaded): sockets are closed, nothing else to flush.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
