"""Diffusion-DPO for a flow model (Wallace et al. 2023, in the flow form every public flow implementation uses).

A pair (winner w, loser l) shares its timestep t and noise eps. e is a sample's flow error: the mean over its
loss tokens and channels of (v_pred - (eps - x0))^2 in float32 (``flow.per_sample_error``), weighted as the
model's training loss weights it (``diffusion.loss``: 1 for 'v'; t^2 for 'x', the x0-space error of an
x-predicting model, whose velocity error grows as 1/t^2 near the clean end). With
Delta = (e_policy,w - e_ref,w) - (e_policy,l - e_ref,l), a pair's loss is softplus(beta / 2 * Delta)
= -log sigmoid(-beta / 2 * Delta): log 2 when the policy is the reference; below it when the policy lowered
its winner's error relative to the reference more than its loser's.

Rows of a pair batch: winners first, then their losers in the same order (``Batch.pairs`` pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Per-pair statistics a step logs (columns of ``DPOTerms.stats``)
STATS = ("implicit_acc", "delta", "winner_vs_ref", "loser_vs_ref", "beta_delta")


@dataclass
class DPOTerms:
    loss_P: Tensor       # per-pair loss softplus(beta / 2 * delta), float32 (or wider), with gradient
    delta_P: Tensor      # per-pair delta, with gradient
    stats: Tensor        # (P, len(STATS)), detached


def split_pairs(x_B: Tensor) -> tuple[Tensor, Tensor]:
    """(winners, losers) of a per-row tensor of a pair batch."""
    if x_B.shape[0] % 2:
        raise ValueError(f"a pair batch has an even number of rows (winners then losers), got {x_B.shape[0]}")
    P = x_B.shape[0] // 2
    return x_B[:P], x_B[P:]


def dpo_terms(e_policy_B: Tensor, e_ref_B: Tensor, beta: float) -> DPOTerms:
    """The Diffusion-DPO loss of each pair from the per-sample errors of policy and reference (rows: winners then
    losers). The reference's errors carry no gradient."""
    if beta <= 0:
        raise ValueError(f"dpo.beta = {beta}: expected > 0")
    dtype = torch.promote_types(e_policy_B.dtype, torch.float32)       # float32 at least (float64 stays)
    ew, el = split_pairs(e_policy_B.to(dtype))
    rw, rl = split_pairs(e_ref_B.detach().to(dtype))
    delta = (ew - rw) - (el - rl)
    loss = F.softplus(beta / 2 * delta)
    with torch.no_grad():
        d = delta.detach()
        stats = torch.stack([(-beta / 2 * d > 0).float(), d, (ew - rw).detach(), (el - rl).detach(), beta * d], 1)
    return DPOTerms(loss, delta, stats)


def summarize(stats_PS: Tensor) -> dict[str, float]:
    """A step's logged DPO figures from its pairs' statistics (all ranks' pairs): means, and quantiles of
    beta * delta."""
    if stats_PS.numel() == 0:
        return {}
    s = stats_PS.double().cpu()
    out = {name: float(s[:, i].mean()) for i, name in enumerate(STATS[:4])}
    q = torch.quantile(s[:, 4], torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    out.update(beta_delta_p05=q[0], beta_delta_p50=q[1], beta_delta_p95=q[2])
    return out
