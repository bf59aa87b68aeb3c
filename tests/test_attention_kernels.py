"""Attention backends: the registry's constraints, every backend this machine runs equal to the math kernel
(forward and gradients), per-shape dispatch, the tuner and its cache, refusals, and a run with the hybrid."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from difftrain.errors import UserError
from difftrain.models.kernels import BACKENDS, HybridKernel, Shape, require
from difftrain.parallel import tune as tuner

CPU = torch.device("cpu")


def test_constraints_say_why_a_backend_cannot_run_a_shape():
    s = Shape(2, 4, 40, 32, "fp32", masked=True)
    assert BACKENDS["sdpa"].check(s, CPU, training=True) is None
    assert BACKENDS["sdpa-flash"].check(s, CPU, training=True) is None
    assert "runs on cuda" in BACKENDS["sdpa-efficient"].check(s, CPU, True)
    assert "no backward on cpu" in BACKENDS["flex"].check(s, CPU, training=True)
    assert BACKENDS["flex"].check(s, CPU, training=False) is None                 # inference only on a CPU
    assert "not installed" in BACKENDS["flash-attn"].check(s, CPU, True) or \
        "takes no key mask" in BACKENDS["flash-attn"].check(s, CPU, True)
    assert "head dims up to 256" in BACKENDS["sdpa-flash"].check(Shape(1, 1, 8, 320), CPU, False)
    # What the GPU kernels declare (checked on a GPU by the suite): half precision, capability, masks.
    assert BACKENDS["sdpa-cudnn"].dtypes == ("bf16", "fp16") and BACKENDS["sdpa-cudnn"].min_capability == (8, 0)
    assert BACKENDS["sdpa-fa3"].min_capability == (9, 0) and BACKENDS["sdpa-fa4"].min_capability == (10, 0)
    assert not BACKENDS["flash-attn"].masks and BACKENDS["sdpa-efficient"].masks


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_backend_this_machine_runs_matches_the_math_kernel(masked, dtype):
    shape = Shape(2, 3, 37, 16, dtype, masked)
    ran = []
    for name, b in BACKENDS.items():
        for training in (True, False):
            if b.check(shape, CPU, training) is None:
                ok, err = tuner.verify(name, shape, CPU, training)
                assert ok, (name, training, err)
                ran.append((name, training))
    assert ("sdpa-flash", True) in ran and ("sdpa", True) in ran
    if dtype == "fp32":
        assert ("flex", False) in ran


def test_a_wrong_kernel_is_caught_by_the_math_check(monkeypatch):
    from dataclasses import replace

    def off(q, k, v, mask):                    # attention that ignores the key mask
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    monkeypatch.setitem(BACKENDS, "broken", replace(BACKENDS["sdpa"], name="broken", run=off))
    ok, err = tuner.verify("broken", Shape(3, 2, 30, 16, "fp32", True), CPU, True)
    assert not ok and err > 1e-2
    results = tuner.tune([Shape(3, 2, 30, 16, "fp32", True)], CPU, True, backends=["sdpa", "broken"], reps=1)
    r = next(iter(results.values()))
    assert r["winner"] == "sdpa" and "differs from sdpa-math" in r["rejected"]["broken"]


def test_the_hybrid_dispatches_each_shape_to_its_winner(monkeypatch):
    from dataclasses import replace

    calls = []
    for name in ("sdpa-math", "sdpa-flash"):
        inner = BACKENDS[name].run
        monkeypatch.setitem(BACKENDS, name, replace(BACKENDS[name],
                                                    run=lambda q, k, v, m, n=name, f=inner: (calls.append(n),
                                                                                           f(q, k, v, m))[1]))
    a, b = Shape(1, 2, 24, 16), Shape(1, 2, 40, 16, masked=True)
    hybrid = HybridKernel({a.key: "sdpa-math", b.key: "sdpa-flash"})
    q = torch.randn(1, 2, 24, 16)
    hybrid(q, q, q, None)
    q2 = torch.randn(1, 2, 40, 16)
    hybrid(q2, q2, q2, torch.ones(1, 1, 1, 40, dtype=torch.bool))
    hybrid(torch.randn(3, 2, 24, 16), q.repeat(3, 1, 1, 1), q.repeat(3, 1, 1, 1), None)   # another batch: same key
    out = hybrid(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), None)   # untuned
    assert calls == ["sdpa-math", "sdpa-flash", "sdpa-math"] and out.shape == (1, 2, 8, 16)


def test_the_cache_is_reused_under_its_key_and_retuned_under_another(tmp_path, monkeypatch, caplog):
    path = tmp_path / "tune.json"
    shapes = [Shape(2, 2, 24, 16), Shape(2, 2, 40, 16, masked=True)]
    first = tuner.tune(shapes, CPU, True, path, backends=["sdpa", "sdpa-math", "sdpa-flash"], reps=1)
    data = json.loads(path.read_text())
    assert data["key"]["dtype"] == "fp32" and data["key"]["torch"] == torch.__version__ and set(data["shapes"]) == \
        {s.key for s in shapes}
    monkeypatch.setattr(tuner, "time_backend", lambda *a, **k: pytest.fail("timed again despite the cache"))
    assert tuner.tune(shapes, CPU, True, path, reps=1) == first
    # Another key (here: the torch version the cache records) is ignored with a warning and tuned again.
    data["key"]["torch"] = "0.0.1"
    path.write_text(json.dumps(data))
    timed = []
    monkeypatch.setattr(tuner, "time_backend", lambda name, *a, **k: timed.append(name) or 1.0)
    with caplog.at_level(logging.WARNING, logger="difftrain"):
        tuner.tune(shapes, CPU, True, path, backends=["sdpa"], reps=1)
    assert timed and "tuned for another setup (torch: '0.0.1' -> " in caplog.text
    assert json.loads(path.read_text())["key"]["torch"] == torch.__version__


def test_refusals_name_the_key_and_what_would_work(tiny_cfg):
    shapes = tuner.attention_shapes(tiny_cfg(), 4)
    with pytest.raises(UserError, match=r"attention.backend = 'nope': no such backend; the backends are \["):
        require("nope", shapes, CPU, True)
    with pytest.raises(UserError, match=r"'sdpa-efficient' runs on cuda, not cpu \(shape H2-L.*backends that can: "
                                        r"\['sdpa', 'sdpa-math', 'sdpa-flash'\]"):
        require("sdpa-efficient", shapes, CPU, True)
    with pytest.raises(UserError, match="'flex' has no backward on cpu .*training"):
        require("flex", shapes, CPU, True)
    assert require("flex", shapes, CPU, False).name == "flex"        # sampling may use it


def test_shapes_cover_tasks_text_rungs_and_cp_heads(tiny_cfg):
    cfg = tiny_cfg("text.max_tokens=16")
    shapes = tuner.attention_shapes(cfg, 4, cp=2)
    from difftrain.parallel.memory import task_shapes

    per_frame = task_shapes(cfg)["t2i"][0]                    # image tokens of one frame
    assert {s.length for s in shapes} == {n * per_frame + t for n in (1, 2, 3) for t in (8, 16)}
    assert {s.heads for s in shapes} == {1} and {s.head_dim for s in shapes} == {16} and all(s.masked for s in shapes)
    padded = tuner.attention_shapes(tiny_cfg("text.padding=padded"), 4)
    assert {s.length - 16 for s in padded} == {n * per_frame for n in (1, 2, 3)} and not any(s.masked for s in padded)


def test_a_run_with_the_hybrid_trains_as_sdpa_does(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    losses = {}
    for backend in ("sdpa", "auto", "sdpa-math"):
        cfg = tiny_cfg(f"attention.backend={backend}", "train.steps=3", "train.checkpoint_every=0",
                       "train.threads=1")
        tr = build_trainer(cfg, tmp_path / backend)
        tr.fit()
        rows = [json.loads(x) for x in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
        losses[backend] = [r["loss"] for r in rows if "loss" in r]
        if backend == "auto":
            table = json.loads((tmp_path / "auto" / "attention_tune.json").read_text())["shapes"]
            assert table and all(r["winner"] in ("sdpa", "sdpa-math", "sdpa-flash") for r in table.values())
            assert tr.attention["table"] == {k: r["winner"] for k, r in table.items()}
    for backend in ("auto", "sdpa-math"):
        assert losses[backend] == pytest.approx(losses["sdpa"], rel=1e-4), backend


def test_store_shapes_are_the_loaders_cost_balanced_micro_batches(tiny_cfg):
    """micro_batch 0 (the store source): each bucket's share of a rank cut as the loader cuts it, per frames."""
    stages = ('[{name = "s", start_step = 0, buckets = [[32, 32], [64, 64]], global_batch = 16, '
              'micro_cost = 40}]')
    cfg = tiny_cfg("text.max_tokens=8", "autoencoder.factor=8", f"data.stages={stages}", "data.source=store",
                   "data.store=/nowhere")
    assert tuner.micro_batches(8, 3) == {2, 3} and tuner.micro_batches(8, 8) == {8} and tuner.micro_batches(5, 1) == {1}
    got = {(s.length - 8, s.batch) for s in tuner.attention_shapes(cfg, 0, dp_size=2)}
    # 32x32 at 16 px a token: 4 tokens a frame; 64x64: 16. A rank's share is 8; micro_cost 40 / tokens.
    want = set()
    for per_frame in (4, 16):
        for frames in {1, 2, cfg.data.frames}:      # t2i; edit (source, target); keyframes
            n = frames * per_frame
            want |= {(n, b) for b in tuner.micro_batches(8, max(1, min(8, 40 // n)))}
    assert got == want, (sorted(got), sorted(want))
    assert {b for _, b in got} > {1}
