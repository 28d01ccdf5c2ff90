"""A real fleet for the client's tests: fleet-scheduler and fleet-worker processes on a fresh
namespace and free ports, against the real Redis and RabbitMQ (ops/services.sh starts them).

FLEET_BIN_DIR (default <repo>/target/debug) holds the binaries; FLEET_AMQP_URL and
FLEET_REDIS_URL name the services (the local ones by default).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("FLEET_BIN_DIR") or REPO / "target" / "debug")
AMQP_URL = os.environ.get("FLEET_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
REDIS_URL = os.environ.get("FLEET_REDIS_URL", "redis://127.0.0.1:6379")
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_namespace(prefix: str = "pyclient") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Proc:
    """One fleet process, its output in a log file."""

    def __init__(self, name: str, binary: str, env: Dict[str, str], logdir: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(logdir, f"{name}.log")
        full = dict(os.environ)
        full.update(
            {
                "FLEET_AMQP_URL": AMQP_URL,
                "FLEET_REDIS_URL": REDIS_URL,
                "FLEET_HTTP_ADDR": f"127.0.0.1:{self.port}",
                "FLEET_LOG_FORMAT": "text",
            }
        )
        full.update(env)
        path = BIN / binary
        if not path.exists():
            raise RuntimeError(f"{path} not found: build it (cargo build --workspace --bins) or set FLEET_BIN_DIR")
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen([str(path)], env=full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        end = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready within {READY_TIMEOUT:g} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
                raise RuntimeError(f"{self.name} did not stop within {STOP_TIMEOUT:g} s of SIGTERM")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Fleet:
    """A namespace with its processes; `close()` stops them (SIGTERM) and deletes the namespace."""

    def __init__(self, common_env: Optional[Dict[str, str]] = None) -> None:
        self.namespace = new_namespace()
        self.logdir = tempfile.mkdtemp(prefix=f"{self.namespace}-")
        self.env = {"FLEET_NAMESPACE": self.namespace, "FLEET_QUEUE_TYPE": "classic"}
        self.env.update(common_env or {})
        self.procs: List[Proc] = []
        self.scheduler: Optional[Proc] = None

    def start_scheduler(self, env: Optional[Dict[str, str]] = None) -> Proc:
        p = Proc(f"scheduler{len(self.procs)}", "fleet-scheduler", {**self.env, **(env or {})}, self.logdir)
        self.procs.append(p)
        p.wait_ready()
        self.scheduler = p
        return p

    def start_worker(self, capacity: int = 8, env: Optional[Dict[str, str]] = None) -> Proc:
        name = f"worker{len(self.procs)}"
        wenv = {
            "FLEET_WORKER_ID": f"{self.namespace}-{name}",
            "FLEET_CAPACITY": str(capacity),
            "FLEET_EXECUTOR": "builtin",
        }
        p = Proc(name, "fleet-worker", {**self.env, **wenv, **(env or {})}, self.logdir)
        self.procs.append(p)
        p.wait_ready()
        return p

    def stop_all(self) -> None:
        errors = []
        for p in reversed(self.procs):
            try:
                p.stop()
            except RuntimeError as e:
                errors.append(str(e))
        self.procs = []
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        try:
            self.stop_all()
        finally:
            subprocess.run(
                [str(BIN / "fleetctl"), "delete-namespace", "--yes"],
                env={**os.environ, "FLEET_NAMESPACE": self.namespace, "FLEET_AMQP_URL": AMQP_URL, "FLEET_REDIS_URL": REDIS_URL},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=60,
                check=False,
            )


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
