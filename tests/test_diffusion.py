"""Rectified flow (timesteps, shift, noising, targets, losses), the Euler sampler and CFG, EMA and the LR
schedule. Convention: x_t = (1 - t) x0 + t eps, v = eps - x0, t = 1 is noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from difftrain.diffusion.flow import (T_MIN, FlowSpec, flow_loss, flux_mu, noisy_input, per_sample_error,
                                      sample_t, shift_factor, shift_t, to_velocity)
from difftrain.diffusion.sampler import euler_sample, guided, schedule
from difftrain.train.ema import EMA
from difftrain.train.schedule import lr_at


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------- timesteps


def test_sample_t_uniform():
    t = sample_t(20000, FlowSpec(timesteps="uniform"), 256, _gen(0))
    assert t.shape == (20000,)
    assert (t >= 0).all() and (t < 1).all()
    assert abs(t.mean().item() - 0.5) < 0.01
    assert abs(t.std().item() - math.sqrt(1 / 12)) < 0.01


@pytest.mark.parametrize("m", [0.0, 1.0])
def test_sample_t_logit_normal(m):
    t = sample_t(20000, FlowSpec(timesteps="logit-normal", logit_mean=m, logit_std=1.0), 256, _gen(1))
    assert (t > 0).all() and (t < 1).all()
    sig = 1 / (1 + math.exp(-m))
    assert abs(t.median().item() - sig) < 0.01
    # the logit of t is N(m, 1)
    logit = torch.log(t / (1 - t))
    assert abs(logit.mean().item() - m) < 0.03 and abs(logit.std().item() - 1.0) < 0.03


def test_sample_t_seeded_and_shifted():
    spec = FlowSpec(timesteps="logit-normal")
    assert torch.equal(sample_t(64, spec, 256, _gen(5)), sample_t(64, spec, 256, _gen(5)))
    assert not torch.equal(sample_t(64, spec, 256, _gen(5)), sample_t(64, spec, 256, _gen(6)))
    s = 3.0
    plain = sample_t(20000, spec, 256, _gen(2))
    shifted = sample_t(20000, FlowSpec(timesteps="logit-normal", shift="fixed", shift_value=s), 256, _gen(2))
    torch.testing.assert_close(shifted, s * plain / (1 + (s - 1) * plain))
    assert abs(shifted.median().item() - 0.75) < 0.01          # the median 1/2 moves to s/(1+s)
    res = sample_t(100, FlowSpec(timesteps="uniform", shift="resolution"), 4096, _gen(3))
    base = sample_t(100, FlowSpec(timesteps="uniform"), 4096, _gen(3))
    e = math.exp(1.15)
    torch.testing.assert_close(res, e / (e + (1 / base - 1)))
    with pytest.raises(ValueError):
        sample_t(4, FlowSpec(timesteps="beta"), 256)
    with pytest.raises(ValueError):
        sample_t(4, FlowSpec(shift="sideways"), 256)


@pytest.mark.parametrize("mu", [-0.4, 0.5, 1.15, 2.0])
def test_shift_t_is_fluxs_time_shift(mu):
    sigma = torch.linspace(0.01, 1.0, 100, dtype=torch.float64)
    flux = math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))          # FLUX time_shift(mu, 1.0, sigma)
    torch.testing.assert_close(shift_t(sigma, math.exp(mu)), flux, rtol=1e-12, atol=1e-12)


def test_shift_t_endpoints_and_identity():
    t = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    assert torch.equal(shift_t(t, 1.0), t)
    out = shift_t(t, 4.0)
    assert out[0] == 0 and out[2] == 1 and out[1] > 0.3


def test_flux_mu_and_shift_factor():
    assert flux_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert flux_mu(4096) == pytest.approx(1.15, abs=1e-12)
    assert flux_mu(2176) == pytest.approx((0.5 + 1.15) / 2, abs=1e-12)      # linear in between
    assert shift_factor("none", 7.0, 4096) == 1.0
    assert shift_factor("fixed", 7.0, 4096) == 7.0
    assert shift_factor("resolution", 7.0, 1024) == pytest.approx(math.exp(0.5 + 0.65 * 768 / 3840))


# -------------------------------------------------------------------------------------- noising, targets


def _data(B=3, L=8, C=4, seed=0):
    g = _gen(seed)
    return torch.randn(B, L, C, generator=g), torch.randn(B, L, C, generator=g)


def test_noisy_input_keeps_conditioning_clean():
    x0, eps = _data()
    t = torch.tensor([0.2, 0.7, 1.0])
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, :5] = True
    mask[2, :] = False
    mask[2, 0] = True                                   # every sample keeps at least one target
    xt = noisy_input(x0, eps, t, mask)
    assert torch.equal(xt[~mask], x0[~mask])
    want = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    torch.testing.assert_close(xt[mask], want[mask])
    assert torch.equal(xt[2, 0], eps[2, 0])            # t = 1 is pure noise


def test_to_velocity():
    x0, eps = _data(seed=1)
    t = torch.tensor([T_MIN, 0.3, 0.9])
    xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    torch.testing.assert_close(to_velocity(x0, xt, t, "x"), eps - x0, atol=1e-5, rtol=1e-5)
    out = torch.randn_like(x0)
    assert to_velocity(out, xt, t, "v") is out
    # exact in dyadic arithmetic
    x0d, epsd = torch.randint(-8, 8, (2, 4, 3)) / 4.0, torch.randint(-8, 8, (2, 4, 3)) / 4.0
    td = torch.tensor([0.5, 0.25])
    xtd = (1 - td.view(-1, 1, 1)) * x0d + td.view(-1, 1, 1) * epsd
    assert torch.equal(to_velocity(x0d, xtd, td, "x"), epsd - x0d)
    # below T_MIN the division is floored: finite at t = 0
    assert torch.isfinite(to_velocity(out, xt, torch.zeros(3), "x")).all()
    with pytest.raises(ValueError):
        to_velocity(out, xt, t, "eps")


def test_losses_ignore_unmasked_tokens_and_vanish_at_the_target():
    x0, eps = _data(seed=2)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, 3:] = True
    mask[2, :] = True
    perfect = eps - x0
    assert flow_loss(perfect, x0, eps, mask).item() == 0.0
    assert torch.equal(per_sample_error(perfect, x0, eps, mask), torch.zeros(3))

    pred = perfect + torch.randn(perfect.shape, generator=_gen(3))
    loss, per = flow_loss(pred, x0, eps, mask), per_sample_error(pred, x0, eps, mask)
    junk = pred.clone()
    junk[~mask] = 1e3
    assert torch.equal(flow_loss(junk, x0, eps, mask), loss)
    assert torch.equal(per_sample_error(junk, x0, eps, mask), per)
    moved = pred.clone()
    moved[mask] += 1.0
    assert flow_loss(moved, x0, eps, mask) != loss

    # values: per sample, the mean over its target tokens; the loss, the mean over all target tokens
    sq = (pred - perfect).pow(2).mean(-1)
    for b in range(3):
        assert per[b].item() == pytest.approx(sq[b][mask[b]].mean().item(), rel=1e-5)
    assert loss.item() == pytest.approx(sq[mask].mean().item(), rel=1e-5)
    counts = mask.sum(1).float()
    assert loss.item() == pytest.approx(((per * counts).sum() / counts.sum()).item(), rel=1e-5)


# ----------------------------------------------------------------------------------------------- sampler


def _exact_field(x_star: torch.Tensor):
    """The true velocity for data concentrated at x*: x_t = (1-t) x* + t eps  =>  v = (x_t - x*) / t."""
    def v(x, t):
        return (x - x_star) / t.view(-1, 1, 1)
    return v


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (4, 1.0), (10, 3.0), (7, 0.5)])
def test_euler_lands_on_the_single_data_point(steps, shift):
    x_star = torch.randn(2, 6, 4, generator=_gen(0))
    mask = torch.ones(2, 6, dtype=torch.bool)
    for seed in (1, 2):
        out = euler_sample(_exact_field(x_star), torch.zeros_like(x_star), mask, steps, shift, _gen(seed))
        assert (out - x_star).abs().max().item() < 1e-4


def test_euler_keeps_conditioning_tokens():
    x_star = torch.randn(2, 6, 4, generator=_gen(4))
    cond = torch.randn(2, 6, 4, generator=_gen(5))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, :4] = True
    seen = []

    def v(x, t):
        seen.append(x.clone())
        return _exact_field(x_star)(x, t)

    out = euler_sample(v, cond, mask, 5, 1.0, _gen(6))
    assert torch.equal(out[~mask], cond[~mask])
    assert all(torch.equal(x[~mask], cond[~mask]) for x in seen)       # the model sees them clean too
    assert (out[mask] - x_star[mask]).abs().max() < 1e-4
    assert len(seen) == 5


def test_euler_is_deterministic_per_seed():
    cond = torch.zeros(2, 5, 3)
    mask = torch.ones(2, 5, dtype=torch.bool)

    def v(x, t):
        return 0.5 * x - 0.1 * t.view(-1, 1, 1)

    a = euler_sample(v, cond, mask, 6, 2.0, _gen(11))
    b = euler_sample(v, cond, mask, 6, 2.0, _gen(11))
    c = euler_sample(v, cond, mask, 6, 2.0, _gen(12))
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3


def test_guided():
    g = _gen(7)
    v_c, v_u = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    calls = []

    def cu(x, t):
        calls.append((x, t))
        return v_c, v_u

    x, t = torch.zeros(2, 3, 4), torch.full((2,), 0.5)
    torch.testing.assert_close(guided(cu, 1.0)(x, t), v_c, atol=1e-6, rtol=0)
    torch.testing.assert_close(guided(cu, 0.0)(x, t), v_u, atol=1e-6, rtol=0)
    torch.testing.assert_close(guided(cu, 4.0)(x, t), v_u + 4.0 * (v_c - v_u))
    assert calls[0][0] is x and calls[0][1] is t


def test_schedule():
    for steps in (1, 5, 28):
        base = schedule(steps, 1.0)
        assert base.shape == (steps + 1,)
        assert base[0].item() == 1.0 and base[-1].item() == 0.0
        assert (base[1:] < base[:-1]).all()
        torch.testing.assert_close(base, torch.linspace(1, 0, steps + 1))
        for s in (1.5, 3.0):
            sh = schedule(steps, s)
            assert sh[0].item() == 1.0 and sh[-1].item() == 0.0
            assert (sh[1:] < sh[:-1]).all()
            assert (sh[1:-1] > base[1:-1]).all()                       # pushed toward noise
            torch.testing.assert_close(sh, (s * base / (1 + (s - 1) * base)).float())
    assert (schedule(5, 0.5)[1:-1] < schedule(5, 1.0)[1:-1]).all()
    with pytest.raises(ValueError):
        schedule(0)


# --------------------------------------------------------------------------------------------------- EMA


def _net(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net[1].bias.requires_grad_(False)                  # frozen: not tracked
    return net


def test_ema_update_with_warmup():
    net = _net()
    ema = EMA(net, decay=0.999)
    assert set(ema.shadow) == {"0.weight", "0.bias", "1.weight"}
    start = {k: v.clone() for k, v in ema.shadow.items()}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=_gen(1)))
    new = {k: v.detach().clone() for k, v in net.named_parameters()}
    ema.update()
    d = min(0.999, 1 / 10)                             # warm-up decay at the first update
    for k in ema.shadow:
        torch.testing.assert_close(ema.shadow[k], d * start[k] + (1 - d) * new[k])
    # second update, decay 2/11, toward an unchanged model
    prev = {k: v.clone() for k, v in ema.shadow.items()}
    ema.update()
    d2 = 2 / 11
    for k in ema.shadow:
        torch.testing.assert_close(ema.shadow[k], d2 * prev[k] + (1 - d2) * new[k])
    # a decay below the warm-up value wins
    other = _net()
    low = EMA(other, decay=0.05)
    with torch.no_grad():
        for name, p in other.named_parameters():
            p.copy_(new[name])
    low.update()
    torch.testing.assert_close(low.shadow["0.weight"], 0.05 * start["0.weight"] + 0.95 * new["0.weight"])


def test_ema_applied_swaps_and_restores_even_on_error():
    net = _net()
    ema = EMA(net, decay=0.5)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0).add_(1.0)
    live = {k: v.detach().clone() for k, v in net.named_parameters()}
    with ema.applied(net) as m:
        assert m is net
        for k, v in ema.shadow.items():
            assert torch.equal(dict(net.named_parameters())[k], v)
        assert torch.equal(net[1].bias, live["1.bias"])                # untracked stays
    for k, v in net.named_parameters():
        assert torch.equal(v, live[k])
    with pytest.raises(RuntimeError, match="boom"):
        with ema.applied(net):
            assert not torch.equal(net[0].weight, live["0.weight"])
            raise RuntimeError("boom")
    for k, v in net.named_parameters():
        assert torch.equal(v, live[k])


def test_ema_state_dict_round_trip():
    net = _net(0)
    ema = EMA(net, decay=0.9)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    ema.update()
    other = EMA(_net(1), decay=0.9)
    assert not torch.equal(other.shadow["0.weight"], ema.shadow["0.weight"])
    state = {k: v.clone() for k, v in ema.state_dict().items()}
    other.load_state_dict(state)
    for k in ema.shadow:
        assert torch.equal(other.shadow[k], ema.shadow[k])
    with pytest.raises(KeyError):
        other.load_state_dict({k: v for k, v in state.items() if k != "0.bias"})


# ------------------------------------------------------------------------------------------ LR schedule


def test_lr_warmup_is_linear():
    peak, warm = 1e-3, 10
    lrs = [lr_at(s, peak, 100, warm) for s in range(warm)]
    assert lrs[-1] == pytest.approx(peak)
    steps = [b - a for a, b in zip(lrs, lrs[1:])]
    assert all(x == pytest.approx(peak / warm) for x in steps)
    assert lrs[0] == pytest.approx(peak / warm)
    assert lr_at(warm, peak, 100, warm) == pytest.approx(peak)
    assert lr_at(0, peak, 100, 0) == pytest.approx(peak)               # no warmup: peak at once


def test_lr_cosine():
    peak, total, warm, r = 2e-4, 110, 10, 0.1
    assert lr_at(total, peak, total, warm, "cosine", r) == pytest.approx(r * peak)
    assert lr_at(total + 50, peak, total, warm, "cosine", r) == pytest.approx(r * peak)
    mid = warm + (total - warm) // 2
    assert lr_at(mid, peak, total, warm, "cosine", r) == pytest.approx(peak * (r + (1 - r) / 2))
    after = [lr_at(s, peak, total, warm, "cosine", r) for s in range(warm, total + 1)]
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert lr_at(total, peak, total, warm, "cosine", 0.0) == pytest.approx(0.0, abs=1e-15)


def test_lr_constant_and_unknown():
    peak = 3e-4
    assert all(lr_at(s, peak, 50, 5, "constant") == pytest.approx(peak) for s in range(5, 200))
    assert lr_at(2, peak, 50, 5, "constant") == pytest.approx(peak * 3 / 5)
    with pytest.raises(ValueError):
        lr_at(20, peak, 50, 5, "linear")


def test_x_prediction_sampling_lands_on_the_prediction_with_many_steps():
    """Sampling must not floor t like training does: a perfect x-predictor ends exactly on x*."""
    from difftrain.diffusion.pipeline import Pipeline  # noqa: F401  (the pipeline passes t_min=1e-6)
    torch.manual_seed(0)
    xs = torch.randn(1, 6, 4)
    for steps in (28, 50):
        out = euler_sample(lambda x, t: to_velocity(xs.expand_as(x), x, t, "x", t_min=1e-6),
                           torch.zeros(2, 6, 4), torch.ones(2, 6, dtype=torch.bool), steps, 1.0,
                           torch.Generator().manual_seed(1))
        assert (out - xs).abs().max() < 1e-4


def test_x_loss_is_the_v_loss_weighted_by_t_squared():
    from difftrain.diffusion.flow import loss_weight
    torch.manual_seed(0)
    x0, eps = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    t = torch.tensor([0.2, 0.5, 0.9])
    mask = torch.ones(3, 5, dtype=torch.bool)
    xt = noisy_input(x0, eps, t, mask)
    x_hat = x0 + 0.1 * torch.randn_like(x0)
    v = to_velocity(x_hat, xt, t, "x")
    weighted = flow_loss(v, x0, eps, mask, loss_weight(t, "x"))
    assert torch.allclose(weighted, (x_hat - x0).pow(2).mean(), atol=1e-6)
    # 'x/t': the x-MSE of each sample over its t
    per_t = flow_loss(v, x0, eps, mask, loss_weight(t, "x/t"))
    assert torch.allclose(per_t, ((x_hat - x0).pow(2).mean((1, 2)) / t).mean(), atol=1e-6)
    assert loss_weight(t, "v") is None
    with pytest.raises(ValueError):
        loss_weight(t, "eps")
