"""A real ``difftrain-rate serve`` process (uvicorn, N worker processes) for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, db: str, workers: int = 2, port: int | None = None, batches: str | None = None,
                 extra: list[str] | None = None):
        self.db, self.workers, self.port, self.batches = db, workers, port or free_port(), batches
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "Server":
        cmd = [sys.executable, "-m", "difftrain_rate", "serve", "--db", self.db, "--port", str(self.port),
               "--workers", str(self.workers)] + (["--batches", self.batches] if self.batches else []) + self.extra
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/login", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError("the server did not answer in time")

    def kill(self) -> None:
        """SIGKILL the server and its workers (no shutdown of any kind)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
