"""Learning-rate schedule as a pure function of the step: its state is the step itself."""

from __future__ import annotations

import math


def lr_at(step: int, peak: float, total: int, warmup: int, kind: str = "cosine", min_ratio: float = 0.1,
          anchor: tuple[int, float] | None = None) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then constant or cosine to ``min_ratio * peak``.
    ``anchor`` (step, lr): the run's length changed at that step and kept its LR there (``train.schedule_change
    = 'keep_lr'``): from it the cosine runs from that LR to ``min_ratio * peak`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    if kind != "cosine":
        raise ValueError(f"unknown schedule {kind!r}")
    low = min_ratio * peak
    if anchor is not None and step >= anchor[0]:
        progress = min(1.0, (step - anchor[0]) / max(1, total - anchor[0]))
        return low + (anchor[1] - low) * 0.5 * (1 + math.cos(math.pi * progress))
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
