"""Metrics to ``RUN/metrics.jsonl`` (one JSON object a line; scripts and ``difftrain report`` read it),
TensorBoard (``RUN/tb``) and, with a port, a Prometheus endpoint (``prometheus_client``) for cluster
monitoring; events (restarts, checkpoints, skipped steps, rollbacks, spikes, stragglers, preemptions,
hangs) to ``RUN/events.jsonl``. Files are written by rank 0; every rank serves its own Prometheus port."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, port: int = 0):
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.enabled = self.rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.events_path = Path(run_dir) / "events.jsonl"
        self._tb = None
        self._gauges: dict[str, Any] | None = None
        self._counters: dict[str, Any] = {}
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if port:
            self._serve(port)

    def _serve(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry()
        self._gauges = {}
        try:
            self._server = start_http_server(port, registry=self._registry)
        except OSError as e:
            from difftrain.errors import UserError
            raise UserError(f"train.metrics_port: cannot serve Prometheus metrics on port {port} ({e})") from None

    def _gauge(self, name: str):
        from prometheus_client import Gauge

        key = "difftrain_" + "".join(c if c.isalnum() else "_" for c in name)
        if key not in self._gauges:
            self._gauges[key] = Gauge(key, f"difftrain metric {name}", ["rank"], registry=self._registry)
        return self._gauges[key].labels(rank=str(self.rank))

    def resumed_at(self, step: int) -> None:
        """The run goes on from ``step`` (a restart, or a rollback to a checkpoint in this process): the TensorBoard
        writer is reopened with ``purge_step`` = step + 1, so TensorBoard hides the earlier rows of the steps now
        replayed and shows each step once (``metrics.jsonl`` stays append-only; ``report`` keeps a step's last
        row)."""
        if self._tb is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._tb.close()
        self._tb = SummaryWriter(str(self.path.parent / "tb"), purge_step=step + 1)

    def image(self, tag: str, png, step: int) -> None:
        """A PNG (a preview grid) into TensorBoard's images at ``step`` (rank 0; no-op without TensorBoard)."""
        if self._tb is None:
            return
        import numpy as np
        from PIL import Image
        with Image.open(png) as im:          # our own grid, bounded by images.GRID_MAX_PIXELS
            im = im.convert("RGB")
            im.thumbnail((4096, 4096))        # TensorBoard keeps a copy of every image: at most 4096 a side
            self._tb.add_image(tag, np.asarray(im), step, dataformats="HWC")

    def log(self, step: int, values: dict[str, Any]) -> None:
        numeric = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._gauges is not None:
            self._gauge("step").set(step)
            for k, v in numeric.items():
                self._gauge(k).set(v)
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in numeric.items():
                if k != "time":
                    self._tb.add_scalar(k, v, step)

    def event(self, kind: str, step: int, force: bool = False, **info: Any) -> None:
        """One line of ``events.jsonl`` (rank 0; ``force`` writes from any rank, e.g. a hang seen by rank 3)."""
        if self._gauges is not None:
            from prometheus_client import Counter

            key = f"difftrain_events_{kind}"
            if key not in self._counters:
                self._counters[key] = Counter(key, f"difftrain {kind} events", ["rank"], registry=self._registry)
            self._counters[key].labels(rank=str(self.rank)).inc()
        if not (self.enabled or force):
            return
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"time": round(time.time(), 3), "step": step, "kind": kind, "rank": self.rank, **info},
                          default=str) + "\n"
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)   # one write per line
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if isinstance(server, tuple):        # (WSGIServer, thread) from prometheus_client >= 0.17
            server[0].shutdown()
            server[0].server_close()
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or on CPUs the process's peak RSS, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20    # kB on Linux


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")[0]


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / "events.jsonl")[0]


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file and how many non-blank lines were not one (e.g. a line cut short by a
    killed process)."""
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad
