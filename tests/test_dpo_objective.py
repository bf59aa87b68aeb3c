"""The Diffusion-DPO objective on a tiny DiT, in one process: log 2 at the reference, the gradient, symmetry,
the reference's frozen state and the step's normalisation by the global pair count."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from difftrain.data.batch import assemble
from difftrain.diffusion.dpo import dpo_terms, summarize
from difftrain.diffusion.flow import FlowSpec
from difftrain.models import build_dit
from difftrain.models.dit import DiTParams
from difftrain.models.text import WordTextEncoder
from difftrain.train.objectives import Denoiser, DiffusionDPO

VOCAB = ["a", "small", "big", "red", "blue", "circle", "square", "in", "the", "top", "left", "right"]
PROMPTS = ["a small red circle", "a big blue square in the top left", "a red square", "a blue circle in the right"]


def _model(seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    text = WordTextEncoder(VOCAB, max_tokens=8, dim=16, layers=1, padding="masked")
    p = DiTParams(in_channels=12, text_dim=16, pooled_dim=16, hidden=32, heads=2, double_blocks=1, single_blocks=1,
                  axes_dims_rope=(4, 6, 6))
    return nn.ModuleDict({"dit": build_dit(p, init="default", seed=seed), "text": text})


def _pairs(n: int, seed: int = 1, same: bool = False):
    """A pair batch: n winners then n losers, 8x8 latents with 3 channels, pair ids 100.."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 1, 3, 8, 8, generator=g)
    lo = w.clone() if same else torch.randn(n, 1, 3, 8, 8, generator=g)
    prompts = PROMPTS[:n] * 2
    text = WordTextEncoder(VOCAB, max_tokens=8, dim=16, layers=1)
    b = assemble(torch.cat([w, lo]), [0], torch.ones(2 * n, 1, dtype=torch.bool), text.tokenize(prompts), prompts,
                 "t2i")
    b.sample_ids, b.pairs = [100 + i for i in range(n)] * 2, n
    return b


def _objective(policy: nn.ModuleDict, reference: nn.ModuleDict, beta: float = 500.0, sft: float = 0.0):
    pol = Denoiser(policy, policy["text"], torch.device("cpu"), None)
    ref = Denoiser(reference, reference["text"], torch.device("cpu"), None)
    return pol, DiffusionDPO(FlowSpec(timesteps="uniform"), beta, ref, sft)


def _frozen(model: nn.ModuleDict) -> nn.ModuleDict:
    return copy.deepcopy(model).eval().requires_grad_(False)


def _perturb(model: nn.ModuleDict, scale: float = 0.05, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_loss_is_log_2_when_the_policy_is_the_reference():
    policy = _model()
    pol, obj = _objective(policy, _frozen(policy))
    b = _pairs(4)
    micro = obj.loss(pol, b, seed=0, step=3, normalizer=4.0)
    assert micro.loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert torch.equal(micro.stats[:, 1], torch.zeros(4))                     # delta = 0 for every pair
    assert summarize(micro.stats)["implicit_acc"] == 0.0


def test_swapping_winner_and_loser_flips_delta_and_identical_images_give_zero():
    policy = _model()
    reference = _frozen(policy)
    _perturb(policy)
    pol, obj = _objective(policy, reference)
    b = _pairs(3)
    swapped = _pairs(3)
    swapped.x0_BLC = torch.cat([b.x0_BLC[3:], b.x0_BLC[:3]])
    d = obj.loss(pol, b, 0, 5, 3.0).stats[:, 1]
    d_swapped = obj.loss(pol, swapped, 0, 5, 3.0).stats[:, 1]
    assert d.abs().min() > 0
    torch.testing.assert_close(d_swapped, -d, rtol=1e-5, atol=1e-9)
    same = obj.loss(pol, _pairs(3, same=True), 0, 5, 3.0)
    assert torch.equal(same.stats[:, 1], torch.zeros(3))
    assert same.loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_the_reference_gets_no_gradient_and_the_policy_does():
    policy = _model()
    reference = _frozen(policy)
    reference.requires_grad_(True)            # even with requires_grad set, the reference's forward is no-grad
    _perturb(policy)
    pol, obj = _objective(policy, reference)
    obj.loss(pol, _pairs(2), 0, 0, 2.0).loss.backward()
    assert all(p.grad is None for p in reference.parameters())
    assert sum(float(p.grad.abs().sum()) for p in policy.parameters() if p.grad is not None) > 0


def test_the_pair_loss_gradient_matches_finite_differences():
    e = torch.rand(6, dtype=torch.float64, requires_grad=True)
    ref = torch.rand(6, dtype=torch.float64)
    torch.autograd.gradcheck(lambda x: dpo_terms(x, ref, 7.0).loss_P.sum(), (e,))
    # and through the model: the directional derivative along the gradient is the gradient's norm
    policy = _model()
    reference = _frozen(policy)
    _perturb(policy, 0.02)
    pol, obj = _objective(policy, reference, beta=50.0)
    b = _pairs(2)
    obj.loss(pol, b, 0, 1, 2.0).loss.backward()
    params = [p for p in policy.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    h = 1e-3

    def at(sign: float) -> float:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(sign * h * g / norm)
            value = obj.loss(pol, b, 0, 1, 2.0).loss.item()
            for p, g in zip(params, grads):
                p.sub_(sign * h * g / norm)
        return value

    fd = (at(1.0) - at(-1.0)) / (2 * h)
    assert fd == pytest.approx(norm, rel=0.03)


def test_a_step_loss_is_the_sum_of_pair_losses_over_the_global_pair_count():
    policy = _model()
    reference = _frozen(policy)
    _perturb(policy)
    pol, obj = _objective(policy, reference, beta=200.0)
    whole = _pairs(4)
    total = obj.loss(pol, whole, 0, 2, 4.0)
    per_pair = dpo_terms(obj.errors(pol, *_noised(obj, pol, whole)), obj.errors(obj.reference, *_noised(obj, pol, whole)),
                         200.0).loss_P
    assert total.loss.item() == pytest.approx(float(per_pair.detach().sum()) / 4, rel=1e-5)
    parts = []                               # two micro-batches of two pairs each, the same global count
    for lo in (0, 2):
        rows = [lo, lo + 1, 4 + lo, 4 + lo + 1]
        part = _pairs(4)
        part.x0_BLC, part.ids_BL3, part.loss_mask_BL = whole.x0_BLC[rows], whole.ids_BL3[rows], whole.loss_mask_BL[rows]
        part.tokens = {k: v[rows] for k, v in whole.tokens.items()}
        part.prompts = [whole.prompts[r] for r in rows]
        part.sample_ids, part.pairs = [whole.sample_ids[r] for r in rows], 2
        parts.append(obj.loss(pol, part, 0, 2, 4.0).loss.item())
    assert sum(parts) == pytest.approx(total.loss.item(), rel=1e-5)
    assert obj.count(whole) == 4.0


def _noised(obj, pol, b):
    from difftrain.diffusion.flow import draw_t_and_noise, noisy_input

    _, H, W = b.grid
    spec = obj.spec if obj is not None else FlowSpec(timesteps="uniform")
    t, eps = draw_t_and_noise(spec, 0, 2, b.sample_ids, tuple(b.x0_BLC.shape[1:]), (H // 2) * (W // 2))
    return b, noisy_input(b.x0_BLC, eps, t, b.loss_mask_BL), t, eps


def test_winner_and_loser_share_t_and_noise_and_the_sft_term_adds_the_winners_error():
    policy = _model()
    pol, obj = _objective(policy, _frozen(policy), sft=0.5)
    b = _pairs(2)
    _, xt, t, eps = _noised(obj, pol, b)
    assert torch.equal(t[:2], t[2:]) and torch.equal(eps[:2], eps[2:])
    e = obj.errors(pol, b, xt, t, eps)
    micro = obj.loss(pol, b, 0, 2, 2.0)
    assert micro.loss.item() == pytest.approx(math.log(2) + 0.5 * float(e[:2].sum()) / 2, rel=1e-5)


def test_the_replay_term_adds_the_replay_samples_mean_error_once_a_pair_from_their_own_draws():
    """dpo.replay_weight: each pair brings one sample of the base's kind of data; the term is the weight times their
    mean flow error, counted once a pair; their t and noise are drawn from their own ids with another seed, so the
    pairs' draws do not change; a batch without replay samples (validation's) gets the pairs' loss alone."""
    from difftrain.diffusion.flow import draw_t_and_noise, noisy_input

    policy = _model()
    pol, plain = _objective(policy, _frozen(policy))
    obj = DiffusionDPO(plain.spec, plain.beta, plain.reference, 0.0, replay_weight=3.0)
    b, r = _pairs(2), _pairs(2, seed=5)
    r.pairs, r.sample_ids = 0, [7, 8, 9, 10]                 # four samples of the base's kind, any task
    b.replay = r.rows(slice(0, 2))
    b.replay.sample_ids = [7, 8]
    _, H, W = r.grid
    t, eps = draw_t_and_noise(obj.spec, 0 + 1, 2, [7, 8], tuple(r.x0_BLC.shape[1:]), (H // 2) * (W // 2))
    rb = b.replay
    e_r = obj.errors(pol, rb, noisy_input(rb.x0_BLC, eps, t, rb.loss_mask_BL), t, eps)
    with_replay = obj.loss(pol, b, 0, 2, 4.0)
    without = plain.loss(pol, b, 0, 2, 4.0)
    assert with_replay.loss.item() == pytest.approx(without.loss.item() + 3.0 * float(e_r.mean()) * 2 / 4.0, rel=1e-5)
    assert float(e_r.mean()) > 0 and with_replay.tokens > without.tokens and with_replay.flops > without.flops
    assert torch.equal(with_replay.stats, without.stats)        # the pairs' own figures are untouched
    moved = b.to("cpu")                                          # the replay samples travel with the batch
    assert moved.replay is not None and torch.equal(moved.replay.x0_BLC, rb.x0_BLC)
    b.replay = None                                              # a validation batch: the pairs' loss alone
    assert obj.loss(pol, b, 0, 2, 4.0).loss.item() == pytest.approx(without.loss.item(), rel=1e-6)


def test_beta_must_be_positive_and_a_batch_must_hold_pairs():
    policy = _model()
    with pytest.raises(ValueError, match="beta = 0"):
        DiffusionDPO(FlowSpec(), 0.0, None)
    pol, obj = _objective(policy, _frozen(policy))
    b = _pairs(2)
    b.pairs = 0
    with pytest.raises(ValueError, match="needs a pair batch"):
        obj.loss(pol, b, 0, 0, 1.0)
    from difftrain.config import load_config
    from difftrain.errors import UserError
    with pytest.raises(UserError, match="dpo.beta"):
        load_config(None, ["dpo.beta=0"])


def test_with_lora_the_reference_is_the_policy_without_its_adapters():
    from difftrain.models.lora import adapters_disabled, apply_lora, is_lora

    policy = _model()
    b = _pairs(2)
    before = _objective(policy, _frozen(policy))[1].errors(Denoiser(policy, policy["text"], torch.device("cpu"), None),
                                                           *_noised(None, None, b))
    apply_lora(policy["dit"], 4, 4.0, ["qkv", "linear1"])
    policy["text"].requires_grad_(False)

    class Reference:                   # what the DPO run hands the objective with dpo.reference = "lora"
        def __init__(self, d):
            self.d = d

        def embed_text(self, batch):
            return self.d.embed_text(batch)

        def __call__(self, *args):
            with adapters_disabled(self.d.dit):
                return self.d(*args)

    pol = Denoiser(policy, policy["text"], torch.device("cpu"), None)
    obj = DiffusionDPO(FlowSpec(timesteps="uniform"), 500.0, Reference(pol))
    assert obj.loss(pol, b, 0, 2, 2.0).loss.item() == pytest.approx(math.log(2), abs=1e-6)   # lora_B starts at 0
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if is_lora(n):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    ref_errors = obj.errors(obj.reference, *_noised(None, None, b))
    torch.testing.assert_close(ref_errors, before, rtol=0, atol=0)          # adapters off: the base, exactly
    micro = obj.loss(pol, b, 0, 2, 2.0)
    assert micro.loss.item() != pytest.approx(math.log(2), abs=1e-4)
    micro.loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    assert all(g is None for n, g in grads.items() if not is_lora(n))       # the base and text encoder: frozen
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if is_lora(n))


def test_early_stopping_after_patience_validation_passes_without_gain():
    from types import SimpleNamespace

    from difftrain.config import load_config
    from difftrain.train.dpo import DPO

    t = DPO.__new__(DPO)                            # the stopping rule alone, on a scripted validation
    accs = iter([0.5, 0.6, 0.55, 0.6, 0.7])
    t.validate = lambda run: next(accs)
    t.val_best, t.val_bad_passes, t.val_history = None, 0, []
    logged = []

    class Metrics:
        def log(self, step, values):
            logged.append((step, values))

        def event(self, kind, step, **info):
            logged.append((step, kind))

    run = SimpleNamespace(cfg=load_config(None, ["dpo.validation_every=2", "dpo.patience=2"]), metrics=Metrics())
    stops = []
    for step in range(1, 11):
        stops.append(t.stop_early(run, step))
        if stops[-1]:
            break
    assert len(stops) == 8 and stops[-1] and not any(stops[:-1])    # step 8: 0.55 then 0.6 do not beat 0.6
    assert t.val_history == [[2, 0.5], [4, 0.6], [6, 0.55], [8, 0.6]] and (8, "early_stop") in logged


def test_a_pairs_file_is_checked_row_by_row_before_any_encoding(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from difftrain.data.store.pairs import PAIR_COLUMNS, EncodedPairs
    from difftrain.errors import UserError
    from difftrain.models.autoencoder import build_autoencoder

    Image.new("RGB", (16, 16), (120, 120, 120)).save(tmp_path / "a.png")
    row = {"pair_id": 0, "prompt_id": "p", "prompt": "a red circle", "task": "t2i", "winner": "p-0", "loser": "p-1",
           "winner_image": "a.png", "loser_image": "gone.png", "source_image": "", "winner_seed": 1, "loser_seed": 2,
           "agreement": 1.0, "raters": 1, "split": "train"}

    def write(rows, name="pairs.parquet"):
        types = {"int64": pa.int64(), "string": pa.string(), "double": pa.float64()}
        schema = pa.schema([(c, types[t]) for c, t in PAIR_COLUMNS.items()])
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / name)
        return tmp_path / name

    ae = build_autoencoder("pixel-unshuffle", 8)
    with pytest.raises(UserError, match=r"pairs.parquet: row 0 \(pair_id 0\): image .*gone.png not found"):
        EncodedPairs.load_or_encode(write([row]), ae, {})
    with pytest.raises(UserError, match=r"row 1 \(pair_id 0\): pair_id repeated"):
        EncodedPairs.load_or_encode(write([row, dict(row, loser_image="a.png")]), ae, {})
    with pytest.raises(UserError, match=r"row 0 \(pair_id 0\): task 'video'"):
        EncodedPairs.load_or_encode(write([dict(row, task="video")]), ae, {})
    with pytest.raises(UserError, match=r"row 0 \(pair_id 0\): an edit pair needs source_image"):
        EncodedPairs.load_or_encode(write([dict(row, task="edit")]), ae, {})
    assert not (tmp_path / "pairs.parquet.encoded").exists()           # nothing cached from a refused file
