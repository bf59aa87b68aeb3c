"""Building blocks of the MMDiT: embedders, modulation, QK-norm, double- and single-stream blocks.

Parameter names follow FLUX's reference layout (``img_attn.qkv``, ``linear1``, ...): projections
that the diffusers port keeps apart (to_q/to_k/to_v, proj_mlp) are fused here into one matmul,
which is faster and is what the state-dict adapter (``flux_adapter.py``) concatenates into.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from difftrain.models.attention import Attention


def timestep_embedding(t_B: Tensor, dim: int = 256, max_period: float = 10000.0, time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000, as FLUX): [cos, sin] halves, float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    args = (t_B.float() * time_factor)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def position_features(ids_BL3: Tensor, freqs: int = 8, slowest: float = 0.01) -> Tensor:
    """sin/cos of each (index, row, col) id at ``freqs`` frequencies from 1 to ``slowest`` rad per token:
    (B, L, 6 * freqs). The fastest frequencies tell neighbouring tokens apart even on a 3x3 grid."""
    omega = slowest ** (torch.arange(freqs, dtype=torch.float32, device=ids_BL3.device) / max(1, freqs - 1))
    ang = ids_BL3.float()[..., None] * omega                       # (B, L, 3, F)
    return torch.cat((ang.sin(), ang.cos()), dim=-1).flatten(-2)


class PositionEmbedder(nn.Module):
    """Absolute positions of image tokens: a learned projection of fixed sin/cos features of the ids.
    Not in FLUX, which locates tokens only through RoPE against the text tokens at the origin, a
    relation a small model trained for minutes does not learn. Resolution-free (no table to outgrow)."""

    def __init__(self, hidden: int, freqs: int = 8):
        super().__init__()
        self.freqs = freqs
        self.proj = nn.Linear(6 * freqs, hidden)

    def forward(self, ids_BL3: Tensor) -> Tensor:
        return self.proj(position_features(ids_BL3, self.freqs))


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear: embeds timesteps, guidance and the pooled text vector."""

    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    """RMS norm of queries and keys over the head dim, with learned scales (computed in float32)."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.query_norm = nn.Parameter(torch.ones(head_dim))
        self.key_norm = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        def norm(x: Tensor, w: Tensor) -> Tensor:
            return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(x.dtype)

        return norm(q, self.query_norm), norm(k, self.key_norm)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.query_norm)
        nn.init.ones_(self.key_norm)


def _layer_norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return _layer_norm(x) * (1 + scale[:, None]) + shift[:, None]


def _split_heads(qkv_BLx: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B, L, 3*H*D) -> q, k, v each (B, H, L, D)."""
    B, L, _ = qkv_BLx.shape
    q, k, v = qkv_BLx.view(B, L, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


class ModulationOut(NamedTuple):
    """One adaLN modulation: ``modulate`` a sub-layer's input, ``gate`` its output into the residual."""
    shift: Tensor      # (B, dim)
    scale: Tensor
    gate: Tensor

    def modulate(self, x_BLD: Tensor) -> Tensor:
        return _modulate(x_BLD, self.shift, self.scale)

    def gated(self, residual_BLD: Tensor, out_BLD: Tensor) -> Tensor:
        return residual_BLD + self.gate[:, None] * out_BLD


class Modulation(nn.Module):
    """adaLN: vec -> n modulations (attention's, then the MLP's in a double block)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, 3 * n * dim)

    def forward(self, vec_BD: Tensor) -> tuple[ModulationOut, ...]:
        chunks = self.lin(F.silu(vec_BD)).chunk(3 * self.n, dim=-1)
        return tuple(ModulationOut(*chunks[3 * i:3 * i + 3]) for i in range(self.n))


class SelfAttentionParams(nn.Module):
    """Fused qkv projection, QK-norm and output projection (none for keys and values only) of one stream of a double
    block."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool, out_proj: bool = True):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.norm = QKNorm(dim // heads)
        self.proj = nn.Linear(dim, dim) if out_proj else None

    def qkv_heads(self, x_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = _split_heads(self.qkv(x_BLD), self.heads)
        q, k = self.norm(q, k)
        return q, k, v


def _mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))


class DoubleStreamBlock(nn.Module):
    """Text and image keep their own weights; they meet in one joint attention (MMDiT)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, qkv_bias: bool = True, context_pre_only: bool = False):
        """``context_pre_only`` (the last block when no single block follows, as SD3's last joint block): the text
        stream gives keys and values only, so the block has no text output projection and no text MLP at all.
        Its text modulation keeps the full width (a checkpoint written before this layout resumes into it); the
        rows that would modulate the text output get no gradient."""
        super().__init__()
        mlp_hidden = int(dim * mlp_ratio)
        self.context_pre_only = context_pre_only
        self.img_mod, self.txt_mod = Modulation(dim, 2), Modulation(dim, 2)
        self.img_attn = SelfAttentionParams(dim, heads, qkv_bias, out_proj=True)
        self.txt_attn = SelfAttentionParams(dim, heads, qkv_bias, out_proj=not context_pre_only)
        self.img_mlp = _mlp(dim, mlp_hidden)
        self.txt_mlp = None if context_pre_only else _mlp(dim, mlp_hidden)
        self.attention = Attention()

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, rope: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A ``context_pre_only`` block returns ``txt`` as given: its text rows are keys and values only."""
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        iq, ik, iv = self.img_attn.qkv_heads(img_mod1.modulate(img))
        tq, tk, tv = self.txt_attn.qkv_heads(txt_mod1.modulate(txt))
        # Joint attention over [text; image], the order of the position ids.
        attn = self.attention(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2), rope, mask)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
        img = img_mod1.gated(img, self.img_attn.proj(img_attn))
        img = img_mod2.gated(img, self.img_mlp(img_mod2.modulate(img)))
        if self.context_pre_only:
            return img, txt
        txt = txt_mod1.gated(txt, self.txt_attn.proj(txt_attn))
        txt = txt_mod2.gated(txt, self.txt_mlp(txt_mod2.modulate(txt)))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over [text; image]: attention and MLP in parallel from one fused input projection."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.mlp_hidden = int(dim * mlp_ratio)
        self.linear1 = nn.Linear(dim, 3 * dim + self.mlp_hidden)
        self.linear2 = nn.Linear(dim + self.mlp_hidden, dim)
        self.norm = QKNorm(dim // heads)
        self.modulation = Modulation(dim, 1)
        self.attention = Attention()

    def forward(self, x: Tensor, vec: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None = None,
                keep_from: int = 0) -> Tensor:
        """The block over every row of ``x``; ``keep_from = T`` (the last block): only rows T onward (the image) are
        returned, and the MLP and output projection run on those rows alone (every row is still a key and value)."""
        (mod,) = self.modulation(vec)
        qkv, mlp = self.linear1(mod.modulate(x)).split([3 * self.dim, self.mlp_hidden], dim=-1)
        q, k, v = _split_heads(qkv, self.heads)
        q, k = self.norm(q, k)
        attn = self.attention(q, k, v, rope, mask)
        if keep_from:
            x, attn, mlp = x[:, keep_from:], attn[:, keep_from:], mlp[:, keep_from:]
        out = self.linear2(torch.cat((attn, F.gelu(mlp, approximate="tanh")), dim=-1))
        return mod.gated(x, out)


class LastLayer(nn.Module):
    """adaLN (shift, scale) then a linear map to patch channels."""

    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(_modulate(x, shift, scale))
