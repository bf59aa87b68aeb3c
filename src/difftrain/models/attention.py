"""Attention as one replaceable module: rotary embedding, then scaled-dot-product attention.

Every block owns an ``Attention`` (no parameters, so replacing it never changes a state dict);
``parallel.cp`` swaps it for an all-to-all (Ulysses) version and other kernels plug in the same way,
without touching the blocks.
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.models.rope import apply_rope


def sdpa(q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, mask: Tensor | None) -> Tensor:
    """(B, H, L, D) -> (B, H, L, D); ``mask`` is a key mask (B, 1, 1, L), True = attend."""
    return F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, attn_mask=mask)


class Attention(nn.Module):
    """Rotary attention; returns (B, L, H*D). ``kernel`` computes attention from (q, k, v, key mask): SDPA with
    its own choice by default, or a backend of ``models.kernels`` (``set_kernel``)."""

    def __init__(self, kernel: Callable | None = None):
        super().__init__()
        self.kernel = kernel or sdpa

    def forward(self, q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, rope: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> Tensor:
        q, k = apply_rope(q_BHLD, *rope), apply_rope(k_BHLD, *rope)
        return self.kernel(q, k, v_BHLD, mask).transpose(1, 2).flatten(2)


def set_kernel(model: nn.Module, kernel: Callable) -> int:
    """Give every ``Attention`` of ``model`` (context parallelism's included) this kernel; how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            m.kernel = kernel
            n += 1
    return n
