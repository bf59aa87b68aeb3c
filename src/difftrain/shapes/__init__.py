"""The shapes world: the built-in ground truth for quality.

A procedural world of one coloured shape on a grey canvas (``world``: scenes, rendering; ``captions``: their
text), an evaluator that reads generated pixels back against the prompt (``evaluate``), an exporter that
writes the world as raw data for the data path (``export``), and a data source that renders it on the fly
for training (``loader``). Nothing in ``data`` knows this world; ``difftrain.sources`` chooses between it
and the latent store.
"""

from __future__ import annotations

from difftrain.shapes.captions import vocabulary
from difftrain.shapes.world import ShapesWorld


def world_from_config(data_cfg, seed: int, training: bool = False) -> ShapesWorld:
    """The shapes world a config describes (``[data]``), for a given seed. ``training``: the world training
    draws from, with ``data.edit_kinds``'s weights; without it (evaluation) every edit kind is equally likely."""
    return ShapesWorld(seed, data_cfg.image_size, data_cfg.frames, tuple(data_cfg.background), data_cfg.motion,
                       edit_kinds=data_cfg.edit_kinds if training else None)


__all__ = ["ShapesWorld", "world_from_config", "vocabulary"]
