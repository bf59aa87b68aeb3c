"""Token packing shared by the data path and the model: latents <-> patch tokens, and the (index, row,
col) position ids of an image's tokens. Neither side owns it: loaders pack, the model and the sampler
unpack."""

from __future__ import annotations

import torch
from torch import Tensor


def patchify(latent_BCHW: Tensor, p: int = 2) -> Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C*p*p), channels ordered (c, ph, pw) as FLUX packs latents."""
    B, C, H, W = latent_BCHW.shape
    if H % p or W % p:
        raise ValueError(f"latent {H}x{W} is not divisible by the patch size {p}")
    x = latent_BCHW.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def unpatchify(tokens_BLC: Tensor, h: int, w: int, p: int = 2) -> Tensor:
    """Inverse of ``patchify`` for a latent of h x w (latent pixels)."""
    B, L, Cpp = tokens_BLC.shape
    if L != (h // p) * (w // p):
        raise ValueError(f"{L} tokens do not tile a {h}x{w} latent with {p}x{p} patches")
    C = Cpp // (p * p)
    x = tokens_BLC.reshape(B, h // p, w // p, C, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, C, h, w)


def image_ids(h_tokens: int, w_tokens: int, index: int = 0, device: torch.device | None = None) -> Tensor:
    """Position ids (h*w, 3) of one image's tokens: (index, row, col), row-major as ``patchify``."""
    rows = torch.arange(h_tokens, device=device).repeat_interleave(w_tokens)
    cols = torch.arange(w_tokens, device=device).repeat(h_tokens)
    return torch.stack((torch.full_like(rows, index), rows, cols), dim=-1)
