"""``train.minutes``: a time budget turned into a step count (and with it the LR schedule) from the measured
speed of training."""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

log = logging.getLogger("difftrain.train")


class StepClock:
    """Training speed: every ``every`` steps, the (steps, seconds) of the last ``window`` intervals, skipping
    the first ``skip`` steps (allocator warm-up, compilation). Intervals are long enough to average the task
    mixture (keyframe batches cost several times a t2i batch); only the recent ones count, so a slow start
    (another process, a cold page cache) does not shorten the run."""

    def __init__(self, every: int = 60, window: int = 6, skip: int = 5):
        self.every, self.skip = every, skip
        self.marks: deque[tuple[int, float]] = deque(maxlen=window + 1)   # (step, seconds) at each interval's end

    def observe(self, step: int, seconds: float) -> tuple[int, float] | None:
        if not self.marks:
            if step >= self.skip:
                self.marks.append((step, seconds))
            return None
        if step - self.marks[-1][0] < self.every:
            return None
        self.marks.append((step, seconds))
        return step - self.marks[0][0], seconds - self.marks[0][1]


class TimeBudget:
    """The run's step count. With ``minutes`` (> 0), re-measured every clock interval until half of the steps
    are done (each correction moves the cosine LR by a few %), never above ``max_steps``; later it stays put.
    ``mean_over_ranks`` averages (seconds, elapsed) over ranks, so every rank agrees on the count."""

    def __init__(self, max_steps: int, minutes: float, mean_over_ranks: Callable[[list[float]], list[float]]):
        self.max_steps, self.minutes, self.mean = max_steps, minutes, mean_over_ranks
        self.total_steps = max_steps
        self.fixed = minutes == 0
        self.clock = StepClock()
        self.lr_anchor: tuple[int, float] | None = None     # (step, LR) kept when the length changed there

    def state_dict(self) -> dict:
        return {"total_steps": self.total_steps, "budget_fixed": self.fixed,
                "lr_anchor": list(self.lr_anchor) if self.lr_anchor else None}

    def load_state_dict(self, info: dict, saved_train: dict) -> None:
        """From a checkpoint; a run extended (or shortened) since keeps the new length and re-measures a budget."""
        self.total_steps = int(info["total_steps"])
        self.fixed = bool(info.get("budget_fixed", True))
        anchor = info.get("lr_anchor")
        self.lr_anchor = (int(anchor[0]), float(anchor[1])) if anchor else None
        if saved_train.get("steps", self.max_steps) != self.max_steps or \
                saved_train.get("minutes", self.minutes) != self.minutes:
            self.total_steps, self.fixed = self.max_steps, self.minutes == 0

    def observe(self, step: int, train_seconds: float) -> None:
        if self.fixed:
            return
        measured = self.clock.observe(step, train_seconds)
        if measured is None:
            return
        steps_done, seconds = measured
        budget = self.minutes * 60
        seconds, elapsed = self.mean([seconds, train_seconds])
        per_step = seconds / max(1, steps_done)
        self.total_steps = min(self.max_steps, step + max(0, int((budget - elapsed) / per_step)))
        self.fixed = step >= self.total_steps // 2
        log.info("time budget %.1f min: %.3f s/step -> %d steps", budget / 60, per_step, self.total_steps)
