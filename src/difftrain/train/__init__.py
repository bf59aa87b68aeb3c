"""The training loop (``trainer``), its objectives (``objectives``; DPO's run: ``dpo``), the factory every entry point
builds models with (``build``), checkpoints, health, EMA, metrics. The two functions here are the entry points'
way to a trainer: nothing else in the package imports it."""

from __future__ import annotations


def build_trainer(cfg, run_dir=None, env=None, resume: bool = True, allow_config_change: tuple[str, ...] = ()):
    """The trainer a config describes: the data source ``data.source`` names and the flow-matching objective."""
    from difftrain.diffusion.flow import FlowSpec
    from difftrain.sources import ConfiguredSource
    from difftrain.train.objectives import FlowMatching
    from difftrain.train.trainer import Trainer

    return Trainer(cfg, ConfiguredSource(cfg), FlowMatching(FlowSpec.from_config(cfg.diffusion)), run_dir, env,
                   resume, allow_config_change)


def build_dpo_trainer(cfg, run_dir=None, env=None, resume: bool = True, allow_config_change: tuple[str, ...] = ()):
    """The trainer ``difftrain dpo`` runs: the pairs source and the DPO objective the config describes (its reference
    built once the trainer has built the policy)."""
    from difftrain.train.dpo import dpo_run
    from difftrain.train.trainer import Trainer

    source, objective = dpo_run(cfg)
    return Trainer(cfg, source, objective, run_dir, env, resume, allow_config_change)
