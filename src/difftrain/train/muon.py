"""Muon for a transformer's hidden matrices, AdamW for every other parameter, in one optimizer.

Muon (momentum orthogonalised by a Newton-Schulz iteration) updates each hidden 2-D weight by an approximately
orthogonal matrix: every direction of the momentum moves at the same rate, where AdamW's per-element scaling lets a
few directions dominate. Embeddings, the output layer, norms and biases keep AdamW, as the method prescribes.

One ``torch.optim.Optimizer`` holds both kinds of group (``group["muon"]``), so the trainer's LR schedule, gradient
clipping, checkpoints (DCP's flattened optimizer state: ``momentum_buffer`` for a Muon parameter, ``exp_avg`` /
``exp_avg_sq`` / ``step`` for an AdamW one) and resumption treat it like AdamW.

The update's scale follows Moonlight ("Muon is scalable for LLM training"): the orthogonalised matrix times
``0.2 * sqrt(max(rows, cols))``, the RMS of an AdamW update, so that Muon and AdamW groups share one learning rate
and one schedule. The iteration runs in float32 on a CPU (this kind of CPU multiplies bfloat16 matrices five times
slower than float32 ones) and in bfloat16 on an accelerator.

A sharded (DTensor) matrix is gathered whole for the iteration on every rank and each rank keeps its own shard of
the result: the same update as on one device, for an all-gather of the matrix's momentum a step. Every rank runs the iteration
on every matrix (at 24B about 2 PFLOP a step, a few seconds of an H100); spreading the matrices over the ranks, as
distributed Muon implementations do, is not done. ``difftrain plan`` plans a Muon run as AdamW and says by how much
that overstates the state and what the gather adds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

# the quintic iteration's coefficients (K. Jordan, "Muon: an optimizer for hidden layers in neural networks", 2024)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> Tensor:
    """An approximately orthogonal matrix with ``g``'s singular vectors (singular values near 1, within about
    0.5–1.5 after 5 steps), by the quintic Newton-Schulz iteration; returned in ``g``'s dtype."""
    if g.ndim != 2:
        raise ValueError(f"orthogonalize: expected a 2-D matrix, got shape {tuple(g.shape)}")
    if dtype is None:
        dtype = torch.float32 if g.device.type == "cpu" else torch.bfloat16
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)             # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.T).to(g.dtype)


def is_hidden_matrix(name: str, p: Tensor) -> bool:
    """A 2-D weight inside a transformer block (attention, MLP, modulation), the parameters Muon is for; the
    input and output projections, embeddings, norms and biases are not."""
    return p.ndim == 2 and ("double_blocks." in name or "single_blocks." in name) and "lora" not in name


class MuonAdamW(torch.optim.Optimizer):
    """Muon for groups with ``muon=True``, AdamW for the others; hyper-parameters per group as torch's optimizers'
    (``lr``, ``weight_decay``; ``momentum``, ``nesterov``, ``ns_steps`` for Muon; ``betas``, ``eps`` for AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 1 <= ns_steps <= 20:
            raise ValueError(f"ns_steps must be in [1, 20], got {ns_steps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, muon=False))
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.ndim != 2:
                        raise ValueError(f"a Muon group holds a parameter of shape {tuple(p.shape)}: Muon updates "
                                         "2-D matrices only (put the others in an AdamW group)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            update = g.lerp(buf, mu) if group["nesterov"] else buf
            o = _orthogonalize_sharded(update, group["ns_steps"])
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, group: dict) -> None:
        # fused (one vectorised kernel a tensor) where every parameter is a plain tensor, as the trainer's AdamW
        live = [p for p in group["params"] if p.grad is not None]
        fused = all(type(p) is Tensor and p.device.type in ("cpu", "cuda") for p in live)
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in live:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        adamw(params, grads, avgs, sqs, [], steps, foreach=not fused, fused=fused or None, amsgrad=False,
              beta1=group["betas"][0], beta2=group["betas"][1], lr=float(group["lr"]),
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def _orthogonalize_sharded(update: Tensor, steps: int) -> Tensor:
    """``orthogonalize`` of a plain tensor, or of a DTensor gathered whole and redistributed as it was sharded."""
    if isinstance(update, DTensor):
        whole = orthogonalize(update.full_tensor(), steps)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return orthogonalize(update, steps)
