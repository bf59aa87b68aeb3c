"""Autoencoders behind one small interface: ``encode(images) -> latents``, ``decode(latents) -> images``,
``latent_channels``, ``factor`` (spatial), ``scaling`` and ``shift``.

Images are float tensors (B, 3, H, W) in [-1, 1]; latents are already normalised,
latent = (z - shift) * scaling, so the diffusion model sees roughly unit-variance inputs.
- ``PixelUnshuffleAE``: exact and weightless (space-to-depth); the shapes world trains in it.
- ``DiffusersAE``: diffusers ``AutoencoderKL`` from a local path (FLUX VAE layout: 16 channels, x8,
  scaling 0.3611, shift 0.1159), frozen.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.errors import UserError


class Autoencoder(nn.Module):
    latent_channels: int
    factor: int
    scaling: float = 1.0
    shift: float = 0.0

    def encode(self, images_B3HW: Tensor) -> Tensor:
        raise NotImplementedError

    def decode(self, latents_BCHW: Tensor) -> Tensor:
        raise NotImplementedError


class PixelUnshuffleAE(Autoencoder):
    """Space-to-depth by ``factor``: exact, so any error in samples is the diffusion model's own."""

    def __init__(self, factor: int = 4, channels: int = 3):
        super().__init__()
        self.factor, self.latent_channels = factor, channels * factor * factor

    def encode(self, images_B3HW: Tensor) -> Tensor:
        return F.pixel_unshuffle(images_B3HW, self.factor)

    def decode(self, latents_BCHW: Tensor) -> Tensor:
        return F.pixel_shuffle(latents_BCHW, self.factor)


class DiffusersAE(Autoencoder):
    """diffusers ``AutoencoderKL`` (frozen). Scaling/shift default to the model's own config."""

    def __init__(self, vae: nn.Module, scaling: float = 0.0, shift: float | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False).to(dtype)
        cfg = vae.config
        self.latent_channels = int(cfg.latent_channels)
        self.factor = 2 ** (len(cfg.block_out_channels) - 1)
        self.scaling = float(scaling or getattr(cfg, "scaling_factor", 1.0) or 1.0)
        cfg_shift = getattr(cfg, "shift_factor", None)
        self.shift = float(shift if shift is not None else (cfg_shift or 0.0))
        self.dtype = dtype

    @classmethod
    def from_path(cls, path: str, scaling: float = 0.0, shift: float | None = None,
                  dtype: torch.dtype = torch.float32) -> "DiffusersAE":
        from diffusers import AutoencoderKL

        p = Path(path)
        sub = p / "vae" if (p / "vae" / "config.json").is_file() else p
        if not (sub / "config.json").is_file():
            raise UserError(f"autoencoder.path = {path!r}: no diffusers AutoencoderKL there "
                            "(expected config.json and weights, or a pipeline folder with vae/)")
        try:
            vae = AutoencoderKL.from_pretrained(sub, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"autoencoder.path = {path!r}: cannot load AutoencoderKL ({e})") from None
        return cls(vae, scaling, shift, dtype)

    @torch.no_grad()
    def encode(self, images_B3HW: Tensor) -> Tensor:
        # The posterior mean, not a sample: latents are cached once and reused every epoch.
        z = self.vae.encode(images_B3HW.to(self.dtype)).latent_dist.mode()
        return ((z - self.shift) * self.scaling).float()

    @torch.no_grad()
    def decode(self, latents_BCHW: Tensor) -> Tensor:
        z = latents_BCHW.to(self.dtype) / self.scaling + self.shift
        return self.vae.decode(z).sample.float().clamp(-1, 1)


def build_autoencoder(kind: str, factor: int = 4, path: str = "", scaling: float = 0.0,
                      shift: float = 0.0) -> Autoencoder:
    if kind == "pixel-unshuffle":
        return PixelUnshuffleAE(factor)
    if kind == "diffusers":
        return DiffusersAE.from_path(path, scaling, shift or None)
    raise UserError(f"autoencoder.kind = {kind!r}: expected 'pixel-unshuffle' or 'diffusers'")
