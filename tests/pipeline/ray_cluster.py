"""A real two-node Ray cluster on this machine, all on 127.0.0.1: a head node and a second node joined with
``ray start --address``, each with its own custom resource (``node_a`` / ``node_b``), temp dir and ports.

Each ``ray start`` runs in a session of its own, so a node's daemons (GCS, raylet, agents) are its process group
and the actors' workers their children: ``kill_node_b`` SIGKILLs one node's raylet as a machine loss would, and
``stop`` ends exactly this cluster's processes (``ray stop --force`` would end every Ray process on the machine,
other test runs' included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

HOST = "127.0.0.1"
# The head's GCS declares a silent node dead after about 1 s (default: 30 s), so a lost node fails its stages'
# requests within seconds.
HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "300",
                "RAY_health_check_timeout_ms": "300", "RAY_health_check_failure_threshold": "3"}


# Ray replaces 127.0.0.1 by the machine's routable address wherever it meets it (the head's and the joining node's
# addresses, the address a node joins) unless it runs in single-machine mode, in which a node cannot join. So
# `ray start` runs with the loopback address kept (the node's processes run in single-machine mode, which only
# decides their address); a driver keeps it with ``loopback_driver``.
_LOOPBACK_RAY_START = """
import os, sys
import ray._private.services as services
services.get_node_ip_address = lambda address=None: "127.0.0.1"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from ray.scripts.scripts import main
sys.argv[0] = "ray"
main()
"""


@contextlib.contextmanager
def loopback_driver() -> Iterator[None]:
    """While active, this process's Ray driver keeps 127.0.0.1 as the address it connects to and reports, and
    connects without token auth, as the cluster's nodes run."""
    import ray._private.ray_constants as ray_constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        mp.setenv("RAY_AUTH_MODE", "disabled")
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Node:
    temp_dir: str
    pgid: int | None = None

    def processes(self) -> list[psutil.Process]:
        """The node's processes: its process group (what ``ray start`` started) and their children (the
        workers a raylet starts run in groups of their own)."""
        if self.pgid is None:
            return []
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) == self.pgid:
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
        return list(found.values())

    def raylet(self) -> psutil.Process:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                if p.name() == "raylet":
                    return p
        raise RuntimeError(f"no raylet in process group {self.pgid}")


@dataclass
class TwoNodeCluster:
    port: int = field(default_factory=free_port)
    head: Node = field(default_factory=lambda: Node(tempfile.mkdtemp(prefix="ray-a-", dir="/tmp")))
    node_b: Node = field(default_factory=lambda: Node(tempfile.mkdtemp(prefix="ray-b-", dir="/tmp")))

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, head_cpus: int, node_b_cpus: int, node_b_resources: int = 2) -> None:
        self._ray_start(self.head, [
            "--head", f"--port={self.port}", f"--node-ip-address={HOST}", f"--num-cpus={head_cpus}",
            '--resources={"node_a": 1}', "--include-dashboard=false", f"--dashboard-port={free_port()}"])
        self._ray_start(self.node_b, [
            f"--address={self.address}", f"--node-ip-address={HOST}", f"--num-cpus={node_b_cpus}",
            f'--resources={{"node_b": {node_b_resources}}}'])

    def _ray_start(self, node: Node, args: list[str]) -> None:
        cmd = [sys.executable, "-c", _LOOPBACK_RAY_START, "start", *args, f"--temp-dir={node.temp_dir}",
               "--disable-usage-stats", "--object-store-memory=100000000", f"--node-manager-port={free_port()}",
               f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
        # Token auth off on both nodes alike: a head started by `ray start` turns it on by itself once a token
        # exists (~/.ray/auth_token, which a local ray.init() writes), a joining node does not.
        env = {**os.environ, **HEALTH_CHECK, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        node.pgid = proc.pid  # a new session: its leader's pid is the group id, inherited by the node's daemons
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise RuntimeError(f"ray start {' '.join(args)} did not finish in 120 s:\n{out[-4000:]}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")

    def kill_node_b(self) -> int:
        """SIGKILL the second node's raylet (its workers see their raylet gone and exit); returns its pid."""
        raylet = self.node_b.raylet()
        raylet.send_signal(signal.SIGKILL)
        return raylet.pid

    def stop(self) -> None:
        for node in (self.node_b, self.head):
            procs = node.processes()
            if node.pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.pgid, signal.SIGKILL)
            for p in procs:  # any that left the group
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(procs, timeout=10)
            shutil.rmtree(node.temp_dir, ignore_errors=True)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.1)
