"""Checkpoints that keep failing stop the run: ``train.max_failed_saves`` in a row (default 3) is a verdict every rank
hears in the step's collective, so every rank stops at the same step with the error named, instead of training on for
days with nothing to resume from (a failed background save was only logged). And the background writers' gloo group
keeps its own timeout (``train.checkpoint_timeout``) rather than the training collectives' ten minutes."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch

from difftrain.errors import UserError

from conftest import TINY
from test_rare_events import _two_ranks

RUN = TINY + ["train.global_batch=8", "train.threads=1", "train.steps=20", "train.checkpoint_every=1",
              "train.keep_checkpoints=5", "train.log_every=1"]


def test_blocking_saves_that_keep_failing_stop_the_run(tmp_path, monkeypatch):
    """One rank, blocking saves, every save from step 2 on fails (EIO): steps 2, 3 and 4 fail, and the run stops in
    step 5's reduction, before its update, naming the newest checkpoint a rerun resumes from."""
    from difftrain.config import load_config
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", "savefail@2")
    tr = build_trainer(load_config(None, RUN + ["train.async_checkpoint=false"]), tmp_path / "run")
    with pytest.raises(UserError, match=r"the last 3 checkpoints failed in a row \(this rank: .*Input/output error"
                                        r".*stops at step 4 .*Newest complete checkpoint: step_00000001"):
        tr.fit()
    assert tr.step == 4
    tr.close()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_failed"] == [2, 3, 4]
    assert [e["step"] for e in events if e["kind"] == "checkpoints_failing"] == [4]
    monkeypatch.setenv("DIFFTRAIN_FAULTS", "")
    again = build_trainer(load_config(None, RUN + ["train.async_checkpoint=false", "train.steps=3"]), tmp_path / "run",
                          allow_config_change=("train.steps",))
    assert again.step == 1                       # the storage mended: it resumes from the newest complete one
    again.close()


def test_a_save_that_fails_once_does_not_stop_the_run(tmp_path, monkeypatch):
    from difftrain.config import load_config
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", "enospc@2,enospc@4")       # failures, but never 3 in a row
    tr = build_trainer(load_config(None, RUN + ["train.async_checkpoint=false", "train.steps=6",
                                                "train.max_failed_saves=2"]), tmp_path / "run")
    assert tr.fit()["steps"] == 6 and tr.checkpointer.failed_in_row == 0
    tr.close()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DIFFTRAIN_FAULTS="savefail@2:1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from difftrain.config import load_config
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer

    created, tightened = [], []
    new_group, setter = dist.new_group, c10d._set_pg_timeout

    def recording_new_group(*a, **kw):
        group = new_group(*a, **kw)
        created.append((group, kw.get("timeout")))
        return group

    dist.new_group = recording_new_group
    c10d._set_pg_timeout = lambda timeout, group=None: tightened.append(group) or setter(timeout, group)
    cfg = load_config(None, RUN + ["train.async_checkpoint=true", "train.checkpoint_timeout=90",
                                   "parallel.dp_shard=2", "parallel.startup_steps=1"])
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    result = {"rank": rank}
    try:
        tr.fit()
        result["step"] = tr.step
    except UserError as e:
        result.update(step=tr.step, error=str(e))
    group = tr.checkpointer.group
    result["group_timeout_min"] = next((t / datetime.timedelta(minutes=1) for g, t in created if g is group), None)
    result["group_tightened"] = any(g is group for g in tightened)
    result["default_tightened"] = len(tightened) > 0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def test_background_saves_failing_on_one_rank_stop_every_rank_at_one_step(tmp_path):
    """Rank 1's writes fail from step 2 on; the saves are in the background, so each failure is known a step or more
    later. Both ranks stop at the same step, long before the run's 20, each with the error; the checkpoint writers'
    group was made with train.checkpoint_timeout and was not given the training collectives' timeout."""
    _two_ranks(_worker, (str(tmp_path),), 180, "a rank was left waiting: the ranks did not stop together")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["step"] == got[1]["step"] and got[0]["step"] < 10, got
    assert all("the last 3 checkpoints failed in a row" in g.get("error", "") for g in got), got
    assert "Input/output error" in got[1]["error"]
    for g in got:
        assert g["group_timeout_min"] == 90.0 and not g["group_tightened"] and g["default_tightened"], g
