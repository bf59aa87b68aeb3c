"""Run the trainer with visible progress: a rich progress bar on a terminal, log lines otherwise
(CI logs, pipes). Everything goes to stderr so stdout stays one JSON object."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from difftrain.config import Config
from difftrain.train import build_trainer
from difftrain.train.trainer import Trainer

log = logging.getLogger("difftrain")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Pace:
    """The run's pace from its own steps: once ``first`` steps are done (timed from the end of the first step
    this process ran, so start-up and the first step's allocations do not count), one estimate line (steps left x
    the s/step of those steps), then an ETA for each log line from the mean s/step so far."""

    def __init__(self, first: int = 40, clock=time.perf_counter):
        self.first, self.clock = first, clock
        self.t0: float | None = None           # when the first step this process ran ended
        self.step0 = self.step = 0
        self.now = 0.0
        self.estimate: dict | None = None

    def update(self, step: int, total: int) -> str | None:
        """Call after each step; returns the estimate line once, when it is due."""
        now = self.clock()
        if self.t0 is None:
            self.t0, self.step0, self.now, self.step = now, step, now, step
            return None
        self.now, self.step = now, step
        done = step - self.step0
        if self.estimate is None and (done >= self.first or step >= total) and done > 0:
            s_step = (now - self.t0) / done
            self.estimate = {"steps": total, "s_per_step": round(s_step, 4), "measured_steps": done,
                             "seconds_left": round(s_step * (total - step), 1)}
            return (f"estimate: {total} steps at {s_step:.3f} s a step (measured over steps {self.step0 + 1}-{step}) "
                    f"= {_clock(s_step * total)} of training, {_clock(s_step * (total - step))} left")
        return None

    def eta(self, total: int) -> str:
        done = self.step - self.step0
        if self.t0 is None or done <= 0:
            return ""
        return f" eta {_clock((self.now - self.t0) / done * (total - self.step))}"


def run_training(cfg: Config, run_dir: str | Path | None = None, progress: bool = True,
                 trainer: Trainer | None = None) -> dict:
    trainer = trainer or build_trainer(cfg, run_dir)
    console = Console(stderr=True)
    every = max(1, cfg.train.log_every)
    pace = Pace()
    if progress and console.is_terminal:
        columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("train", total=trainer.total_steps, completed=trainer.step, info="")

            def on_bar(step, total, stats):
                line = pace.update(step, total)
                if line:
                    bar.console.print(line)
                bar.update(task, completed=step, total=total, info=f"loss {stats.loss:.4f} lr {stats.lr:.2e}")
            return _fit(trainer, on_bar, pace)

    def on_step(step, total, stats):
        line = pace.update(step, total)
        if line:
            print(line, file=sys.stderr, flush=True)
        if step % every == 0 or step == total:
            print(f"step {step}/{total} loss {stats.loss:.4f} grad_norm {stats.grad_norm:.3f} lr {stats.lr:.2e}"
                  f"{pace.eta(total)}", file=sys.stderr, flush=True)
    return _fit(trainer, on_step, pace)


def _fit(trainer: Trainer, on_step, pace: Pace) -> dict:
    summary = trainer.fit(on_step)
    if pace.estimate is not None:           # the estimate beside what the run took, in the summary
        summary["estimate"] = pace.estimate
    return summary
