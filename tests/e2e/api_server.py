"""A real `dsv4serve` process for API tests: started on a free port, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

# a server's worker computing on one torch thread: on a 2-core machine shared with the API process and the
# test, two threads hand work to each other through a descheduled peer (dsv4-tiny steps 5-20x slower)
ONE_TORCH_THREAD = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, cache_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "DSV4SERVE_CACHE_DIR": str(cache_dir), **(env or {})}
        cmd = [sys.executable, "-m", "dsv4serve", "--model", "dsv4-tiny", "--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server was not healthy within {timeout_s} s:\n{self.log()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """The spawned worker(s): children of the server whose command line is a multiprocessing spawn."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
                    pids.append(int(pid))
        return pids

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(
    cache_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A healthy server for the block (a module fixture's body), stopped at its end."""
    srv = ServerProcess(cache_dir, log_path, *args, env=env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
