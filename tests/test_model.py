"""The MMDiT and its pieces: RoPE, patch packing, position ids, init, masks, params; and sequence assembly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from difftrain.config import load_config, preset_path
from difftrain.data.batch import assemble, frames_of
from difftrain.models import build_dit, config_dit_params
from difftrain.models.dit import DiTParams, MMDiT, num_params
from difftrain.tokens import image_ids, patchify, unpatchify
from difftrain.models.layers import timestep_embedding
from difftrain.models.attention import Attention
from difftrain.models.rope import apply_rope, rope_angles

ROOT = Path(__file__).resolve().parents[1]
AXES = (4, 6, 6)
P = DiTParams(in_channels=16, text_dim=12, pooled_dim=10, hidden=32, heads=2, double_blocks=1, single_blocks=1,
              axes_dims_rope=AXES)


def _model(init: str = "default", seed: int = 0, p: DiTParams = P) -> MMDiT:
    return build_dit(p, init, seed=seed).eval()


def _random_ids(B: int, L: int, g: torch.Generator, high: int = 40) -> torch.Tensor:
    return torch.randint(0, high, (B, L, 3), generator=g)


# ---------------------------------------------------------------------------------------------- RoPE


def _rope_reference(x_BHLD: torch.Tensor, ids_BL3: torch.Tensor, axes, theta: float) -> torch.Tensor:
    """Independent complex-number RoPE: axis a owns a contiguous slice of the head dim; inside it the
    channel pair (2i, 2i+1) is the complex number x_2i + j x_2i+1, multiplied by exp(j pos theta^(-2i/d))."""
    out, start = [], 0
    for a, d in enumerate(axes):
        sl = x_BHLD[..., start:start + d].double()
        z = torch.complex(sl[..., 0::2], sl[..., 1::2])
        freq = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
        ang = ids_BL3[..., a].double()[:, None, :, None] * freq
        z = z * torch.polar(torch.ones_like(ang), ang)
        out.append(torch.stack((z.real, z.imag), -1).flatten(-2))
        start += d
    return torch.cat(out, -1).float()


def test_rope_matches_independent_complex_implementation():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 7, sum(AXES), generator=g)
    ids = _random_ids(2, 7, g)
    got = apply_rope(q, *rope_angles(ids, AXES, 10000.0))
    torch.testing.assert_close(got, _rope_reference(q, ids, AXES, 10000.0), atol=1e-5, rtol=1e-5)


def test_rope_preserves_norm():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 9, sum(AXES), generator=g)
    ids = _random_ids(2, 9, g, high=500)
    rot = apply_rope(q, *rope_angles(ids, AXES, 10000.0))
    assert not torch.allclose(rot, q)
    torch.testing.assert_close(rot.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rope_zero_position_is_identity():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 5, sum(AXES), generator=g)
    cos, sin = rope_angles(torch.zeros(2, 5, 3, dtype=torch.long), AXES, 10000.0)
    assert cos.shape == sin.shape == (2, 1, 5, sum(AXES) // 2)
    assert torch.equal(apply_rope(q, cos, sin), q)


def _logits(q, k, ids, axes=AXES):
    rope = rope_angles(ids, axes, 10000.0)
    return apply_rope(q, *rope) @ apply_rope(k, *rope).transpose(-1, -2)


def test_rope_logits_depend_only_on_position_differences():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 6, sum(AXES), generator=g)
    k = torch.randn(2, 2, 6, sum(AXES), generator=g)
    ids = _random_ids(2, 6, g)
    base = _logits(q, k, ids)
    for shift in ((5, 0, 0), (0, 7, 0), (0, 0, 11), (3, -4, 9)):
        shifted = ids + torch.tensor(shift)
        torch.testing.assert_close(_logits(q, k, shifted), base, atol=1e-4, rtol=1e-4)
    # ... and they do depend on the differences, along every axis
    for axis in range(3):
        moved = ids.clone()
        moved[:, 0, axis] += 3
        assert (_logits(q, k, moved) - base).abs().max() > 1e-3, axis


def test_attention_key_mask():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4, sum(AXES), generator=g) for _ in range(3))
    rope = rope_angles(_random_ids(1, 4, g), AXES, 10000.0)
    mask = torch.tensor([True, True, False, True])[None, None, None]
    out = Attention()(q, k, v, rope, mask)
    assert out.shape == (1, 4, 2 * sum(AXES))
    v2 = v.clone()
    v2[:, :, 2] += 100.0          # the masked key's value cannot reach any query
    torch.testing.assert_close(Attention()(q, k, v2, rope, mask), out)
    assert not torch.allclose(Attention()(q, k, v2, rope), Attention()(q, k, v, rope))


# ---------------------------------------------------------------------------- patches and position ids


def test_patchify_round_trip():
    x = torch.randn(3, 4, 6, 10)
    tok = patchify(x)
    assert tok.shape == (3, 3 * 5, 16)
    assert torch.equal(unpatchify(tok, 6, 10), x)


def test_patchify_channel_order_is_c_ph_pw():
    B, C, H, W = 2, 3, 4, 6
    b, c, y, x = torch.meshgrid(*(torch.arange(n) for n in (B, C, H, W)), indexing="ij")
    lat = (b * 10000 + c * 1000 + y * 10 + x).float()
    tok = patchify(lat)
    w_tok = W // 2
    for bb in range(B):
        for l in range(tok.shape[1]):
            row, col = divmod(l, w_tok)
            for ch in range(C * 4):
                cc, rest = divmod(ch, 4)
                ph, pw = divmod(rest, 2)
                want = bb * 10000 + cc * 1000 + (2 * row + ph) * 10 + (2 * col + pw)
                assert tok[bb, l, ch].item() == want, (bb, l, ch)


def test_patchify_rejects_odd_sizes():
    with pytest.raises(ValueError):
        patchify(torch.zeros(1, 4, 5, 6))
    with pytest.raises(ValueError):
        unpatchify(torch.zeros(1, 5, 16), 4, 6)


def test_image_ids_layout():
    ids = image_ids(2, 3, index=4)
    want = [[4, 0, 0], [4, 0, 1], [4, 0, 2], [4, 1, 0], [4, 1, 1], [4, 1, 2]]
    assert ids.tolist() == want
    assert image_ids(3, 1).tolist() == [[0, 0, 0], [0, 1, 0], [0, 2, 0]]


def test_image_ids_follow_patchify_order():
    """Token l of patchify covers the 2x2 latent patch at (row, col) = image_ids[l][1:]."""
    H, W = 6, 8
    y, x = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    tok = patchify((y * 100 + x).float()[None, None])[0]
    for l, (_, r, c) in enumerate(image_ids(H // 2, W // 2).tolist()):
        assert tok[l, 0].item() == (2 * r) * 100 + 2 * c


# ------------------------------------------------------------------------------------------- the model


def _inputs(B: int, ids_L3: torch.Tensor, T: int = 5, seed: int = 0, p: DiTParams = P):
    g = torch.Generator().manual_seed(seed)
    L = ids_L3.shape[-2]
    return dict(img_BLC=torch.randn(B, L, p.in_channels, generator=g),
                img_ids_BL3=ids_L3.expand(B, -1, -1) if ids_L3.dim() == 2 else ids_L3,
                txt_BTD=torch.randn(B, T, p.text_dim, generator=g), t_B=torch.rand(B, generator=g),
                pooled_BP=torch.randn(B, p.pooled_dim, generator=g))


LAYOUTS = {
    "t2i": image_ids(2, 3, 0),
    "edit": torch.cat((image_ids(2, 3, 0), image_ids(2, 3, 1))),
    "keyframes": torch.cat([image_ids(2, 2, i) for i in range(3)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_shapes(layout):
    model = _model()
    ids = LAYOUTS[layout]
    with torch.no_grad():
        out = model(**_inputs(2, ids))
    assert out.shape == (2, ids.shape[0], P.in_channels)
    assert torch.isfinite(out).all() and out.abs().max() > 0


@pytest.mark.parametrize("blocks", [(1, 1), (2, 0), (0, 2)])
def test_the_last_blocks_text_rows_skip_their_mlp_and_the_image_output_is_unchanged(blocks, monkeypatch):
    """The last block's text rows are keys and values only: its MLP and projections run on the image rows alone
    (single block: ``keep_from``; a last double block: built ``context_pre_only``, without them). Against every
    block computed over every row (the text rows' output dropped afterwards; the last double block with text output
    weights put back), the output and every shared parameter's gradient agree, padding included."""
    from difftrain.models.layers import DoubleStreamBlock, SingleStreamBlock

    p = DiTParams(**{**P.__dict__, "double_blocks": blocks[0], "single_blocks": blocks[1]})
    model = build_dit(p, "default", seed=3).train()
    inp = _inputs(3, LAYOUTS["edit"], T=6, p=p)
    inp["txt_mask_BT"] = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4]).bool()

    def run(m):
        m.zero_grad()
        out = m(**inp)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {n: q.grad.clone() for n, q in m.named_parameters() if q.grad is not None}

    pruned, pruned_grads = run(model)
    assert pruned_grads.keys() == dict(model.named_parameters()).keys()     # every parameter trains
    full_model = build_dit(p, "default", seed=3).train()
    if blocks[1] == 0:              # the last double block as it was: with text output weights, computed and unread
        last = full_model.double_blocks[-1]
        assert last.context_pre_only and last.txt_mlp is None and last.txt_attn.proj is None
        whole = DoubleStreamBlock(p.hidden, p.heads, p.mlp_ratio, p.qkv_bias)
        assert whole.load_state_dict(last.state_dict(), strict=False).unexpected_keys == []
        full_model.double_blocks[-1] = whole
    single = SingleStreamBlock.forward
    calls = []

    def single_full(self, x, vec, rope, mask=None, keep_from=0):
        calls.append(keep_from)
        return single(self, x, vec, rope, mask)[:, keep_from:]

    monkeypatch.setattr(SingleStreamBlock, "forward", single_full)
    full, full_grads = run(full_model)
    assert calls == [0] * (blocks[1] - 1) + [6] * (blocks[1] > 0)
    assert torch.allclose(pruned, full, atol=1e-6, rtol=1e-5)
    assert set(full_grads) == set(pruned_grads)       # the text output weights put back get no gradient
    for n, g in full_grads.items():
        assert torch.allclose(pruned_grads[n], g, atol=1e-6, rtol=1e-5), n


def test_guidance_model_requires_guidance():
    p = DiTParams(**{**P.__dict__, "guidance_embed": True})
    model = _model(p=p)
    inp = _inputs(2, LAYOUTS["t2i"], p=p)
    with pytest.raises(ValueError):
        model(**inp)
    with torch.no_grad():
        a = model(**inp, guidance_B=torch.full((2,), 3.5))
        b = model(**inp, guidance_B=torch.full((2,), 1.0))
    assert (a - b).abs().max() > 1e-5


def test_zero_out_init_gives_zero_output_and_identity_blocks():
    model = _model("zero-out")
    inp = _inputs(2, LAYOUTS["edit"])
    with torch.no_grad():
        out = model(**inp)
        assert torch.equal(out, torch.zeros_like(out))
        # the rest of the network is not degenerate: embedders and block weights are live
        assert model.img_in.weight.abs().max() > 0
        assert model.double_blocks[0].img_attn.qkv.weight.abs().max() > 0
        vec = model.time_in(timestep_embedding(inp["t_B"])) + model.vector_in(inp["pooled_BP"])
        assert vec.abs().max() > 0
        img, txt = model.img_in(inp["img_BLC"]), model.txt_in(inp["txt_BTD"])
        ids = torch.cat((torch.zeros(2, txt.shape[1], 3, dtype=torch.long), inp["img_ids_BL3"]), 1)
        rope = rope_angles(ids, AXES, 10000.0)
        for block in model.double_blocks:
            i2, t2 = block(img, txt, vec, rope)
            assert torch.equal(i2, img) and torch.equal(t2, txt)
        x = torch.cat((txt, img), 1)
        for block in model.single_blocks:
            assert torch.equal(block(x, vec, rope), x)
    # "default" keeps the modulation and the head live
    with torch.no_grad():
        assert _model("default")(**inp).abs().max() > 1e-3


def test_per_sample_position_ids():
    """A batch mixing two layouts equals each sample run alone, and the ids of each sample are its own."""
    model = _model(seed=1)
    ids_a = image_ids(2, 3, 0)                                       # a 2x3 image
    ids_b = torch.cat((image_ids(1, 3, 0), image_ids(1, 3, 1)))       # same length, edit-like layout
    ids = torch.stack((ids_a, ids_b))
    inp = _inputs(2, ids, seed=3)
    with torch.no_grad():
        both = model(**inp)
        for i in range(2):
            alone = {k: v[i:i + 1] for k, v in inp.items()}
            torch.testing.assert_close(both[i:i + 1], model(**alone), atol=1e-5, rtol=1e-5)
        wrong = dict(inp, img_ids_BL3=ids_a.expand(2, -1, -1))
        assert (model(**wrong)[1] - both[1]).abs().max() > 1e-4


def test_text_padding_mask():
    model = _model(seed=2)
    T = 6
    inp = _inputs(2, LAYOUTS["t2i"], T=T, seed=4)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[1, 2:] = False
    with torch.no_grad():
        unmasked = model(**inp)
        masked = model(**inp, txt_mask_BT=mask)
        assert masked.shape == unmasked.shape and torch.isfinite(masked).all()
        assert (masked - unmasked).abs().max() > 1e-4
        torch.testing.assert_close(model(**inp, txt_mask_BT=torch.ones(2, T, dtype=torch.bool)), unmasked)
        # masked text is invisible: changing it changes nothing, and dropping it is the same as masking it
        junk = inp["txt_BTD"].clone()
        junk[~mask] = 50.0
        torch.testing.assert_close(model(**dict(inp, txt_BTD=junk), txt_mask_BT=mask), masked,
                                   atol=1e-5, rtol=1e-5)
        for i, keep in enumerate((4, 2)):
            alone = {k: v[i:i + 1] for k, v in inp.items()}
            alone["txt_BTD"] = alone["txt_BTD"][:, :keep]
            torch.testing.assert_close(model(**alone), masked[i:i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [
    dict(hidden=30, heads=4),                                   # not divisible
    dict(axes_dims_rope=(4, 6, 8)),                             # sums to 18, head dim 16
    dict(axes_dims_rope=(3, 7, 6)),                             # odd
    dict(in_channels=0),
    dict(text_dim=-4),
    dict(pooled_dim=0),
])
def test_bad_params_raise(bad):
    with pytest.raises(ValueError):
        DiTParams(**{**P.__dict__, **bad})


def test_flux_dev_parameter_count_on_meta():
    flux_dev = 11_901_408_320
    model = build_dit(DiTParams(), device="meta")
    assert next(model.parameters()).device.type == "meta"
    assert abs(num_params(model) - flux_dev) / flux_dev < 0.01
    # with the guidance embedder, the published FLUX.1-dev count exactly
    assert num_params(build_dit(DiTParams(guidance_embed=True), device="meta")) == flux_dev


def test_dit_24b_config_size():
    p = config_dit_params(load_config(preset_path("dit-24b")))
    n = num_params(build_dit(p, device="meta"))
    assert n >= 20e9
    # independent count of the weight matrices, which dominate: per double-block stream qkv 3h^2 + proj h^2 +
    # MLP 8h^2 + modulation 6h^2; per single block linear1 7h^2 + linear2 5h^2 + modulation 3h^2
    h = p.hidden
    approx = p.double_blocks * 2 * 18 * h * h + p.single_blocks * 15 * h * h
    assert abs(n - approx) / n < 0.01


# ------------------------------------------------------------------------------------- batch assembly


def _latents(B, F, C=4, H=4, W=6, seed=0):
    return torch.randn(B, F, C, H, W, generator=torch.Generator().manual_seed(seed))


def _assemble(lat, indices, target, task="t2i"):
    return assemble(lat, indices, torch.as_tensor(target), {}, [""] * lat.shape[0], task)


def test_assemble_t2i():
    lat = _latents(2, 1)
    b = _assemble(lat, [0], [[True], [True]])
    hw = 2 * 3
    assert b.x0_BLC.shape == (2, hw, 16) and b.ids_BL3.shape == (2, hw, 3) and b.loss_mask_BL.shape == (2, hw)
    assert b.loss_mask_BL.all()
    assert (b.ids_BL3 == image_ids(2, 3, 0)).all()
    assert torch.equal(b.x0_BLC, patchify(lat[:, 0]))
    assert b.grid == (1, 4, 6) and len(b) == 2


def test_assemble_edit_layout():
    lat = _latents(3, 2, seed=1)
    b = _assemble(lat, [0, 1], [[True, False]] * 3, task="edit")
    hw = 6
    assert b.loss_mask_BL[:, :hw].all() and not b.loss_mask_BL[:, hw:].any()
    assert (b.ids_BL3[:, :hw, 0] == 0).all() and (b.ids_BL3[:, hw:, 0] == 1).all()
    assert (b.ids_BL3[:, hw:, 1:] == image_ids(2, 3)[:, 1:]).all()
    assert torch.equal(b.x0_BLC[:, :hw], patchify(lat[:, 0]))       # target first
    assert torch.equal(b.x0_BLC[:, hw:], patchify(lat[:, 1]))       # reference second


def test_assemble_keyframes_subset():
    lat = _latents(2, 4, seed=2)
    target = [[True, False, True, False], [False, False, False, True]]
    b = _assemble(lat, [0, 1, 2, 3], target, task="keyframes")
    hw = 6
    for bi in range(2):
        for f in range(4):
            seg = slice(f * hw, (f + 1) * hw)
            assert bool(b.loss_mask_BL[bi, seg].all()) == target[bi][f]
            assert bool(b.loss_mask_BL[bi, seg].any()) == target[bi][f]
            assert (b.ids_BL3[bi, seg, 0] == f).all()


def test_assemble_custom_indices():
    b = _assemble(_latents(1, 2), [3, 7], [[False, True]])
    assert b.ids_BL3[0, :6, 0].tolist() == [3] * 6 and b.ids_BL3[0, 6:, 0].tolist() == [7] * 6


@pytest.mark.parametrize("F", [1, 2, 4])
def test_frames_of_round_trip(F):
    lat = _latents(2, F, seed=F)
    b = _assemble(lat, list(range(F)), [[True] * F] * 2)
    assert torch.equal(frames_of(b.x0_BLC, b.grid), lat)


def test_assemble_rejects_examples_without_target():
    with pytest.raises(ValueError):
        _assemble(_latents(2, 2), [0, 1], [[True, False], [False, False]])
    with pytest.raises(ValueError):
        _assemble(_latents(1, 2), [0], [[True, False]])


def test_rope_theta_is_used():
    """Sanity of the rope_theta parameter: a different base gives different angles."""
    ids = torch.tensor([[[1, 2, 3]]])
    c1, _ = rope_angles(ids, AXES, 10000.0)
    c2, _ = rope_angles(ids, AXES, 100.0)
    assert not torch.allclose(c1, c2)
    # the first pair of each axis turns by exactly the position (theta^0 = 1)
    starts = [0, AXES[0] // 2, (AXES[0] + AXES[1]) // 2]
    for a, s in enumerate(starts):
        assert math.isclose(c1[0, 0, 0, s].item(), math.cos(ids[0, 0, a].item()), abs_tol=1e-6)


def test_absolute_position_embedding_breaks_translation_invariance():
    """RoPE alone sees only position differences among image tokens; with abs_pos_embed the model
    knows where each token is, so shifting every id changes the output."""
    from difftrain.models.dit import DiTParams, MMDiT
    from difftrain.tokens import image_ids
    from difftrain.models.layers import position_features
    torch.manual_seed(0)
    feats = position_features(image_ids(3, 3)[None])
    assert feats.shape == (1, 9, 48)
    assert torch.cdist(feats[0], feats[0]).add(torch.eye(9) * 10).min() > 0.5   # every cell distinct
    for abs_pos in (False, True):
        p = DiTParams(in_channels=8, text_dim=6, pooled_dim=4, hidden=24, heads=2, double_blocks=1, single_blocks=1,
                      axes_dims_rope=(2, 4, 6), abs_pos_embed=abs_pos)
        m = MMDiT(p).eval()
        m.init_weights("default")
        x, txt, pooled, t = torch.randn(1, 9, 8), torch.randn(1, 3, 6), torch.randn(1, 4), torch.rand(1)
        ids = image_ids(3, 3)[None].float()
        # shift image and text positions together: relative positions are unchanged
        txt_ids = torch.zeros(1, 3, 3)
        a = m(x, ids, txt, t, pooled, txt_ids_BT3=txt_ids)
        b = m(x, ids + 5, txt, t, pooled, txt_ids_BT3=txt_ids + 5)
        assert torch.allclose(a, b, atol=1e-4) != abs_pos
    assert "pos_in.proj.weight" in dict(m.named_parameters())


def test_centre_positions_give_the_centre_square_one_code_on_every_canvas():
    """model.positions = 'centre': ids count from each grid's centre, so the middle 3x3 tokens of a 3x5 (5:3)
    grid get the 3x3 grid's ids, and a DiT sees the same scene tokens there as on the square; 'corner' (FLUX)
    does not. The extent can be given (context parallelism holds part of a sequence)."""
    from difftrain.models.dit import centred_ids
    from difftrain.tokens import image_ids

    sq = centred_ids(image_ids(3, 3)[None])
    wide = centred_ids(image_ids(3, 5)[None])
    middle = wide[0].reshape(3, 5, 3)[:, 1:4].reshape(9, 3)
    assert torch.equal(middle, sq[0]) and sq[0, 0].tolist() == [0.0, -1.0, -1.0]
    part = image_ids(3, 5)[None, :7]                                     # a rank's share of the sequence
    assert torch.equal(centred_ids(part, torch.tensor([[3, 5]])), wide[:, :7])
    torch.manual_seed(0)
    outs = {}
    for positions in ("centre", "corner"):
        p = DiTParams(in_channels=8, text_dim=8, pooled_dim=4, hidden=32, heads=2, double_blocks=1, single_blocks=1,
                      axes_dims_rope=(4, 6, 6), abs_pos_embed=True, positions=positions)
        m = MMDiT(p).eval()
        m.init_weights("default")
        scene = torch.randn(1, 9, 8)
        canvas = torch.zeros(1, 3, 5, 8)
        canvas[:, :, 1:4] = scene.reshape(1, 3, 3, 8)
        txt, t, pooled = torch.randn(1, 4, 8), torch.tensor([0.5]), torch.randn(1, 4)
        with torch.no_grad():
            a = m(scene, image_ids(3, 3)[None], txt, t, pooled)
            b = m(canvas.reshape(1, 15, 8), image_ids(3, 5)[None], txt, t, pooled).reshape(1, 3, 5, 8)[:, :, 1:4]
        outs[positions] = (a.reshape(1, 3, 3, 8) - b).abs().max()
    assert outs["centre"] < outs["corner"]          # the margins still attend, so not identical; far closer
    with pytest.raises(ValueError, match="positions"):
        DiTParams(positions="middle")
