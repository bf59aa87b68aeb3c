"""Numerical parity of ``MMDiT`` with diffusers' ``FluxTransformer2DModel`` through the state-dict adapter.

Tiny random diffusers models are built here (no download); every weight, norm scales and biases included,
is randomised so that no zero- or one-initialisation can hide a wrong mapping (e.g. the (scale, shift)
swap of the final adaLN, the order of the fused q/k/v pieces, or the text-first attention order).
"""

from __future__ import annotations

import pytest
import torch

from difftrain.models.dit import DiTParams, MMDiT
from difftrain.tokens import image_ids

from conftest import run_diffusers_flux, run_ours_flux
from difftrain.models.flux_adapter import (context_output_tensors, diffusers_config, from_diffusers, params_from_diffusers_config,
                                           to_diffusers)

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

TOL = 1e-4



CONFIGS = [
    # (num_layers, num_single_layers, heads, head_dim, axes_dims_rope, guidance_embeds, in_channels)
    pytest.param(dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                      axes_dims_rope=(4, 6, 6), guidance_embeds=False, in_channels=16), id="1d1s-h2-d16"),
    pytest.param(dict(num_layers=2, num_single_layers=0, num_attention_heads=3, attention_head_dim=16,
                      axes_dims_rope=(8, 4, 4), guidance_embeds=True, in_channels=8), id="2d0s-h3-guid"),
    pytest.param(dict(num_layers=0, num_single_layers=2, num_attention_heads=2, attention_head_dim=16,
                      axes_dims_rope=(2, 2, 12), guidance_embeds=True, in_channels=16), id="0d2s-h2-guid"),
    pytest.param(dict(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4), guidance_embeds=False, in_channels=12), id="1d2s-h4-d8"),
]
TEXT_DIM, POOLED_DIM, TXT_LEN = 24, 20, 5


def _diffusers_model(cfg: dict, seed: int) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, out_channels=None, joint_attention_dim=TEXT_DIM,
                                   pooled_projection_dim=POOLED_DIM, **cfg).eval()
    _randomise(model, seed)
    return model


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Normal(0, 0.15) everywhere; QK-norm scales around 1 with spread (so attention stays sharp enough
    for the rotary phases to matter) but never the exact ones an unloaded norm would keep."""
    g = torch.Generator().manual_seed(1000 + seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "norm_q" in name or "norm_k" in name or "norm_added" in name or "query_norm" in name \
                or "key_norm" in name:
            p.copy_(1.0 + 0.3 * noise)
        else:
            p.copy_(0.15 * noise)


def _ours_from(model: FluxTransformer2DModel) -> tuple[MMDiT, DiTParams]:
    p = params_from_diffusers_config(dict(model.config))
    ours = MMDiT(p).eval()
    ours.load_state_dict(from_diffusers(model.state_dict(), p), strict=True)
    return ours, p


def _inputs(cfg: dict, B: int, kontext: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = image_ids(3, 4, index=0)                        # target: 3 x 4 tokens at index 0
    if kontext:                                           # reference image (FLUX Kontext): index 1, other grid
        ids = torch.cat((ids, image_ids(2, 5, index=1)))
    L = ids.shape[0]
    x = torch.randn(B, L, cfg["in_channels"], generator=g)
    txt = torch.randn(B, TXT_LEN, TEXT_DIM, generator=g)
    pooled = torch.randn(B, POOLED_DIM, generator=g)
    t = torch.rand(B, generator=g)
    guidance = 3.5 + 0.5 * torch.rand(B, generator=g) if cfg["guidance_embeds"] else None
    return x, ids, txt, pooled, t, guidance


@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_parity(cfg):
    ref = _diffusers_model(cfg, seed=0)
    ours, _ = _ours_from(ref)
    for B, kontext in ((1, False), (3, True), (2, True)):
        inp = _inputs(cfg, B, kontext, seed=10 + B)
        want, got = run_diffusers_flux(ref, *inp), run_ours_flux(ours, *inp)
        assert got.shape == want.shape == inp[0].shape
        assert want.abs().max() > 1e-2, "reference output is ~0: the comparison would prove nothing"
        assert (got - want).abs().max().item() <= TOL, (B, kontext)


@pytest.mark.parametrize("cfg", CONFIGS[:2])
def test_parity_is_sensitive_to_positions_and_time(cfg):
    """Guards against a vacuous parity: the inputs the comparison relies on do move the output."""
    ref = _diffusers_model(cfg, seed=1)
    x, ids, txt, pooled, t, g = _inputs(cfg, 2, True, seed=5)
    base = run_diffusers_flux(ref, x, ids, txt, pooled, t, g)
    swapped = ids.clone()
    swapped[:, 1:] = ids[:, [2, 1]]                                   # transpose rows and columns
    assert (run_diffusers_flux(ref, x, swapped, txt, pooled, t, g) - base).abs().max() > 10 * TOL
    assert (run_diffusers_flux(ref, x, ids, txt, pooled, t * 0.5, g) - base).abs().max() > 10 * TOL


@pytest.mark.parametrize("cfg", CONFIGS)
def test_state_dict_round_trip_is_exact(cfg):
    ref = _diffusers_model(cfg, seed=2)
    p = params_from_diffusers_config(dict(ref.config))
    sd = ref.state_dict()
    back = to_diffusers(from_diffusers(sd, p), p)
    assert set(back) == set(sd)
    # a double-only model's last block has no text output weights (nothing reads that output): written back as zeros
    unread = {d for _, d in context_output_tensors(p)}
    assert bool(unread) == (p.single_blocks == 0)
    for k in sd:
        assert back[k].shape == sd[k].shape, k
        assert torch.equal(back[k], torch.zeros_like(sd[k]) if k in unread else sd[k]), k
    if unread:          # and diffusers computes the same image output with them zeroed
        zeroed = _diffusers_model(cfg, seed=2)
        zeroed.load_state_dict(back)
        x, ids, txt, pooled, t, g = _inputs(cfg, 2, True, seed=5)
        assert torch.equal(run_diffusers_flux(zeroed, x, ids, txt, pooled, t, g),
                           run_diffusers_flux(ref, x, ids, txt, pooled, t, g))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_exported_weights_load_into_diffusers(cfg):
    """ours -> diffusers: an independently initialised MMDiT, exported, drives a fresh diffusers model to
    the same outputs; and re-exporting the weights loaded from diffusers reproduces diffusers exactly."""
    ref = _diffusers_model(cfg, seed=3)
    p = params_from_diffusers_config(dict(ref.config))
    inp = _inputs(cfg, 2, True, seed=7)

    ours = MMDiT(p).eval()
    _randomise(ours, seed=4)
    fresh = _diffusers_model(cfg, seed=5)
    fresh.load_state_dict(to_diffusers(ours.state_dict(), p), strict=True)
    want = run_ours_flux(ours, *inp)
    assert want.abs().max() > 1e-2
    assert (run_diffusers_flux(fresh, *inp) - want).abs().max().item() <= TOL

    loaded, _ = _ours_from(ref)
    fresh2 = _diffusers_model(cfg, seed=6)
    fresh2.load_state_dict(to_diffusers(loaded.state_dict(), p), strict=True)
    torch.testing.assert_close(run_diffusers_flux(fresh2, *inp), run_diffusers_flux(ref, *inp), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]])
def test_missing_or_extra_key_raises(cfg):
    ref = _diffusers_model(cfg, seed=8)
    p = params_from_diffusers_config(dict(ref.config))
    sd = ref.state_dict()
    victim = "single_transformer_blocks.0.proj_mlp.bias"
    missing = {k: v for k, v in sd.items() if k != victim}
    with pytest.raises(KeyError, match=victim.replace(".", r"\.")):
        from_diffusers(missing, p)
    extra = dict(sd, **{"transformer_blocks.7.attn.to_q.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"transformer_blocks\.7\.attn\.to_q\.weight"):
        from_diffusers(extra, p)
    final = {k: v for k, v in sd.items() if k != "norm_out.linear.weight"}
    with pytest.raises(KeyError, match=r"norm_out\.linear\.weight"):
        from_diffusers(final, p)


def test_guidance_mismatch_raises():
    """A guidance-distilled checkpoint does not load into params without the guidance embedder."""
    ref = _diffusers_model(dict(CONFIGS[1].values[0]), seed=9)
    p = params_from_diffusers_config(dict(ref.config))
    no_guidance = DiTParams(**{**p.__dict__, "guidance_embed": False})
    with pytest.raises(KeyError, match="guidance_embedder"):
        from_diffusers(ref.state_dict(), no_guidance)


@pytest.mark.parametrize("p", [
    DiTParams(in_channels=16, text_dim=24, pooled_dim=20, hidden=32, heads=2, double_blocks=1, single_blocks=0,
              axes_dims_rope=(4, 6, 6), guidance_embed=True),
    DiTParams(in_channels=8, text_dim=12, pooled_dim=10, hidden=48, heads=3, double_blocks=0, single_blocks=3,
              axes_dims_rope=(8, 4, 4)),
    DiTParams(guidance_embed=True),   # FLUX.1-dev itself
])
def test_diffusers_config_round_trip(p):
    cfg = diffusers_config(p)
    assert params_from_diffusers_config(cfg) == p
    if p.hidden <= 64:   # and diffusers accepts it, and reports it back the same
        model = FluxTransformer2DModel(**cfg)
        assert params_from_diffusers_config(dict(model.config)) == p
        assert set(from_diffusers(model.state_dict(), p)) == set(MMDiT(p).state_dict())


def test_diffusers_config_rejects_unrepresentable_params():
    base = dict(in_channels=8, text_dim=8, pooled_dim=8, hidden=32, heads=2, double_blocks=1, single_blocks=1,
                axes_dims_rope=(4, 6, 6))
    for bad in (dict(mlp_ratio=2.0), dict(qkv_bias=False), dict(rope_theta=256.0), dict(abs_pos_embed=True)):
        with pytest.raises(ValueError):
            diffusers_config(DiTParams(**base, **bad))
    with pytest.raises(ValueError):
        params_from_diffusers_config({**diffusers_config(DiTParams(**base)), "patch_size": 2})


def test_the_pipeline_feeds_sample_guidance_as_fluxpipeline_does():
    """FLUX.1-dev is guidance-distilled: diffusers' FluxPipeline feeds its guidance_scale (3.5 by default) to the
    transformer's guidance embedding. Our Pipeline, given sample.guidance, gives the same velocity on a tiny FLUX
    built here; at the old default (1) it would not."""
    from types import SimpleNamespace

    from difftrain.diffusion.flow import FlowSpec
    from difftrain.diffusion.pipeline import Pipeline
    from difftrain.models.text import TextEmbedding

    cfg = CONFIGS[1].values[0]
    assert cfg["guidance_embeds"]
    ref = _diffusers_model(cfg, seed=3)
    ours, _ = _ours_from(ref)
    x, ids, txt, pooled, t, _ = _inputs(cfg, 2, False, seed=9)
    emb = TextEmbedding(txt, pooled, torch.ones(txt.shape[:2], dtype=torch.bool))
    text = SimpleNamespace(padding="padded")
    B = x.shape[0]
    flux_pipeline = run_diffusers_flux(ref, x, ids, txt, pooled, t, torch.full([1], 3.5).expand(B))
    for guidance, same in ((3.5, True), (1.0, False)):
        pipe = Pipeline(torch.nn.ModuleDict({"dit": ours}), text, None, FlowSpec(prediction="v"), "cpu", None,
                        guidance=guidance)
        with torch.no_grad():
            v = pipe.velocity(x, ids.expand(B, -1, -1), t, emb)
        assert ((v - flux_pipeline).abs().max().item() <= TOL) is same, guidance
