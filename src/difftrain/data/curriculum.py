"""The curriculum at run time: which stage is in force at a step, and which bucket an image belongs to.
Stages and buckets are config (``difftrain.config.stages``: ``[[data.stages]]``, parsed and checked there)."""

from __future__ import annotations

import math

from difftrain.config.stages import Bucket, Stage, parse_stages


def assign_bucket(buckets: tuple[Bucket, ...] | list[Bucket], width: int, height: int) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's (in log ratio); ties go to the larger area."""
    a = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.w / b.h) - a), -b.h * b.w))


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage in force at optimizer step ``step`` (switches happen at step boundaries)."""
    current = stages[0]
    for s in stages:
        if s.start_step <= step:
            current = s
    return current


__all__ = ["assign_bucket", "stage_at", "parse_stages", "Bucket", "Stage"]
