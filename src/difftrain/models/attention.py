"""Attention as one replaceable module: rotary embedding, then scaled-dot-product attention.

Every block owns an ``Attention`` (no parameters, so replacing it never changes a state dict);
``parallel.cp`` swaps it for an all-to-all (Ulysses) version and other kernels plug in the same way,
without touching the blocks.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.models.rope import apply_rope


def sdpa(q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, mask: Tensor | None) -> Tensor:
    """(B, H, L, D) -> (B, H, L, D); ``mask`` is a key mask (B, 1, 1, L), True = attend."""
    return F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, attn_mask=mask)


class Attention(nn.Module):
    """Rotary attention; returns (B, L, H*D)."""

    def forward(self, q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, rope: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> Tensor:
        q, k = apply_rope(q_BHLD, *rope), apply_rope(k_BHLD, *rope)
        return sdpa(q, k, v_BHLD, mask).transpose(1, 2).flatten(2)
