"""Context parallelism, Ulysses style: each of the ``cp`` ranks holds 1/cp of every sequence (text and
image tokens alike); attention trades sequence shards for head shards with one all-to-all, attends over
the whole sequence for H/cp heads, and trades back.

Works on any backend with all-to-all (gloo on CPUs, NCCL on GPUs) and takes a key mask, which PyTorch's
ring ``context_parallel`` (CUDA-only, no mask) does not. Sequences are padded to a multiple of ``cp`` with
masked tokens. The model is untouched: ``apply_cp`` swaps each block's ``Attention`` module, and
``shard_sequence`` splits the inputs the same way for every tensor that runs along the sequence.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from difftrain.models.attention import Attention
from difftrain.models.rope import apply_rope


def _seq_to_heads(x_BHLD: Tensor, cp: int, group) -> Tensor:
    """(B, H, L/cp, D) sequence shard -> (B, H/cp, L, D) head shard; the sequence comes out rank-major."""
    B, H, Ls, D = x_BHLD.shape
    send = x_BHLD.reshape(B, cp, H // cp, Ls, D).movedim(1, 0).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.reshape(cp, B, H // cp, Ls, D).movedim(0, 2).reshape(B, H // cp, cp * Ls, D)


def _heads_to_seq(x_BHLD: Tensor, cp: int, group) -> Tensor:
    """Inverse of ``_seq_to_heads``."""
    B, Hs, L, D = x_BHLD.shape
    send = x_BHLD.reshape(B, Hs, cp, L // cp, D).movedim(2, 0).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.reshape(cp, B, Hs, L // cp, D).movedim(0, 1).reshape(B, cp * Hs, L // cp, D)


class UlyssesAttention(nn.Module):
    """Drop-in for ``Attention`` on sequence-sharded inputs. ``enabled = False`` runs the plain local
    attention (used when every rank holds the full sequence, e.g. while sampling)."""

    def __init__(self, cp: int, group):
        super().__init__()
        self.cp, self.group, self.enabled = cp, group, True
        self.local = Attention()

    def forward(self, q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, rope: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> Tensor:
        if not self.enabled:
            return self.local(q_BHLD, k_BHLD, v_BHLD, rope, mask)
        B, _, Ls, _ = q_BHLD.shape
        # RoPE is per token, so it is applied to the local shard before the exchange.
        q, k = apply_rope(q_BHLD, *rope), apply_rope(k_BHLD, *rope)
        q, k, v = (_seq_to_heads(x, self.cp, self.group) for x in (q, k, v_BHLD))
        # Every rank takes part in the mask gather, padded or not (a rank with no padding passes None).
        keys = torch.ones(B, Ls, dtype=torch.uint8, device=q.device) if mask is None else mask.reshape(B, Ls).to(torch.uint8)
        full = funcol.all_gather_tensor(keys[None], 0, self.group)          # (cp, B, Ls), rank-major
        full_mask = full.movedim(0, 1).reshape(B, 1, 1, self.cp * Ls).bool()
        out = self.local.kernel(q, k, v, full_mask)
        return _heads_to_seq(out, self.cp, self.group).transpose(1, 2).flatten(2)


def apply_cp(dit: nn.Module, cp: int, group) -> None:
    """Replace every block's attention with the Ulysses version (no parameters move)."""
    for block in (*dit.double_blocks, *dit.single_blocks):
        block.attention = UlyssesAttention(cp, group)


@contextlib.contextmanager
def cp_disabled(model: nn.Module):
    """Run the model on full (unsharded) sequences on every rank, e.g. for sampling."""
    mods = [m for m in model.modules() if isinstance(m, UlyssesAttention)]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def pad_to_multiple(x: Tensor, cp: int, value: float | bool = 0) -> Tensor:
    """Pad dim 1 (the sequence) to a multiple of ``cp`` with ``value``."""
    extra = (-x.shape[1]) % cp
    if not extra:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat((x, pad), 1)


def shard_sequence(x: Tensor, cp: int, rank: int, value: float | bool = 0) -> Tensor:
    """This rank's contiguous 1/cp of the (padded) sequence dim 1."""
    if cp == 1:
        return x
    x = pad_to_multiple(x, cp, value)
    n = x.shape[1] // cp
    return x[:, rank * n:(rank + 1) * n]
