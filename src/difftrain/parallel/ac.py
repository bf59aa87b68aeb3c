"""Activation checkpointing per block: off by default (we shard before we recompute; ``difftrain plan``
says when memory needs it).

- ``full``: every block keeps only its inputs and recomputes its forward in backward (+~1 forward of
  compute per step);
- ``every:N``: the same for every N-th block (a dial between memory and time);
- ``selective``: inside every block, the outputs of matmuls and attention are kept and only the cheap
  element-wise ops (norms, modulation, GELU, RoPE) are recomputed: most of the activation memory of the
  element-wise chain for a few % of step time.

The block's ``forward`` is wrapped in place rather than the block in a wrapper module, so parameter names
(checkpoints, the FLUX adapter, the EMA) do not change with the AC setting.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_KEEP = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


# Context parallelism's exchanges: recomputing them in backward would repeat the communication.
_KEEP |= {getattr(torch.ops._c10d_functional, name).default
          for name in ("all_to_all_single", "all_gather_into_tensor", "wait_tensor")
          if hasattr(torch.ops._c10d_functional, name)}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(module: nn.Module, selective: bool) -> None:
    inner = module.forward
    kwargs = {"context_fn": _selective_context} if selective else {}

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = forward


def parse_ac(mode: str) -> tuple[str, int]:
    """'none' | 'full' | 'selective' | 'every:N' -> (kind, N)."""
    if mode.startswith("every:"):
        return "every", int(mode.split(":", 1)[1])
    return mode, 1


def apply_ac(dit: nn.Module, mode: str) -> int:
    """Checkpoint the DiT's blocks as ``mode`` says; returns how many blocks were wrapped."""
    kind, every = parse_ac(mode)
    if kind == "none":
        return 0
    blocks = [*dit.double_blocks, *dit.single_blocks]
    n = 0
    for i, block in enumerate(blocks):
        if kind == "every" and i % every:
            continue
        _checkpointed(block, selective=kind == "selective")
        n += 1
    return n
