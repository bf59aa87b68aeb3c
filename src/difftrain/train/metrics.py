"""Metrics to ``RUN/metrics.jsonl`` (one JSON object a line; scripts read it) and TensorBoard
(``RUN/tb``). Only rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.enabled = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
