"""The flow-matching validation loss: fixed noise and timesteps on a held-out split, so that it changes only
with the weights; logged in the step's metrics row (and so in TensorBoard and the report)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from difftrain.errors import UserError
from difftrain.train import build_trainer
from difftrain.train.objectives import Denoiser
from difftrain.train.validation import grid, shapes_batches, store_batches, validation_loss

from test_store_loader import make_cfg, make_store


def test_grid_is_fixed_midpoints():
    assert grid(4) == [0.125, 0.375, 0.625, 0.875]


def test_a_shapes_run_logs_validation_that_only_the_weights_move(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.steps=4", "validation.every=2", "validation.n=3", "validation.timesteps=3",
                   "train.checkpoint_every=0", "train.ema_decay=0.9")
    tr = build_trainer(cfg, tmp_path / "run")
    tr.fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(val) == [2, 4]
    for r in val.values():
        assert {"val_loss_t0", "val_loss_t1", "val_loss_t2", "val_loss_ema", "loss"} <= set(r)
        assert r["val_loss"] == pytest.approx(np.mean([r[f"val_loss_t{j}"] for j in range(3)]), abs=1e-5)
    assert val[2]["val_loss"] != val[4]["val_loss"]                  # the weights moved
    from difftrain.report import write_report
    write_report(tmp_path / "run")
    html = (tmp_path / "run" / "report" / "report.html").read_text()
    assert "validation loss (held out), step 4" in html and f"{val[4]['val_loss']:.4g}"[:5] in html
    assert (tmp_path / "run" / "tb").is_dir()                         # TensorBoard gets every numeric key
    # the same weights judged twice give the same figure; another noise seed another one
    batches = tr.val_batches
    assert {b.task for b in batches} == {"t2i", "edit", "keyframes"} and sum(len(b) for b in batches) == 9
    kf = next(b for b in batches if b.task == "keyframes")
    assert not kf.loss_mask_BL[:, : kf.x0_BLC.shape[1] // 3].any()   # eval.keyframe_given = first: frame 0 given
    den = Denoiser(tr.model, tr.text_encoder, tr.device, tr.amp, 1, 0, cfg.text.padding)
    tr.model.eval()
    a = validation_loss(den, batches, tr.flow, 3, 0)
    b = validation_loss(den, batches, tr.flow, 3, 0)
    c = validation_loss(den, batches, tr.flow, 3, 1)
    assert a == b and a[0] != c[0]
    assert a[0] == pytest.approx(val[4]["val_loss"], abs=1e-5)
    # the split is the evaluation world's (eval.seed), not the training world's scenes at the same indices
    from difftrain.shapes import world_from_config
    train_world, eval_world = world_from_config(cfg.data, cfg.run.seed), world_from_config(cfg.data, cfg.eval.seed)
    assert batches[0].prompts == [eval_world.t2i(i)[1] for i in range(3)]
    assert not np.array_equal(train_world.t2i(0)[0], eval_world.t2i(0)[0])
    assert shapes_batches(cfg, tr.autoencoder, tr.text_encoder.tokenize, 3)[0].prompts == batches[0].prompts
    tr.close()


def test_the_store_holds_out_the_validation_source(tmp_path):
    store = make_store(tmp_path)
    from difftrain.data.store.loader import StoreLoader
    cfg = make_cfg(store)
    cfg.validation.source, cfg.validation.n = "curated", 5
    loader = StoreLoader(cfg, lambda p: {"ids": torch.zeros(len(p), 4, dtype=torch.long)})
    assert all(s.source != "curated" for streams in loader.streams.values() for s in streams)
    curated = {sid for t in loader.tables.values() for sid in t.ids[slice(*t.spans["curated"])].tolist()}
    for _ in range(8):
        for b in next(loader):
            assert not set(b.sample_ids) & curated                        # never trained on
    stage, pairs, lost = store_batches(cfg, loader, 0)
    assert stage == "low" and pairs and lost == 0 and all(counts for _, counts in pairs)
    batches = [b for b, _ in pairs]
    # shared out over two ranks: the same micro-batches between them, each once (a share of one more is a repeat)
    halves = [store_batches(cfg, loader, 0, r, 2)[1] for r in range(2)]
    assert len(halves[0]) == len(halves[1]) == -(-len(batches) // 2)
    counted = sorted(i for h in halves for b, counts in h if counts for i in b.sample_ids)
    assert counted == sorted(i for b in batches for i in b.sample_ids)
    ids = [i for b in batches for i in b.sample_ids]
    assert set(ids) <= curated and len(ids) == len(set(ids))
    per_table = {}
    for b in batches:
        per_table[(b.task, b.grid)] = per_table.get((b.task, b.grid), 0) + len(b)
    assert max(per_table.values()) <= 5
    assert all(b.loss_mask_BL.any(1).all() for b in batches)
    loader.close()
    cfg.validation.every, cfg.validation.source = 5, ""
    with pytest.raises(UserError, match="needs validation.source"):
        StoreLoader(cfg)


def test_preview_rows_are_kept_without_pickle_and_a_damaged_file_costs_only_the_column(tmp_path):
    from difftrain.train.outputs import _load_rows, _save_rows

    rows = [([np.full((4, 4, 3), 7, np.uint8)], "a red circle"),
            ([np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8)], "make it blue")]
    _save_rows(rows, tmp_path / "p.npz")
    back = _load_rows(tmp_path / "p.npz")
    assert [p for _, p in back] == ["a red circle", "make it blue"] and [len(i) for i, _ in back] == [1, 2]
    assert all((a == b).all() for (x, _), (y, _) in zip(rows, back) for a, b in zip(x, y))
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not a zip")
    assert _load_rows(tmp_path / "bad.npz") is None
    (tmp_path / "pickle.npz").write_bytes(b"\x80\x04\x95")
    assert _load_rows(tmp_path / "pickle.npz") is None
