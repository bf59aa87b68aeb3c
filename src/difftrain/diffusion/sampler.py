"""Euler sampling of the rectified-flow ODE from t = 1 (noise) to t = 0, with classifier-free guidance
and the same timestep shift as training. Deterministic given the generator's seed."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from difftrain.diffusion.flow import shift_t

VelocityFn = Callable[[Tensor, Tensor], Tensor]   # (x_BLC, t_B) -> v_BLC


def schedule(steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> Tensor:
    """steps + 1 times from 1 to 0, shifted toward noise by ``shift``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return shift_t(torch.linspace(1.0, 0.0, steps + 1, device=device, dtype=torch.float64), shift).float()


@torch.no_grad()
def euler_sample(velocity: VelocityFn, x_cond_BLC: Tensor, mask_BL: Tensor, steps: int, shift: float = 1.0,
                 generator: torch.Generator | None = None, noise: Tensor | None = None) -> Tensor:
    """Integrate target tokens (mask True) from noise (``noise``, else drawn from ``generator``); conditioning
    tokens stay as given."""
    if noise is None:
        noise = torch.randn(x_cond_BLC.shape, generator=generator, device=x_cond_BLC.device, dtype=torch.float32)
    m = mask_BL[..., None]
    x = torch.where(m, noise, x_cond_BLC.float())
    ts = schedule(steps, shift, x.device)
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = velocity(x, t.expand(x.shape[0])).float()
        x = torch.where(m, x + (t_next - t) * v, x)
    return x


def guided(velocity_cu: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], scale: float) -> VelocityFn:
    """Classifier-free guidance: v = v_u + scale (v_c - v_u); scale 1 is the conditional model alone."""
    def v(x: Tensor, t: Tensor) -> Tensor:
        v_c, v_u = velocity_cu(x, t)
        return v_u + scale * (v_c - v_u)
    return v
