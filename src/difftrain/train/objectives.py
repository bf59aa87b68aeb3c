"""Training objectives: flow matching, and Diffusion-DPO on preference pairs. The trainer is given one (the contract
is ``contract.Objective``); it says which batches it needs, the unit its loss is normalised by, one micro-batch's loss
contribution and the names of its metrics. The math lives in ``difftrain.diffusion``; the model call every objective
shares (text encoding, context-parallel sharding, autocast, the FLOP count) is ``contract.Denoiser``.

The numerics contract (DESIGN.md): every random draw is a function of (seed, step, sample id); a
micro-batch's loss is its sum divided by the step's *global* count (``count`` summed over micro-batches
and ranks), so N ranks compute what one rank computes and a replay repeats the same arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from difftrain.data.batch import Batch
from difftrain.diffusion.dpo import dpo_terms, summarize
from difftrain.diffusion.flow import (FlowSpec, draw_t_and_noise, flow_loss, loss_weight, noisy_input, per_sample_error,
                                     to_velocity)
from difftrain.train.contract import Denoiser, MicroLoss, RunHooks

__all__ = ["Denoiser", "DiffusionDPO", "FlowMatching", "MicroLoss"]


class FlowMatching(RunHooks):
    """Rectified flow: x_t = (1 - t) x0 + t eps, the model's output read as a velocity (``diffusion.prediction``),
    the (optionally t-weighted) squared error against v = eps - x0 summed over target tokens, divided by
    the step's global target-token count. With a loss mask (``Batch.keep_BL``) every target token is noised and
    predicted, but only the tokens it keeps count, in the sum and in the count."""

    name = "flow"
    batch_kind = "samples"

    def __init__(self, spec: FlowSpec):
        self.spec = spec

    def count(self, batch: Batch) -> float:
        # target tokens the user's loss mask keeps (each by its weight, where a batch weighs tokens)
        return float(batch.counted_BL.sum()) if batch.weight_BL is None else float(batch.loss_weight_BL.sum())

    def loss(self, model: Denoiser, batch: Batch, seed: int, step: int, normalizer: float | Tensor) -> MicroLoss:
        b = model.on_device(batch)
        _, H, W = b.grid
        t, eps = draw_t_and_noise(self.spec, seed, step, b.sample_ids, tuple(b.x0_BLC.shape[1:]),
                                  (H // 2) * (W // 2), model.device, b.repeats)
        xt = noisy_input(b.x0_BLC, eps, t, b.loss_mask_BL)
        emb = model.embed_text(b)
        out, xt = model(b, xt, t, emb)
        x0, eps = model.local(b.x0_BLC), model.local(eps)
        mask = model.local(b.counted_BL, False) if b.weight_BL is None else model.local(b.loss_weight_BL, 0.0)
        v = to_velocity(out.float(), xt, t, self.spec.prediction)
        loss = flow_loss(v, x0, eps, mask, loss_weight(t, self.spec.loss), normalizer=normalizer)
        return MicroLoss(loss, *model.cost(batch))

    def metrics(self, loss: float, task: str, stats: Tensor | None = None) -> dict[str, float]:
        return {"loss": loss, f"loss_{task}": loss}


class DiffusionDPO(RunHooks):
    """Diffusion-DPO (``difftrain.diffusion.dpo``) on batches of preference pairs. Winner and loser share t and
    eps: both are drawn from the pair's id (``Batch.sample_ids`` holds it for both rows) with the step and seed.
    A step's loss is the sum of its pairs' losses divided by its global pair count (``count``: pairs, summed
    over micro-batches and ranks), so a pair never splits and N ranks compute what one computes. ``reference``
    is a ``Denoiser`` of the frozen reference (a copy of the starting weights, or the policy with its LoRA
    adapters disabled); its forward runs without gradient, before the policy's. ``sft_weight`` adds the
    winners' flow error (the same per-sample mean) to each pair's loss."""

    name = "dpo"
    batch_kind = "pairs"

    def __init__(self, spec: FlowSpec, beta: float, reference, sft_weight: float = 0.0, replay_weight: float = 0.0):
        if beta <= 0:
            raise ValueError(f"dpo.beta = {beta}: expected > 0")
        self.spec, self.beta, self.reference, self.sft_weight = spec, beta, reference, sft_weight
        self.replay_weight = replay_weight

    def count(self, batch: Batch) -> float:
        return float(batch.pairs)

    def errors(self, model, b: Batch, xt: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        """Per-sample flow errors of ``model`` (a ``Denoiser``) on the pair batch's noisy tokens."""
        emb = model.embed_text(b)
        out, _ = model(b, xt, t, emb)
        v = to_velocity(out.float(), xt, t, self.spec.prediction)
        e = per_sample_error(v, b.x0_BLC, eps, b.loss_weight_BL)    # a replay edit's changed tokens by their weight
        w = loss_weight(t, self.spec.loss)
        return e if w is None else e * w

    def loss(self, model: Denoiser, batch: Batch, seed: int, step: int, normalizer: float | Tensor) -> MicroLoss:
        if not batch.pairs or len(batch) != 2 * batch.pairs:
            raise ValueError(f"DiffusionDPO needs a pair batch (winners then losers), got {len(batch)} rows and "
                             f"{batch.pairs} pairs")
        if model.cp > 1:
            raise ValueError("DiffusionDPO compares whole samples' errors: context parallelism is not supported")
        b = model.on_device(batch)
        _, H, W = b.grid
        t, eps = draw_t_and_noise(self.spec, seed, step, b.sample_ids, tuple(b.x0_BLC.shape[1:]),
                                  (H // 2) * (W // 2), model.device)
        xt = noisy_input(b.x0_BLC, eps, t, b.loss_mask_BL)
        with torch.no_grad():
            e_ref = self.errors(self.reference, b, xt, t, eps)
        e = self.errors(model, b, xt, t, eps)
        terms = dpo_terms(e, e_ref, self.beta)
        total = terms.loss_P.sum()
        if self.sft_weight:
            total = total + self.sft_weight * e[:batch.pairs].sum()
        tokens, flops = model.cost(batch)
        flops = flops * 4 / 3                                                     # + the reference's forward
        if self.replay_weight and batch.replay is not None:      # validation batches carry none: their stats only
            total = total + self.replay_weight * self._replay_error(model, b.replay, seed, step) * batch.pairs
            rt, rf = model.cost(batch.replay)                    # from the host copy: no device sync
            tokens, flops = tokens + rt, flops + rf
        return MicroLoss(total / normalizer, tokens, flops, terms.stats)

    def _replay_error(self, model: Denoiser, r: Batch, seed: int, step: int) -> Tensor:
        """The replay samples' mean flow error (each as a winner's in the SFT term; the loss counts it once a pair, a
        micro-batch holding as many of each), their noise and timesteps drawn from their own ids with another seed
        than the pairs'. ``r`` came to the device with the pair batch (one move)."""
        r.x0_BLC = r.x0_BLC.float()             # as ``on_device`` widens the store's bf16 latents
        _, H, W = r.grid
        t, eps = draw_t_and_noise(self.spec, seed + 1, step, r.sample_ids, tuple(r.x0_BLC.shape[1:]),
                                  (H // 2) * (W // 2), model.device, r.repeats)
        return self.errors(model, r, noisy_input(r.x0_BLC, eps, t, r.loss_mask_BL), t, eps).mean()

    def metrics(self, loss: float, task: str, stats: Tensor | None = None) -> dict[str, float]:
        out = {"loss": loss, f"loss_{task}": loss}
        if stats is not None:
            out.update(summarize(stats))
        return out
