"""Rare events a weeks-long job meets: an unreadable row (the read-error budget is one figure over every rank, saved
and restored whole, and a decision every rank takes together), a changed length on resume (the LR schedule goes on
without a jump, or as planned for the new length, and says which), replayed steps (each shows once in
TensorBoard), an id served twice in one global batch (drawn apart)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from difftrain.config.load import from_dict
from difftrain.errors import UserError

from test_store_loader import FACTOR, STAGES, make_store

MODEL = {"hidden": 32, "heads": 2, "double_blocks": 1, "single_blocks": 1, "axes_dims_rope": [4, 6, 6]}


def store_cfg(store: str, parallel: dict | None = None, **train) -> object:
    return from_dict({
        "run": {"seed": 3}, "parallel": parallel or {},
        "model": MODEL, "text": {"dim": 16, "max_tokens": 16},
        "autoencoder": {"kind": "pixel-unshuffle", "factor": FACTOR},
        "data": {"source": "store", "store": store, "stages": STAGES, "frames": 3, "prefetch": 2,
                 "caption_dropout": 0.2, "max_error_rate": 0.01},
        "train": {"global_batch": 8, "steps": 4, "checkpoint_every": 2, "warmup_steps": 0, "log_every": 1,
                  "threads": 1, "ema_decay": 0.0, **train},
    })


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("rare"))


def _two_ranks(worker, args: tuple, limit_s: float, why: str) -> None:
    """``worker(rank, 2, port, *args)`` on two spawned gloo processes; fails with ``why`` (after killing them) when
    they have not both ended within ``limit_s``: a rank left waiting in a collective."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(worker, args=(2, port, *args), nprocs=2, join=False, start_method="spawn")
    t0 = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - t0 > limit_s:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(why)


def _trainer(cfg, run_dir, monkeypatch, faults=""):
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", faults)
    return build_trainer(cfg, run_dir)


def test_one_unreadable_row_neither_ends_the_run_nor_a_later_resume(store, tmp_path, monkeypatch):
    """Share 8, max_error_rate 0.01: one bad row at step 1 is within the budget (0.01 of the store's 288 rows);
    the run's totals go into the checkpoint whole and come back on resume, so the resumed run goes on."""
    tr = _trainer(store_cfg(store), tmp_path / "run", monkeypatch, "unreadable@1")
    tr.fit()
    assert (tr.loader.read_errors, tr.loader.samples_read) == (1, 32)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_errors"] for r in rows if "loss" in r] == [1, 1, 1, 1]
    tr.close()
    again = _trainer(store_cfg(store, steps=6), tmp_path / "run", monkeypatch, "unreadable@1")
    assert (again.loader.read_errors, again.loader.samples_read) == (1, 32)     # restored whole
    assert again.fit()["steps"] == 6 and again.loader.samples_read == 48
    again.close()


def test_past_the_budget_the_run_stops_naming_the_rows(store, tmp_path, monkeypatch):
    tr = _trainer(store_cfg(store, steps=6), tmp_path / "run", monkeypatch,
                  "unreadable@1,unreadable@2,unreadable@3")
    with pytest.raises(UserError, match=r"3 of the 24 samples read so far over every rank were unreadable \(> "
                                        r"data.max_error_rate = 0.01 of max\(rows read, the store's 288 rows\)\); "
                                        r"this rank's last: table low/"):
        tr.fit()
    assert tr.step == 2                                   # step 3 stopped before its optimizer step
    tr.close()


def _budget_worker(rank: int, world: int, port: int, store: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DIFFTRAIN_FAULTS="unreadable@1:1,unreadable@2:1,unreadable@3:1")
    torch.set_num_threads(1)
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer

    import torch.distributed.distributed_c10d as c10d

    timed, setter = [], c10d._set_pg_timeout
    c10d._set_pg_timeout = lambda timeout, group=None: timed.append(group) or setter(timeout, group)
    cfg = store_cfg(store, parallel={"startup_steps": 1}, steps=6, checkpoint_every=0)
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    result = {"rank": rank}
    try:
        tr.fit()
    except UserError as e:
        result.update(step=tr.step, error=str(e))
    # the collective timeout is tightened after the start-up steps; the checkpoint writers' gloo group keeps its own
    # (train.checkpoint_timeout: tests/test_failed_saves.py)
    result["checkpoint_group_timed"] = bool(timed) and tr.checkpointer.group is not None and not any(
        g is tr.checkpointer.group for g in timed)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)          # a peer may be gone: no clean process-group teardown


def test_the_budget_is_decided_by_every_rank_together(store, tmp_path):
    """Rank 1 alone meets three bad rows (its share is 4): the budget is the run's over both ranks, so both ranks
    stop at the same step with the same error, at once (a rank deciding alone would leave the other waiting in
    a collective until the timeout)."""
    _two_ranks(_budget_worker, (store, str(tmp_path)), 120, "a rank was left waiting: the ranks did not decide together")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["step"] == got[1]["step"] == 2, got
    assert all("3 of the 24 samples read so far over every rank" in g["error"] for g in got), got
    assert "this rank's last" in got[1]["error"] and "this rank's last" not in got[0]["error"]
    assert got[0]["checkpoint_group_timed"] and got[1]["checkpoint_group_timed"]


def test_replayed_steps_show_once_in_tensorboard(store, tmp_path, monkeypatch):
    """A restart from an earlier checkpoint replays steps 3..4: TensorBoard shows each step once, the replay's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _trainer(store_cfg(store), run, monkeypatch).fit()
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "checkpoints" / "latest").write_text("step_00000002")
    again = _trainer(store_cfg(store), run, monkeypatch)
    again.fit()
    replay = {json.loads(x)["step"]: json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)}
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss")]
    assert sorted(steps) == [1, 2, 3, 4], steps
    assert {e.step: e.value for e in acc.Scalars("loss")}[4] == pytest.approx(replay[4])
    again.close()


@pytest.mark.parametrize("mode", ["keep_lr", "follow"])
def test_a_changed_length_on_resume_continues_the_lr_as_the_key_says(store, tmp_path, monkeypatch, caplog, mode):
    run = tmp_path / "run"
    _trainer(store_cfg(store, steps=10, checkpoint_every=5), run, monkeypatch).fit()
    planned = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "lr" in r}
    shutil.rmtree(run / "checkpoints" / "step_00000010")
    (run / "checkpoints" / "latest").write_text("step_00000005")
    (run / "metrics.jsonl").unlink()
    cfg = store_cfg(store, steps=20, checkpoint_every=5, schedule_change=mode)
    with caplog.at_level(logging.WARNING, logger="difftrain"):
        tr = _trainer(cfg, run, monkeypatch)
    from difftrain.train.schedule import lr_at

    old, new = lr_at(5, cfg.train.lr, 10, 0, "cosine", cfg.train.min_lr_ratio), \
        lr_at(5, cfg.train.lr, 20, 0, "cosine", cfg.train.min_lr_ratio)
    assert f"changed from 10 to 20 steps at step 5: the LR there is {old:.4g} on the old schedule and {new:.4g} " \
           f"on the new one" in caplog.text
    tr.fit()
    lr = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    if mode == "keep_lr":
        assert lr[6] == pytest.approx(planned[6])           # no jump: the step the old plan would have taken
        assert all(lr[s] > lr[s + 1] for s in range(6, 20))
    else:
        assert lr[6] == pytest.approx(new) and lr[6] > planned[6] * 1.05
    assert lr[20] == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio, rel=0.1)     # the last step: near the end
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["mode"] for e in events if e["kind"] == "schedule_change"] == [mode]
    tr.close()


def test_an_id_twice_in_one_global_batch_is_drawn_apart(store):
    """A stream whose batch crosses an epoch boundary can hold an id twice in one global batch (the tail of one
    permutation and the head of the next): each slot is keyed by its repeat, so the two draw other noise and
    timestep; an id's first slot draws what it always drew."""
    from difftrain.data.store.loader import StoreLoader
    from difftrain.diffusion.flow import FlowSpec, draw_t_and_noise

    from test_store_loader import make_cfg, tokenize

    loader = StoreLoader(make_cfg(store, stages=STAGES[:1]), tokenize)   # low only: its 36-sample bucket's batches of
    found = 0                                                           # 8 cross an epoch every 4.5 batches
    for step in range(40):
        batches = next(loader)
        ids = [i for b in batches for i in b.sample_ids]
        reps = [r for b in batches for r in (b.repeats or [0] * len(b))]
        assert len(set(zip(ids, reps))) == len(ids)          # (id, repeat) is unique in the global batch
        if len(set(ids)) == len(ids):
            continue
        found += 1
        b = batches[0]
        shape = tuple(b.x0_BLC.shape[1:])
        t, eps = draw_t_and_noise(FlowSpec(), 3, step, ids, shape, 4, repeats=reps)
        dup = next(i for i in ids if ids.count(i) > 1)
        a, c = [j for j, i in enumerate(ids) if i == dup][:2]
        assert not torch.equal(eps[a], eps[c]) and t[a] != t[c]
        t0, eps0 = draw_t_and_noise(FlowSpec(), 3, step, [dup], shape, 4)
        assert torch.equal(eps0[0], eps[a])
    loader.close()
    assert found, "no global batch held an id twice: the store is not what this test needs"


def _alone_worker(rank: int, world: int, port: int, store: str, out: str, what: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DIFFTRAIN_FAULTS="sealfail@4" if what == "seal" else "")
    torch.set_num_threads(1)
    import errno

    from difftrain.parallel.dist import init_distributed
    from difftrain.parallel.stream_writer import SafetensorsStreamWriter
    from difftrain.train import build_trainer

    if what == "export" and rank == 0:
        def full_disk(self, name, t):
            raise OSError(errno.ENOSPC, "No space left on device")
        SafetensorsStreamWriter.write = full_disk
    cfg = store_cfg(store, steps=4, checkpoint_every=2, async_checkpoint=False)
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    result = {"rank": rank}
    t0 = time.monotonic()
    try:
        tr.fit()
    except UserError as e:
        result.update(error=str(e), after_s=time.monotonic() - t0)
    Path(out, f"{what}{rank}.json").write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.parametrize("what", ["seal", "export"])
def test_a_failure_on_rank_0_alone_is_an_error_on_every_rank_at_once(store, tmp_path, what):
    """Rank 0 seals checkpoints and writes the export alone; when that fails (here: ENOSPC), every rank ends with
    the error named, at once, instead of waiting in the next collective until the timeout. The failed checkpoint
    leaves the previous one intact."""
    _two_ranks(_alone_worker, (store, str(tmp_path), what), 150, f"{what}: a rank was left waiting for rank 0")
    got = [json.loads((tmp_path / f"{what}{r}.json").read_text()) for r in range(2)]
    want = ("checkpoint at step 4 failed, the previous one is intact: rank 0: " if what == "seal"
            else "export to ")
    for g in got:
        assert want in g.get("error", ""), got
        assert "No space left on device" in g["error"], got
    if what == "seal":
        from difftrain.train.checkpoint import Checkpointer

        assert Checkpointer(tmp_path / "run").latest().name == "step_00000002"
        assert not (tmp_path / "run" / "checkpoints" / "step_00000004.partial").exists()
