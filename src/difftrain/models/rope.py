"""3D rotary position embedding over (index, row, column).

Each of the three position axes owns a contiguous slice of the head dimension
(``axes_dims``, e.g. FLUX's (16, 56, 56)); inside a slice, adjacent channel pairs (2i, 2i+1)
are rotated by ``pos * theta**(-2i/d)``. Text tokens sit at (0, 0, 0), as in FLUX, so they are
not rotated. Position ids are per sample (B, L, 3): a packed batch may mix layouts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(ids_BL3: Tensor, axes_dims: tuple[int, ...] | list[int], theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles, each (B, 1, L, head_dim / 2), float32.

    Angles are computed in float64 where the device has it: at FLUX's resolutions positions reach
    the hundreds and float32 angles lose the low frequencies' precision.
    """
    dtype = torch.float64 if ids_BL3.device.type in ("cpu", "cuda") else torch.float32
    pos = ids_BL3.to(dtype)
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=dtype, device=ids_BL3.device) / dim)
        angles.append(pos[..., axis, None] * inv_freq)
    ang_BLH = torch.cat(angles, dim=-1)
    return ang_BLH.cos().float()[:, None], ang_BLH.sin().float()[:, None]


def apply_rope(x_BHLD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of q or k; computed in float32, returned in x's dtype."""
    x0, x1 = x_BHLD.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x_BHLD)
