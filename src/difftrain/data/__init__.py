"""Data: the shapes world and its evaluator, sequence assembly, loaders."""

from __future__ import annotations

from difftrain.data.shapes import ShapesWorld


def world_from_config(data_cfg, seed: int) -> ShapesWorld:
    """The shapes world a config describes (``[data]``), for a given seed (training or evaluation)."""
    return ShapesWorld(seed, data_cfg.image_size, data_cfg.frames, tuple(data_cfg.background), data_cfg.motion)


__all__ = ["ShapesWorld", "world_from_config"]
