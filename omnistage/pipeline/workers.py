"""Stage workers seen from the API process: start one per stage, wait until each is ready, watch them, stop
them.

Backend ``mp``: each worker is a fresh Python process (``python -m omnistage.pipeline.worker``, i.e. the
spawn start method without re-importing the caller's ``__main__``), started with its placement's
environment (``CUDA_VISIBLE_DEVICES``, thread counts) so it holds before torch is imported. Its two streams
are abstract Unix sockets (``ipc://@...``: no file to leave behind, even after SIGKILL) on Linux and
loopback TCP elsewhere. Backend ``ray`` (``omnistage.pipeline.ray_workers``): the same worker body in Ray
actors on TCP.

Lifecycle:
- start: every worker gets ``Init``; each must answer ``Ready`` within the startup timeout. A worker that
  fails (``StartupError``: its traceback), dies or is late fails the engine with an error naming its stage,
  and every worker already started is stopped at once (terminated, then killed).
- watch: ``check`` (called by the engine's ``step`` and ``wait``, at most every ``CHECK_EVERY_S``) turns a
  dead worker or a ``Fatal`` message into a ``StageWorkerError``.
- stop: ``close`` sends ``Shutdown`` and waits, then terminates, then kills; also run at interpreter exit.
  Workers exit by themselves when the API process dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import zmq

from omnistage.config import PipelineConfig
from omnistage.pipeline import wire
from omnistage.pipeline.placement import Placement, plan
from omnistage.pipeline.remote_stage import RemoteStage, StageWorkerError, startup_failure

logger = logging.getLogger("omnistage.workers")
CHECK_EVERY_S = 0.1
STOP_GRACE_S = 5.0  # a worker finishing its current step before it reads Shutdown
TERMINATE_GRACE_S = 2.0


class WorkerHandle(Protocol):
    pid: int | None

    def exit_reason(self) -> str | None:
        """Why the worker is gone, or None while it runs."""

    def join(self, timeout: float) -> bool:
        """Wait until it is gone; True if it is."""

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    def address(self, tag: str) -> str:
        """A fresh address for the API process to bind (``tag`` names the stream)."""

    def start(self, index: int, name: str, commands: str, events: str, placement: Placement) -> WorkerHandle: ...

    def close(self) -> None: ...


# ---- backend "mp" -----------------------------------------------------------------------------------------
class ProcessHandle:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pid = proc.pid

    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def join(self, timeout: float) -> bool:
        try:
            self.proc.wait(max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


class ProcessLauncher:
    def __init__(self) -> None:
        self.prefix = f"omnistage-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.abstract = sys.platform.startswith("linux") and zmq.has("ipc")

    def address(self, tag: str) -> str:
        # Abstract socket names live in the kernel only; elsewhere the socket binds a random loopback port.
        return f"ipc://@{self.prefix}-{tag}" if self.abstract else "tcp://127.0.0.1"

    def start(self, index: int, name: str, commands: str, events: str, placement: Placement) -> WorkerHandle:
        cmd = [sys.executable, "-m", "omnistage.pipeline.worker", "--commands", commands, "--events", events,
               "--parent", str(os.getpid())]
        env = {**os.environ, **placement.env}
        return ProcessHandle(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def close(self) -> None:
        pass


def launcher_for(backend: str, pipeline: PipelineConfig, placements: Mapping[str, Placement],
                 timeout: float) -> Launcher:
    if backend == "mp":
        return ProcessLauncher()
    if backend == "ray":
        try:
            from omnistage.pipeline.ray_workers import RayLauncher
        except ImportError as exc:
            raise ImportError(f"backend 'ray' needs Ray: pip install 'omnistage[ray]' ({exc})") from None
        return RayLauncher(pipeline, placements, timeout)
    raise ValueError(f"no stage workers for backend {backend!r}")


# ---- the workers of one engine --------------------------------------------------------------------------
class _Resources:
    """What must be released even if the engine object is never closed (run by a weakref finalizer)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.handles: dict[str, WorkerHandle] = {}
        self.shutdown_sockets: dict[str, zmq.Socket] = {}
        self.launcher: Launcher | None = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def release(self, grace: float = STOP_GRACE_S) -> None:
        shutdown = wire.Codec(wire.ToWorker).encode(wire.Shutdown())
        for name, sock in self.shutdown_sockets.items():
            if name in self.handles and self.handles[name].exit_reason() is None:
                try:
                    sock.send_multipart(shutdown, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # its queue is full or it is gone: it will be terminated
        deadline = time.monotonic() + grace
        alive = [h for h in self.handles.values() if not h.join(deadline - time.monotonic())]
        for h in alive:
            logger.warning("stage worker %s did not stop within %.1f s; terminating it", h.pid, grace)
            h.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for h in alive:
            if not h.join(deadline - time.monotonic()):
                h.kill()
                h.join(TERMINATE_GRACE_S)
        self.handles.clear()
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets.clear()
        self.ctx.term()
        if self.launcher is not None:
            self.launcher.close()
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class StageWorkers:
    def __init__(self, backend: str, family_cls: type, pipeline: PipelineConfig, runners: Mapping[str, str],
                 args: Any) -> None:
        self.backend = backend
        self.res = _Resources()
        self._finalizer = weakref.finalize(self, self.res.release)
        self.stages: dict[str, RemoteStage] = {}
        self.placements = plan(pipeline, args.device)
        self._deadline: float | None = None
        self._last_check = 0.0
        self.failure: StageWorkerError | None = None
        try:
            self.res.launcher = launcher_for(backend, pipeline, self.placements, args.worker_startup_timeout)
            self._start(family_cls, pipeline, runners, args)
        except BaseException:
            self.close(grace=0)  # nothing has been served: no step to let finish, stop them now
            raise
        self.poller = zmq.Poller()
        for stage in self.stages.values():
            self.poller.register(stage.events, zmq.POLLIN)
        self.poller.register(self.res.wake_r, zmq.POLLIN)

    @property
    def handles(self) -> dict[str, WorkerHandle]:
        return self.res.handles

    @property
    def addresses(self) -> list[str]:
        return [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.res.sockets]

    # ---- start ----------------------------------------------------------------------------------------
    def _bind(self, kind: int, tag: str) -> tuple[zmq.Socket, str]:
        sock = self.res.ctx.socket(kind)
        self.res.sockets.append(sock)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, wire.HWM_MESSAGES)
        sock.setsockopt(zmq.LINGER, 0)
        address = self.res.launcher.address(tag)
        if address.startswith("tcp://") and address.count(":") == 1:
            sock.bind_to_random_port(address)
        else:
            sock.bind(address)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _start(self, family_cls: type, pipeline: PipelineConfig, runners: Mapping[str, str], args: Any) -> None:
        for i, name in enumerate(pipeline.order):
            commands, cmd_addr = self._bind(zmq.PUSH, f"{i}-cmd")
            events, evt_addr = self._bind(zmq.PULL, f"{i}-evt")
            self.stages[name] = RemoteStage(name, commands, events, self._on_wait, family_cls.wire_types)
            self.res.shutdown_sockets[name] = commands
            self.res.handles[name] = self.res.launcher.start(i, name, cmd_addr, evt_addr, self.placements[name])
        self._deadline = time.monotonic() + args.worker_startup_timeout
        for name in pipeline.order:
            p = self.placements[name]
            self.stages[name].send(wire.Init(
                stage=pipeline.stage(name).to_dict(), runner=runners[name], family=family_cls.name,
                family_module=family_cls.__module__, model=str(args.model), dtype=args.dtype, device=p.device,
                fast=args.fast, quantization=args.quantization,
                quantization_group_size=args.quantization_group_size, threads=p.threads, sys_path=list(sys.path)))
        while True:
            for stage in self.stages.values():
                stage.drain()
                if stage.startup_error is not None:
                    raise startup_failure(stage.startup_error)
            if all(s.ready is not None for s in self.stages.values()):
                break
            self._on_wait()
            zmq.select([s.events for s in self.stages.values()], [], [], 0.1)
        self._deadline = None
        for name, stage in self.stages.items():
            self.res.handles[name].pid = stage.ready.pid
        logger.info("stage workers ready: %s", {n: (s.ready.pid, s.ready.device, s.ready.threads)
                                                 for n, s in self.stages.items()})

    def _on_wait(self) -> None:
        """While blocked on one worker: take in every worker's events (so none of them blocks on us), notice
        dead workers and, during start-up, the deadline."""
        for stage in self.stages.values():
            stage.drain()
        self.check(force=self._deadline is not None)
        if self._deadline is not None and time.monotonic() > self._deadline:
            late = [n for n, s in self.stages.items() if s.ready is None]
            raise StageWorkerError(f"stage(s) {late} did not become ready within the startup timeout")

    # ---- watch ----------------------------------------------------------------------------------------
    def check(self, force: bool = False) -> None:
        """Raise StageWorkerError if a worker is gone (at most every CHECK_EVERY_S unless forced)."""
        if self.failure is not None:
            raise self.failure
        now = time.monotonic()
        if not force and now - self._last_check < CHECK_EVERY_S:
            return
        self._last_check = now
        for name, handle in self.res.handles.items():
            reason = handle.exit_reason()
            if reason is None:
                continue
            stage = self.stages.get(name)
            try:
                if stage is not None:
                    stage.drain()  # its last words, if any (a Fatal, a StartupError)
            except StageWorkerError as exc:
                self.failure = exc
                raise
            if stage is not None and stage.startup_error is not None:
                self.failure = startup_failure(stage.startup_error)
            else:
                what = "worker" if stage is None or stage.ready is not None else "worker (starting)"
                self.failure = StageWorkerError(f"stage {name!r} {what} (pid {handle.pid}) {reason}")
            raise self.failure

    def wait(self, timeout: float) -> None:
        """Block until a worker sends something, ``wake`` is called, or ``timeout`` passes."""
        events = dict(self.poller.poll(int(timeout * 1000)))
        if self.res.wake_r in events:
            try:
                while os.read(self.res.wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        self.check()

    def wake(self) -> None:
        """Cut a ``wait`` short (thread-safe)."""
        try:
            os.write(self.res.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # ---- stop -----------------------------------------------------------------------------------------
    def close(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every worker (Shutdown, wait, terminate, kill) and close the sockets. Idempotent."""
        if self._finalizer.detach() is not None:  # atomic: one caller releases
            self.res.release(grace)

    def pids(self) -> dict[str, int | None]:
        return {name: h.pid for name, h in self.res.handles.items()}

