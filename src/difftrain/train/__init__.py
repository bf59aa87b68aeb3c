"""The training loop (``trainer``), its objectives (``objectives``), checkpoints, health, EMA, metrics."""

from __future__ import annotations


def build_trainer(cfg, run_dir=None, env=None, resume: bool = True, allow_config_change: tuple[str, ...] = ()):
    """The trainer a config describes: the data source ``data.source`` names and the flow-matching objective."""
    from difftrain.diffusion.flow import FlowSpec
    from difftrain.sources import ConfiguredSource
    from difftrain.train.objectives import FlowMatching
    from difftrain.train.trainer import Trainer

    return Trainer(cfg, ConfiguredSource(cfg), FlowMatching(FlowSpec.from_config(cfg.diffusion)), run_dir, env,
                   resume, allow_config_change)
