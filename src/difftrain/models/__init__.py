"""The DiT, its encoders and the state-dict adapters; ``build_*`` turn a config into modules."""

from __future__ import annotations

import torch

from difftrain.config.schema import Config
from difftrain.errors import UserError
from difftrain.models.autoencoder import build_autoencoder
from difftrain.models.dit import DiTParams, MMDiT, num_params
from difftrain.models.text import WordTextEncoder


def build_text_encoder(cfg: Config, vocabulary: list[str] | None = None, device: torch.device | str = "cpu",
                       lazy: bool = False, on_build=None, base_words: int = 0):
    """The config's text encoder on ``device``. ``lazy``: frozen ('hf') encoders are built on first use
    (``LazyHFTextEncoder``; ``on_build(encoder)`` is called then), so a run that never encodes never holds them."""
    t = cfg.text
    if t.kind == "words":
        if not vocabulary:   # the vocabulary is data: the caller takes it from its data source or checkpoint
            raise ValueError("text.kind = 'words' needs its word vocabulary (difftrain.sources.vocabulary_for(cfg))")
        return WordTextEncoder(vocabulary, t.max_tokens, t.dim, t.layers, padding=t.padding,
                               base_words=base_words).to(device)
    from difftrain.models.hf_text import HFTextEncoder, LazyHFTextEncoder
    if lazy:
        return LazyHFTextEncoder(t.t5_path, t.clip_path, t.max_tokens, t.dtype, device, t.padding, t.precision,
                                 on_build)
    return HFTextEncoder.from_paths(t.t5_path, t.clip_path, t.max_tokens, t.dtype, device=device, padding=t.padding,
                                    precision=t.precision)


def dit_params(cfg: Config, in_channels: int | None = None, text_dim: int | None = None,
               pooled_dim: int | None = None) -> DiTParams:
    """Model params from the config; channels/widths set to 0 there are taken from the encoders."""
    m = cfg.model
    resolved = {}
    for name, given, derived in (("in_channels", m.in_channels, in_channels), ("text_dim", m.text_dim, text_dim),
                                 ("pooled_dim", m.pooled_dim, pooled_dim)):
        if given and derived and given != derived:
            raise UserError(f"model.{name} = {given} but the encoders give {derived}: set it to 0 or {derived}")
        value = given or derived
        if not value:
            raise UserError(f"model.{name} is 0 and cannot be taken from an encoder here: set it explicitly")
        resolved[name] = value
    return DiTParams(hidden=m.hidden, heads=m.heads, double_blocks=m.double_blocks, single_blocks=m.single_blocks,
                     mlp_ratio=m.mlp_ratio, axes_dims_rope=tuple(m.axes_dims_rope), rope_theta=m.rope_theta,
                     guidance_embed=m.guidance_embed, qkv_bias=m.qkv_bias, abs_pos_embed=m.abs_pos_embed,
                     positions=m.positions,
                     **resolved)


def config_dit_params(cfg: Config) -> DiTParams:
    """Params without loading any encoder: widths the config leaves at 0 are inferred where the built-in
    encoders fix them (pixel-unshuffle, words), else the config must state them (large presets do)."""
    in_ch = 3 * cfg.autoencoder.factor ** 2 * 4 if cfg.autoencoder.kind == "pixel-unshuffle" else None
    words = cfg.text.dim if cfg.text.kind == "words" else None
    return dit_params(cfg, in_ch, words, words)


def build_dit(params: DiTParams, init: str = "zero-out", device: torch.device | str = "cpu", seed: int = 0) -> MMDiT:
    """On 'meta' the model is shapes only (for counting, or to materialise after sharding and then
    ``init_weights``); elsewhere it is initialised with ``seed``."""
    with torch.device("meta"):
        model = MMDiT(params)
    if str(device) != "meta":
        model.to_empty(device=device)
        model.init_weights(init, seed)
    return model


__all__ = ["DiTParams", "MMDiT", "num_params", "build_text_encoder", "build_autoencoder", "build_dit",
           "dit_params", "config_dit_params"]
