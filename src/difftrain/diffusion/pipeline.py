"""The model-bound side of diffusion: text embedding, the velocity of a batch's tokens, sampling with
CFG and decoding to pixels. Used by training (sample grids), ``sample`` and ``eval``."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import Tensor, nn

from difftrain.data.batch import Batch, assemble, frames_of
from difftrain.diffusion.flow import FlowSpec, shift_factor, to_velocity
from difftrain.diffusion.sampler import euler_sample, guided
from difftrain.models.autoencoder import Autoencoder
from difftrain.models.text import TextEmbedding, batch_tokens


def autocast(device: torch.device, dtype: torch.dtype | None):
    """bf16 autocast when asked for; a no-op context in float32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on devices with fast bf16 (CUDA); 'auto' stays fp32 on CPUs, where bf16 is emulated."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None


class Pipeline:
    def __init__(self, model: nn.ModuleDict, text_encoder: nn.Module, autoencoder: Autoencoder, flow: FlowSpec,
                 device: torch.device | str = "cpu", amp_dtype: torch.dtype | None = None,
                 guidance: float | None = None, sample_shift: tuple[str, float] = ("train", 1.0)):
        self.model, self.text_encoder, self.autoencoder, self.flow = model, text_encoder, autoencoder, flow
        self.device, self.amp_dtype = torch.device(device), amp_dtype
        self.guidance = guidance   # for guidance-embedding models (FLUX.1-dev), the embedded scale
        self.sample_shift = sample_shift   # (sample.shift, sample.shift_value); 'train' = the training shift

    @property
    def dit(self) -> nn.Module:
        return self.model["dit"]

    def embed(self, tokens: dict[str, Tensor]) -> TextEmbedding:
        tokens = {k: v.to(self.device) for k, v in tokens.items()}
        with autocast(self.device, self.amp_dtype):
            return self.text_encoder(tokens)

    def velocity(self, x_BLC: Tensor, ids_BL3: Tensor, t_B: Tensor, emb: TextEmbedding) -> Tensor:
        g = None
        if self.dit.params.guidance_embed:
            g = torch.full_like(t_B, self.guidance if self.guidance is not None else 1.0)
        with autocast(self.device, self.amp_dtype):
            # text.padding (the encoder's rule, as in training): 'masked' masks the padding out of attention
            mask = emb.mask_BT if getattr(self.text_encoder, "padding", "masked") == "masked" else None
            out = self.dit(x_BLC, ids_BL3, emb.txt_BTD, t_B, emb.pooled_BP, g, txt_mask_BT=mask)
        return to_velocity(out.float(), x_BLC.float(), t_B, self.flow.prediction, t_min=1e-6)

    @torch.no_grad()
    def blank_batch(self, prompts: list[str], h: int, w: int, frames: int = 1, task: str | None = None) -> Batch:
        """A batch to generate ``frames`` frames of h x w pixels per prompt, nothing given (``task``: by
        default text-to-image for one frame, else keyframes)."""
        ae, B = self.autoencoder, len(prompts)
        lat = torch.zeros(B, frames, ae.latent_channels, h // ae.factor, w // ae.factor, device=self.device)
        return assemble(lat, list(range(frames)), torch.ones(B, frames, dtype=torch.bool),
                        self.text_encoder.tokenize(prompts), prompts, task or ("keyframes" if frames > 1 else "t2i"))

    def sample(self, batch: Batch, steps: int = 20, cfg_scale: float = 4.0, shift: float | None = None,
               seed: int = 0, rows: slice | None = None, noise: Tensor | None = None, on_step=None) -> Tensor:
        """Generate the target frames of ``batch`` (its conditioning frames are kept); latents (B, F, C, H, W).
        ``rows``: generate only those examples, with the noise they get when the whole batch is generated.
        ``noise``: the initial noise of every example instead (B, L, C), e.g. each drawn from its own seed.
        ``on_step(i)``: called before step i (it may raise to stop the sampling)."""
        batch = batch.to(self.device)
        if noise is not None:
            if tuple(noise.shape) != tuple(batch.x0_BLC.shape):
                raise ValueError(f"noise {tuple(noise.shape)} for a batch of {tuple(batch.x0_BLC.shape)}")
            noise = noise.to(self.device, torch.float32)
            if rows is not None:
                noise, batch = noise[rows], batch.rows(rows)
        elif rows is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            noise = torch.randn(batch.x0_BLC.shape, generator=gen, device=self.device, dtype=torch.float32)[rows]
            batch = batch.rows(rows)
        B = len(batch)
        _, H, W = batch.grid
        if shift is None:
            kind, value = self.sample_shift
            if kind == "train":
                kind, value = self.flow.shift, self.flow.shift_value
            shift = shift_factor(kind, value, (H // 2) * (W // 2))
        if cfg_scale != 1.0:
            empty = self.text_encoder.tokenize([""] * B)
            both = self.embed(batch_tokens({k: v.cpu() for k, v in batch.tokens.items()}, empty))
            ids2 = batch.ids_BL3.repeat(2, 1, 1)

            def v_cu(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
                v = self.velocity(x.repeat(2, 1, 1), ids2, t.repeat(2), both)
                return v[:B], v[B:]

            vel = guided(v_cu, cfg_scale)
        else:
            cond = self.embed(batch.tokens)

            def vel(x: Tensor, t: Tensor) -> Tensor:
                return self.velocity(x, batch.ids_BL3, t, cond)

        if on_step is not None:
            inner, calls = vel, [0]

            def vel(x: Tensor, t: Tensor) -> Tensor:     # noqa: F811 -- the same field, with the step callback
                on_step(calls[0])
                calls[0] += 1
                return inner(x, t)

        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = euler_sample(vel, batch.x0_BLC, batch.loss_mask_BL, steps, shift, gen, noise)
        return frames_of(x, batch.grid)

    @torch.no_grad()
    def to_images(self, latents_BFCHW: Tensor) -> np.ndarray:
        """Latents -> uint8 images (B, F, H, W, 3)."""
        B, F = latents_BFCHW.shape[:2]
        px = self.autoencoder.decode(latents_BFCHW.flatten(0, 1).float()).cpu()
        img = ((px.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
        return img.reshape(B, F, *img.shape[1:]).numpy()
