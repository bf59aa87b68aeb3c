"""State-dict adapter between diffusers' ``FluxTransformer2DModel`` and ``MMDiT``.

diffusers keeps q, k, v (and the single block's MLP input) as separate Linears and orders the
final adaLN output as (scale, shift); our layout fuses the projections and uses (shift, scale),
as FLUX's reference code. The mapping is a pure re-arrangement, so ``to_diffusers(from_diffusers(sd))``
returns the same tensors bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from difftrain.config.base import model_keys_from_diffusers_config
from difftrain.models.dit import DiTParams

# (ours, diffusers) for one-to-one renames; "{i}" is the block index.
_TOP = [
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("final_layer.linear", "proj_out"),
]
_GUIDANCE = [
    ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
]
_DOUBLE = [
    ("img_mod.lin", "norm1.linear"),
    ("txt_mod.lin", "norm1_context.linear"),
    ("img_attn.proj", "attn.to_out.0"),
    ("txt_attn.proj", "attn.to_add_out"),
    ("img_mlp.0", "ff.net.0.proj"),
    ("img_mlp.2", "ff.net.2"),
    ("txt_mlp.0", "ff_context.net.0.proj"),
    ("txt_mlp.2", "ff_context.net.2"),
]
_DOUBLE_NORMS = [
    ("img_attn.norm.query_norm", "attn.norm_q.weight"),
    ("img_attn.norm.key_norm", "attn.norm_k.weight"),
    ("txt_attn.norm.query_norm", "attn.norm_added_q.weight"),
    ("txt_attn.norm.key_norm", "attn.norm_added_k.weight"),
]
# Fused projections: ours <- concatenation (dim 0) of diffusers' pieces.
_DOUBLE_FUSED = [
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
]
_SINGLE = [("modulation.lin", "norm.linear"), ("linear2", "proj_out")]
_SINGLE_NORMS = [("norm.query_norm", "attn.norm_q.weight"), ("norm.key_norm", "attn.norm_k.weight")]
_SINGLE_FUSED = [("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))]


_CONTEXT_OUT = ("txt_attn.proj", "txt_mlp.0", "txt_mlp.2")     # a context_pre_only block has none of these


def context_output_tensors(p: DiTParams) -> list[tuple[str, str]]:
    """(ours, diffusers) names of the text-output tensors that a double-only model's last block does not have
    (``context_pre_only``: its text rows are keys and values only). diffusers' FLUX blocks always carry them: they are
    ignored when read, written as zeros (exact: nothing reads that output) when exported, and a checkpoint written
    before the block lost them still holds them, ignored on load."""
    if p.single_blocks or not p.double_blocks:
        return []
    i = p.double_blocks - 1
    names = dict(_DOUBLE)
    return [(f"double_blocks.{i}.{o}.{s}", f"transformer_blocks.{i}.{names[o]}.{s}")
            for o in _CONTEXT_OUT for s in ("weight", "bias")]


def params_from_diffusers_config(config: dict[str, Any]) -> DiTParams:
    """DiTParams for a diffusers ``FluxTransformer2DModel`` config (its ``config.json`` as a dict): the config's own
    reading of a base folder (``config.base``), as the model's params."""
    keys = model_keys_from_diffusers_config(config)
    return DiTParams(**{**keys, "axes_dims_rope": tuple(keys["axes_dims_rope"])})


def _swap_halves(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat((b, a), dim=0)


def tensor_plan(p: DiTParams) -> tuple[list[tuple[str, str]], list[tuple[str, tuple[str, ...]]]]:
    """Every tensor as (ours, diffusers) renames plus (ours, diffusers pieces) fusions."""
    renames: list[tuple[str, str]] = []
    fused: list[tuple[str, tuple[str, ...]]] = []

    def linear(ours: str, theirs: str) -> None:
        renames.extend([(f"{ours}.weight", f"{theirs}.weight"), (f"{ours}.bias", f"{theirs}.bias")])

    for o, d in _TOP + (_GUIDANCE if p.guidance_embed else []):
        linear(o, d)
    absent = {o for o, _ in context_output_tensors(p)}
    for i in range(p.double_blocks):
        for o, d in _DOUBLE:
            if f"double_blocks.{i}.{o}.weight" not in absent:
                linear(f"double_blocks.{i}.{o}", f"transformer_blocks.{i}.{d}")
        for o, d in _DOUBLE_NORMS:
            renames.append((f"double_blocks.{i}.{o}", f"transformer_blocks.{i}.{d}"))
        for o, ds in _DOUBLE_FUSED:
            for suffix in ("weight",) + (("bias",) if p.qkv_bias else ()):
                fused.append((f"double_blocks.{i}.{o}.{suffix}",
                              tuple(f"transformer_blocks.{i}.{d}.{suffix}" for d in ds)))
    for i in range(p.single_blocks):
        for o, d in _SINGLE:
            linear(f"single_blocks.{i}.{o}", f"single_transformer_blocks.{i}.{d}")
        for o, d in _SINGLE_NORMS:
            renames.append((f"single_blocks.{i}.{o}", f"single_transformer_blocks.{i}.{d}"))
        for o, ds in _SINGLE_FUSED:
            for suffix in ("weight", "bias"):
                fused.append((f"single_blocks.{i}.{o}.{suffix}",
                              tuple(f"single_transformer_blocks.{i}.{d}.{suffix}" for d in ds)))
    return renames, fused


FINAL_ADALN = ("final_layer.adaLN_modulation.1", "norm_out.linear")


def from_diffusers(sd: dict[str, Tensor], p: DiTParams) -> dict[str, Tensor]:
    """A diffusers FLUX transformer state dict -> our state dict. Raises KeyError listing missing or
    unexpected keys, so a partial or foreign checkpoint never loads silently."""
    renames, fused = tensor_plan(p)
    expected = {d for _, d in renames} | {d for _, ds in fused for d in ds}
    expected |= {f"{FINAL_ADALN[1]}.weight", f"{FINAL_ADALN[1]}.bias"}
    ignored = {d for _, d in context_output_tensors(p)}
    missing, unexpected = sorted(expected - sd.keys()), sorted(sd.keys() - expected - ignored)
    if missing or unexpected:
        raise KeyError(f"not a FLUX transformer state dict for these params: missing {missing[:5]}"
                       f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                       f"{'...' if len(unexpected) > 5 else ''}")
    out = {o: sd[d] for o, d in renames}
    for o, ds in fused:
        out[o] = torch.cat([sd[d] for d in ds], dim=0)
    for suffix in ("weight", "bias"):
        out[f"{FINAL_ADALN[0]}.{suffix}"] = _swap_halves(sd[f"{FINAL_ADALN[1]}.{suffix}"])
    return out


def to_diffusers(sd: dict[str, Tensor], p: DiTParams) -> dict[str, Tensor]:
    """Our state dict -> diffusers FLUX layout (inverse of ``from_diffusers``)."""
    renames, fused = tensor_plan(p)
    out = {d: sd[o] for o, d in renames}
    for o, ds in fused:
        total = sd[o].shape[0]
        if len(ds) == 3:
            sizes = [total // 3] * 3
        else:  # single block linear1: q, k, v (hidden each) and the MLP input
            sizes = [p.hidden] * 3 + [total - 3 * p.hidden]
        for d, piece in zip(ds, sd[o].split(sizes, dim=0)):
            out[d] = piece.contiguous()
    for suffix in ("weight", "bias"):
        out[f"{FINAL_ADALN[1]}.{suffix}"] = _swap_halves(sd[f"{FINAL_ADALN[0]}.{suffix}"])
    like = sd["img_in.weight"]
    for o, d in context_output_tensors(p):      # diffusers' block has them: zeros, since nothing reads that output
        out[d] = torch.zeros(_context_shape(o, p), dtype=like.dtype, device=like.device)
    return out


def _context_shape(ours: str, p: DiTParams) -> tuple[int, ...]:
    mlp = int(p.hidden * p.mlp_ratio)
    rows, cols = {"txt_attn.proj": (p.hidden, p.hidden), "txt_mlp.0": (mlp, p.hidden),
                  "txt_mlp.2": (p.hidden, mlp)}[ours.split(".", 2)[2].rsplit(".", 1)[0]]
    return (rows, cols) if ours.endswith(".weight") else (rows,)


def diffusers_config(p: DiTParams) -> dict[str, Any]:
    """The diffusers config that ``params_from_diffusers_config`` maps back to ``p``."""
    if p.mlp_ratio != 4.0 or not p.qkv_bias or p.rope_theta != 10000.0:
        raise ValueError("diffusers' FluxTransformer2DModel fixes mlp_ratio 4, qkv bias and rope theta 10000")
    if p.positions != "corner":
        raise ValueError("diffusers' FluxTransformer2DModel counts positions from the corner (model.positions = "
                         f"'corner'), not {p.positions!r}")
    if p.abs_pos_embed:
        raise ValueError("diffusers' FluxTransformer2DModel has no absolute position embedding (abs_pos_embed)")
    return {"patch_size": 1, "in_channels": p.in_channels, "out_channels": None, "num_layers": p.double_blocks,
            "num_single_layers": p.single_blocks, "attention_head_dim": p.head_dim,
            "num_attention_heads": p.heads, "joint_attention_dim": p.text_dim,
            "pooled_projection_dim": p.pooled_dim, "guidance_embeds": p.guidance_embed,
            "axes_dims_rope": list(p.axes_dims_rope)}
