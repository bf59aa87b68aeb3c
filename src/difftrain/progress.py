"""Run the trainer with visible progress: a rich progress bar on a terminal, log lines otherwise
(CI logs, pipes). Everything goes to stderr so stdout stays one JSON object."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from difftrain.config import Config
from difftrain.train import build_trainer
from difftrain.train.trainer import Trainer

log = logging.getLogger("difftrain")


def run_training(cfg: Config, run_dir: str | Path | None = None, progress: bool = True,
                 trainer: Trainer | None = None) -> dict:
    trainer = trainer or build_trainer(cfg, run_dir)
    console = Console(stderr=True)
    every = max(1, cfg.train.log_every)
    if progress and console.is_terminal:
        columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("train", total=trainer.total_steps, completed=trainer.step, info="")

            def on_step(step, total, stats):
                bar.update(task, completed=step, total=total, info=f"loss {stats.loss:.4f} lr {stats.lr:.2e}")
            return trainer.fit(on_step)

    def on_step(step, total, stats):
        if step % every == 0 or step == total:
            print(f"step {step}/{total} loss {stats.loss:.4f} grad_norm {stats.grad_norm:.3f} lr {stats.lr:.2e}",
                  file=sys.stderr, flush=True)
    return trainer.fit(on_step)
