"""How a single-device model is spread over devices and sped up. ``parallelize`` applies, in order:
context parallelism (attention swap), activation checkpointing, torch.compile per block, then FSDP2/HSDP
(per block, then the roots), as torchtitan's FLUX recipe does."""

from __future__ import annotations

import logging

import torch
from torch import nn

from difftrain.config.schema import Config
from difftrain.parallel.ac import apply_ac
from difftrain.parallel.compile import compile_blocks
from difftrain.parallel.cp import apply_cp
from difftrain.parallel.dist import ParallelEnv
from difftrain.parallel.fsdp import apply_fsdp, replicated_params

log = logging.getLogger("difftrain.parallel")


def parallelize(model: nn.ModuleDict, cfg: Config, env: ParallelEnv, param_dtype: torch.dtype | None,
                granularity: str = "block", ignored=()) -> tuple[list, list]:
    """Wrap ``model`` ({"dit", "text"?}) in place for ``env``. Returns the FSDP units and the replicated
    trainable parameters whose gradients the trainer all-reduces (both empty in a world of one).
    ``granularity``: the FSDP units ('block' to train, 'layer' to sample; ``fsdp.fsdp_units``). ``ignored``:
    parameters FSDP leaves whole on every rank (a quantized frozen base)."""
    dit = model["dit"]
    if env.cp > 1:
        apply_cp(dit, env.cp, env.cp_group)
    n_ac = apply_ac(dit, cfg.parallel.ac)
    n_compiled = compile_blocks(dit) if cfg.train.compile else 0
    units, replicated = [], []
    mesh = env.fsdp_mesh()
    if mesh is not None:
        units = apply_fsdp(model, mesh, param_dtype, cpu_offload=cfg.parallel.cpu_offload, granularity=granularity,
                           ignored=ignored)
        replicated = replicated_params(model)
    if env.is_main:
        log.info("parallelize: cp %d, activation checkpointing %s (%d blocks), compiled %d blocks, %d FSDP units",
                 env.cp, cfg.parallel.ac, n_ac, n_compiled, len(units))
    return units, replicated


__all__ = ["parallelize", "compile_blocks", "apply_ac", "apply_cp", "apply_fsdp"]
