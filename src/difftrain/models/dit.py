"""The FLUX-style MMDiT: double-stream blocks, then single-stream blocks, adaLN from (t, pooled text,
guidance), RMS QK-norm, 3D RoPE, and latents packed in 2x2 patches (difftrain.tokens).

The model is single-device and task-agnostic: it sees a token sequence with position ids and a
per-sample timestep. Text-to-image, editing and keyframes differ only in how ``data.batch``
assembles that sequence. Distribution (FSDP, compile) is applied from outside (``parallel``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from difftrain.models.layers import (DoubleStreamBlock, LastLayer, MLPEmbedder, Modulation, PositionEmbedder, QKNorm,
                                     SingleStreamBlock, timestep_embedding)
from difftrain.models.rope import rope_angles


@dataclass(frozen=True)
class DiTParams:
    in_channels: int = 64          # latent channels x 4 (2x2 patches)
    text_dim: int = 4096           # T5-XXL width for FLUX
    pooled_dim: int = 768          # CLIP-L pooled width for FLUX
    hidden: int = 3072
    heads: int = 24
    double_blocks: int = 19
    single_blocks: int = 38
    mlp_ratio: float = 4.0
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    rope_theta: float = 10000.0
    guidance_embed: bool = False
    qkv_bias: bool = True
    abs_pos_embed: bool = False    # not in FLUX: learned absolute positions of image tokens (PositionEmbedder)
    positions: str = "corner"      # image ids from the top left (FLUX) or from the image centre ('centre')

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if sum(self.axes_dims_rope) != self.hidden // self.heads:
            raise ValueError(f"axes_dims_rope {tuple(self.axes_dims_rope)} must sum to the head dim "
                             f"{self.hidden // self.heads}")
        if self.positions not in ("corner", "centre"):
            raise ValueError(f"positions must be 'corner' or 'centre', got {self.positions!r}")
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {tuple(self.axes_dims_rope)} must be even")
        for name in ("in_channels", "text_dim", "pooled_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class MMDiT(nn.Module):
    def __init__(self, p: DiTParams):
        super().__init__()
        self.params = p
        self.img_in = nn.Linear(p.in_channels, p.hidden)
        self.txt_in = nn.Linear(p.text_dim, p.hidden)
        self.time_in = MLPEmbedder(256, p.hidden)
        self.vector_in = MLPEmbedder(p.pooled_dim, p.hidden)
        self.guidance_in = MLPEmbedder(256, p.hidden) if p.guidance_embed else None
        self.pos_in = PositionEmbedder(p.hidden) if p.abs_pos_embed else None
        # With no single block after it, the last double block's text rows are keys and values only: it is built
        # without text output weights (``context_pre_only``), so every parameter gets a gradient and optimizer state
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(p.hidden, p.heads, p.mlp_ratio, p.qkv_bias,
                              context_pre_only=p.single_blocks == 0 and i == p.double_blocks - 1)
            for i in range(p.double_blocks))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(p.hidden, p.heads, p.mlp_ratio) for _ in range(p.single_blocks))
        self.final_layer = LastLayer(p.hidden, p.in_channels)

    def forward(self, img_BLC: Tensor, img_ids_BL3: Tensor, txt_BTD: Tensor, t_B: Tensor, pooled_BP: Tensor,
                guidance_B: Tensor | None = None, txt_ids_BT3: Tensor | None = None,
                txt_mask_BT: Tensor | None = None, img_mask_BL: Tensor | None = None,
                img_extent_B2: Tensor | None = None) -> Tensor:
        """Predict (B, L, C) for every image token; the caller decides which tokens the loss sees.
        ``txt_mask_BT`` / ``img_mask_BL`` (True = real) mask padding out of attention as keys.
        ``img_extent_B2``: (rows, cols) of each sample's token grid, for 'centre' positions when the sequence is
        only part of the image (context parallelism); by default read from the ids."""
        B, T = txt_BTD.shape[:2]
        if self.params.positions == "centre":
            img_ids_BL3 = centred_ids(img_ids_BL3, img_extent_B2)
        img, txt = self.img_in(img_BLC), self.txt_in(txt_BTD)
        if self.pos_in is not None:
            img = img + self.pos_in(img_ids_BL3)
        vec = self.time_in(timestep_embedding(t_B).to(img.dtype)) + self.vector_in(pooled_BP)
        if self.guidance_in is not None:
            if guidance_B is None:
                raise ValueError("this model embeds a guidance scale: pass guidance_B")
            vec = vec + self.guidance_in(timestep_embedding(guidance_B).to(img.dtype))
        if txt_ids_BT3 is None:
            txt_ids_BT3 = torch.zeros(B, T, 3, dtype=img_ids_BL3.dtype, device=img_ids_BL3.device)
        rope = rope_angles(torch.cat((txt_ids_BT3, img_ids_BL3), 1), self.params.axes_dims_rope,
                           self.params.rope_theta)
        mask = None
        if txt_mask_BT is not None or img_mask_BL is not None:
            # Built on the device whatever its values: no host sync to find out whether anything is masked.
            keep_t = txt_mask_BT if txt_mask_BT is not None else torch.ones(B, T, device=img.device)
            keep_i = img_mask_BL if img_mask_BL is not None else torch.ones(B, img.shape[1], device=img.device)
            mask = torch.cat((keep_t.bool(), keep_i.bool()), 1)[:, None, None, :]
        # Only the image tokens of the last block are read: its text rows' MLP and projections are skipped.
        n_single = len(self.single_blocks)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, rope, mask)
        x = torch.cat((txt, img), 1) if n_single else img
        for i, block in enumerate(self.single_blocks):
            x = block(x, vec, rope, mask, keep_from=T if i == n_single - 1 else 0)
        return self.final_layer(x, vec)

    @torch.no_grad()
    def init_weights(self, scheme: str = "zero-out", seed: int = 0, write: WriteFn | None = None,
                     only: Callable[[str], bool] | None = None) -> None:
        """Xavier linears with zero bias, N(0, 0.02) embedder MLPs, unit QK-norm scales; 'zero-out' also
        zeroes every modulation and the output head, so each block starts as the identity (adaLN-zero).

        The scheme is chosen by module type; the random values of each parameter come from a generator
        seeded by (seed, parameter name), drawn at the parameter's full shape. So the initial model is the
        same for any world size or sharding: ``write(param, full_value)`` puts the value (or the part of it
        a rank holds) into the parameter; by default it copies the whole tensor. ``only``: initialise just the
        parameters it accepts (the adapters, when the base is read from pretrained weights)."""
        write = write or _copy_into
        rules: dict[str, Init] = {}
        for mod_name, mod in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(mod, nn.Linear):
                rules[prefix + "weight"] = "xavier"
                if mod.bias is not None:
                    rules[prefix + "bias"] = "zeros"
            elif isinstance(mod, QKNorm):
                rules[prefix + "query_norm"] = rules[prefix + "key_norm"] = "ones"
        for emb in ("time_in", "vector_in", "guidance_in"):
            for layer in ("in_layer", "out_layer"):
                if f"{emb}.{layer}.weight" in rules:
                    rules[f"{emb}.{layer}.weight"] = "normal"
        if scheme == "zero-out":
            for mod_name, mod in self.named_modules():
                if isinstance(mod, Modulation):
                    rules[f"{mod_name}.lin.weight"] = rules[f"{mod_name}.lin.bias"] = "zeros"
            for name in ("final_layer.adaLN_modulation.1", "final_layer.linear"):
                rules[f"{name}.weight"] = rules[f"{name}.bias"] = "zeros"
        from difftrain.models.lora import init_rule, is_adapter
        for name, param in self.named_parameters():
            if is_adapter(name):        # peft's adapters: the factor it zeroes at zero, the others kaiming-uniform
                rules[name] = init_rule(name)
            if name not in rules:
                raise TypeError(f"no initialisation rule for parameter {name!r}")  # a new module type: add a rule
            if only is not None and not only(name):
                continue
            write(param, _init_value(rules[name], param, _generator(seed, name, param.device)))


def centred_ids(ids_BL3: Tensor, extent_B2: Tensor | None = None) -> Tensor:
    """(index, row, col) ids with row and col counted from the centre of each sample's token grid (float):
    a 3x3 grid's -1, 0, 1; a 3x5 grid's columns -2 .. 2, whose middle three are the 3x3 grid's. ``extent_B2``:
    (rows, cols) per sample, else the largest ids + 1. Device ops only (no host sync)."""
    pos = ids_BL3.float()
    extent = ids_BL3[..., 1:].amax(dim=1).float() + 1 if extent_B2 is None else extent_B2.float()
    return torch.cat((pos[..., :1], pos[..., 1:] - (extent[:, None, :] - 1) / 2), dim=-1)


Init = str   # "xavier" | "normal" | "kaiming" | "zeros" | "ones"
WriteFn = Callable[[nn.Parameter, Tensor], None]


def _copy_into(param: nn.Parameter, value: Tensor) -> None:
    param.copy_(value)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _init_value(rule: Init, param: Tensor, gen: torch.Generator) -> Tensor:
    value = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    if rule == "xavier":
        nn.init.xavier_uniform_(value, generator=gen)
    elif rule == "normal":
        nn.init.normal_(value, std=0.02, generator=gen)
    elif rule == "kaiming":     # peft's kaiming_uniform_(a = sqrt 5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
    elif rule == "zeros":
        nn.init.zeros_(value)
    elif rule == "ones":
        nn.init.ones_(value)
    else:
        raise ValueError(f"unknown init rule {rule!r}")
    return value.to(param.dtype)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
