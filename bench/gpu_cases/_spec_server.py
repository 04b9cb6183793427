"""A real `dsv4serve` on the real checkpoint, one `--speculative-tokens N` at a time, for gpu_cases/spec_decode.py.

    servers = SpecServers(checkpoint_dir, extra_args)
    text, tokens, seconds = servers.generate(n)     # the fixed greedy prompts through the server of N drafts
    servers.counters(n)                             # its spec_decode_* counters from /metrics
    servers.close()

Only one server lives at a time (the model fills the card): asking for another N stops the running one. The
client is the standard library's (the device image has no httpx); the server needs the project's own
dependencies on that machine. Not a module gpu_check discovers (its name starts with "_").
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TextIO

PROMPTS = (
    "Explain, step by step, how a hash map handles collisions.",
    "Write a Python function that merges two sorted lists, with a docstring.",
    "Summarize the causes of the French Revolution in five sentences.",
    "List the first twenty prime numbers and say how you found them.",
)
MAX_TOKENS = 128
COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


def checkpoint_dir() -> Path | None:
    """$DSV4_REAL_CHECKPOINT_DIR when it holds a config.json (the real weights), else None."""
    folder = os.environ.get("DSV4_REAL_CHECKPOINT_DIR")
    return Path(folder) if folder and (Path(folder) / "config.json").is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class SpecServers:
    def __init__(self, checkpoint: Path, extra_args: str = "", log_dir: Path | None = None, start_s: float = 900.0):
        self.checkpoint, self.extra = checkpoint, shlex.split(extra_args)
        self.log_dir = log_dir or Path(os.environ.get("OUT", "/tmp"))
        self.start_s = start_s
        self.n: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log: TextIO | None = None
        self.base = ""

    def _start(self, n: int) -> None:
        self.close()
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "dsv4serve", "--model", str(self.checkpoint), "--port", str(port)]
        cmd += ["--speculative-tokens", str(n), *self.extra]
        self._log = open(self.log_dir / f"spec_server_n{n}.log", "w")  # noqa: SIM115 (closed by close())
        self.proc, self.n = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT), n
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the N={n} server exited ({self.proc.returncode}); see its log in {self.log_dir}")
            try:
                _get(self.base + "/health", 2.0)  # raises until the server answers 200
                return
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"the N={n} server was not healthy within {self.start_s} s")

    def server(self, n: int) -> str:
        if self.n != n or self.proc is None or self.proc.poll() is not None:
            self._start(n)
        return self.base

    def generate(self, n: int) -> tuple[str, int, float]:
        """The prompts one after another (batch 1), greedy -> (all texts joined, completion tokens, seconds)."""
        base = self.server(n)
        texts, tokens, t0 = [], 0, time.perf_counter()
        for prompt in PROMPTS:
            body = {"model": "any", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            out = _post(base + "/v1/completions", body)
            texts.append(out["choices"][0]["text"])
            tokens += int(out["usage"]["completion_tokens"])
        return "\x00".join(texts), tokens, time.perf_counter() - t0

    def counters(self, n: int) -> dict[str, float]:
        text = _get(self.server(n) + "/metrics")
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("dsv4serve:") and name[len("dsv4serve:") :] in COUNTERS:
                values[name[len("dsv4serve:") :]] = float(value)
        return values

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
        self.proc, self.n, self._log = None, None, None
