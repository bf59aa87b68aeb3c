"""torch.compile per transformer block (as torchtitan): each block compiles once and the compiled code is
reused by every block of the same shape; ``Module.compile`` compiles in place, so parameter names
(and with them checkpoints and the FLUX adapter) are unchanged."""

from __future__ import annotations

from torch import nn


def compile_blocks(dit: nn.Module, dynamic: bool | None = None) -> int:
    """Compile every double- and single-stream block of ``dit``; returns how many were compiled."""
    n = 0
    for blocks in (dit.double_blocks, dit.single_blocks):
        for block in blocks:
            block.compile(dynamic=dynamic)
            n += 1
    return n
