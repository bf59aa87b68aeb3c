"""Rectified flow: x_t = (1 - t) x0 + t eps, target v = eps - x0, MSE on loss-masked tokens.

t = 1 is pure noise (FLUX's sigma). Timesteps are drawn uniform or logit-normal(m, s) and may be
shifted toward noise, by a fixed factor or by FLUX's resolution rule (mu from the token count).
The network may predict v directly (FLUX) or the clean sample x (converted to v for the loss):
for small models over high-dimensional patches, x-prediction keeps samples on the data manifold
(Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

T_MIN = 0.05  # floor of t when dividing by it (x-prediction -> v); avoids 1/t blow-up near clean


@dataclass(frozen=True)
class FlowSpec:
    timesteps: str = "logit-normal"   # "uniform" | "logit-normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: str = "none"               # "none" | "fixed" | "resolution"
    shift_value: float = 1.0
    prediction: str = "v"             # "v" | "x"
    loss: str = "v"                   # "v" | "x" | "x/t": the space the MSE is measured in

    @classmethod
    def from_config(cls, d) -> "FlowSpec":
        return cls(d.timesteps, d.logit_mean, d.logit_std, d.shift, d.shift_value, d.prediction, d.loss)


def loss_weight(t_B: Tensor, loss: str) -> Tensor | None:
    """Per-sample weight of the v-MSE: None for 'v'; t^2 for 'x' (|x0_hat - x0|^2 = t^2 |v_hat - v|^2); t for
    'x/t' (the x-MSE over t: between the two, more weight than 'x' on the low-noise steps that clean up details)."""
    if loss == "v":
        return None
    if loss == "x":
        return t_B.float().pow(2)
    if loss == "x/t":
        return t_B.float()
    raise ValueError(f"unknown loss {loss!r}")


def flux_mu(image_tokens: int, lo: tuple[int, float] = (256, 0.5), hi: tuple[int, float] = (4096, 1.15)) -> float:
    """FLUX's mu: linear in the image token count, 0.5 at 256 tokens and 1.15 at 4096."""
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    return lo[1] + slope * (image_tokens - lo[0])


def shift_factor(kind: str, value: float, image_tokens: int) -> float:
    if kind == "none":
        return 1.0
    if kind == "fixed":
        return value
    if kind == "resolution":
        return math.exp(flux_mu(image_tokens))
    raise ValueError(f"unknown shift {kind!r}")


def shift_t(t: Tensor, s: float) -> Tensor:
    """t' = s t / (1 + (s - 1) t): the same as FLUX's e^mu / (e^mu + (1/t - 1)) with s = e^mu."""
    return s * t / (1 + (s - 1) * t) if s != 1.0 else t


def sample_t(n: int, spec: FlowSpec, image_tokens: int, generator: torch.Generator | None = None,
             device: torch.device | str = "cpu") -> Tensor:
    if spec.timesteps == "uniform":
        t = torch.rand(n, generator=generator, device=device)
    elif spec.timesteps == "logit-normal":
        t = torch.sigmoid(spec.logit_mean + spec.logit_std * torch.randn(n, generator=generator, device=device))
    else:
        raise ValueError(f"unknown timestep distribution {spec.timesteps!r}")
    return shift_t(t, shift_factor(spec.shift, spec.shift_value, image_tokens))


def noisy_input(x0_BLC: Tensor, eps_BLC: Tensor, t_B: Tensor, mask_BL: Tensor) -> Tensor:
    """x_t on target tokens; conditioning tokens (mask False) stay clean."""
    t = t_B.view(-1, 1, 1).to(x0_BLC.dtype)
    xt = (1 - t) * x0_BLC + t * eps_BLC
    return torch.where(mask_BL[..., None], xt, x0_BLC)


def to_velocity(out_BLC: Tensor, xt_BLC: Tensor, t_B: Tensor, prediction: str, t_min: float = T_MIN) -> Tensor:
    """The network output as a velocity v = eps - x0. Training floors t at ``T_MIN`` (bounded loss
    weight); sampling passes a tiny floor so the last Euler step lands on the predicted x."""
    if prediction == "v":
        return out_BLC
    if prediction == "x":
        return (xt_BLC - out_BLC) / t_B.clamp(min=t_min).view(-1, 1, 1).to(out_BLC.dtype)
    raise ValueError(f"unknown prediction {prediction!r}")


def per_sample_error(v_pred_BLC: Tensor, x0_BLC: Tensor, eps_BLC: Tensor, mask_BL: Tensor) -> Tensor:
    """Mean over target tokens and channels of (v_pred - (eps - x0))^2, per sample, in float32.
    (Diffusion-DPO compares these per-sample errors between policy and reference.)"""
    err = (v_pred_BLC.float() - (eps_BLC.float() - x0_BLC.float())).pow(2).mean(-1)
    m = mask_BL.float()
    return (err * m).sum(1) / m.sum(1).clamp(min=1.0)


def flow_loss(v_pred_BLC: Tensor, x0_BLC: Tensor, eps_BLC: Tensor, mask_BL: Tensor,
              weight_B: Tensor | None = None, normalizer: float | Tensor | None = None) -> Tensor:
    """Scalar loss: the sum over every target token of the batch (so a sample with more target tokens,
    e.g. more keyframes, weighs more, as in a packed sequence), optionally weighted per sample, divided by
    ``normalizer``: by default this batch's target-token count (a mean); in training, the *global* count of
    the step over all ranks and micro-batches, so that splitting a global batch does not change its loss."""
    err = (v_pred_BLC.float() - (eps_BLC.float() - x0_BLC.float())).pow(2).mean(-1)
    if weight_B is not None:
        err = err * weight_B[:, None]
    m = mask_BL.float()
    denom = m.sum().clamp(min=1.0) if normalizer is None else normalizer
    return (err * m).sum() / denom


def sample_generator(seed: int, step: int, sample_id: int, device: torch.device | str = "cpu",
                     repeat: int = 0) -> torch.Generator:
    """The generator of one training sample's draws: a function of (seed, step, global sample index) only,
    never of a rank's state, so a global batch draws the same numbers however it is split over ranks. ``repeat``
    (> 0: the id's n-th repeat in its global batch) keys a draw of its own, so two slots of one id never share
    noise and timestep."""
    key = [seed, step, sample_id] + ([repeat] if repeat else [])
    state = np.random.SeedSequence(key).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def draw_t_and_noise(spec: FlowSpec, seed: int, step: int, sample_ids: list[int], shape_LC: tuple[int, int],
                     image_tokens: int, device: torch.device | str = "cpu",
                     repeats: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Per-sample timesteps (B,) and noise (B, L, C), each sample from its own ``sample_generator``."""
    ts, eps = [], []
    for j, sid in enumerate(sample_ids):
        gen = sample_generator(seed, step, sid, device, repeats[j] if repeats else 0)
        ts.append(sample_t(1, spec, image_tokens, gen, device))
        eps.append(torch.randn(shape_LC, generator=gen, device=device))
    return torch.cat(ts), torch.stack(eps)
