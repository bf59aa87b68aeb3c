"""The read-error budget under context parallelism: cp peers share a data-parallel rank and read the same rows, so
the budget counts each row once whatever cp is. The same bad rows stop a cp = 2 run at the step a cp = 1 run stops,
with the same counts in the error, and a cp = 2 run's saved counters resume on cp = 1 as they are."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from difftrain.errors import UserError

from test_rare_events import _two_ranks, store_cfg
from test_store_loader import make_store

BAD = "unreadable@1:*,unreadable@2:*,unreadable@3:*"     # every rank of the step meets the same damaged row


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("cpreads"))


def _cp_worker(rank: int, world: int, port: int, store: str, out: str, faults: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DIFFTRAIN_FAULTS=faults)
    torch.set_num_threads(1)
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer

    cfg = store_cfg(store, parallel={"cp": 2, "dp_shard": 1}, steps=steps, checkpoint_every=2,
                    async_checkpoint=False)
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    result = {"rank": rank}
    try:
        tr.fit()
        result.update(step=tr.step)
    except UserError as e:
        result.update(step=tr.step, error=str(e))
    result.update(read_errors=tr.loader.read_errors, samples_read=tr.loader.samples_read)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    tr.checkpointer.close()
    os._exit(0)


def _one_rank(store: str, run: Path, monkeypatch, faults: str, steps: int):
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", faults)
    return build_trainer(store_cfg(store, steps=steps, checkpoint_every=2, async_checkpoint=False), run)


def test_the_same_bad_rows_stop_cp2_where_they_stop_cp1(store, tmp_path, monkeypatch):
    one = _one_rank(store, tmp_path / "one" / "run", monkeypatch, BAD.replace(":*", ""), 6)
    with pytest.raises(UserError) as stopped:
        one.fit()
    want_step, want_error = one.step, str(stopped.value)
    assert (want_step, one.loader.read_errors, one.loader.samples_read) == (2, 3, 24)
    one.close()
    _two_ranks(_cp_worker, (store, str(tmp_path / "cp"), BAD, 6), 180, "a cp rank was left waiting")
    got = [json.loads((tmp_path / "cp" / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        assert g["step"] == want_step, got
        assert (g["read_errors"], g["samples_read"]) == (3, 24), got
        assert "3 of the 24 samples read so far" in g["error"], got
    assert want_error.split(";")[0] == got[0]["error"].split(";")[0]


def test_a_cp2_runs_read_counters_resume_on_cp1_unchanged(store, tmp_path, monkeypatch):
    """One bad row at step 1 on a cp = 2 run of 2 steps (its checkpoint at 2), resumed on one rank at cp = 1: the
    counters are a cp = 1 run's (1 bad of 16), and the resumed run goes on to its end."""
    _two_ranks(_cp_worker, (store, str(tmp_path), "unreadable@1:*", 2), 180, "a cp rank was left waiting")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all((g["step"], g["read_errors"], g["samples_read"]) == (2, 1, 16) for g in got), got
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", "")
    again = build_trainer(store_cfg(store, steps=4, checkpoint_every=2, async_checkpoint=False), tmp_path / "run",
                          allow_config_change=("parallel.cp", "parallel.dp_shard", "train.steps"))
    assert again.step == 2 and (again.loader.read_errors, again.loader.samples_read) == (1, 16)
    assert again.fit()["steps"] == 4 and (again.loader.read_errors, again.loader.samples_read) == (1, 32)
    again.close()


def test_counters_saved_at_cp_times_the_rows_come_back_as_rows():
    """A loader state written before the budget counted peers once (no ``reads_counted``) at cp = 2 held twice the
    rows; it is brought back to rows. A state that says it counts once, or was written at cp = 1, is left as it is."""
    from difftrain.train.trainer import _reads_counted_once

    old = {"kind": "store", "read_errors": 2, "samples_read": 32}
    assert _reads_counted_once(old, {"parallel": {"cp": 2}}) == {**old, "read_errors": 1, "samples_read": 16}
    assert _reads_counted_once(old, {"parallel": {"cp": 1}}) == old
    assert _reads_counted_once({**old, "reads_counted": "once"}, {"parallel": {"cp": 2}})["samples_read"] == 32
    assert _reads_counted_once({"kind": "shapes"}, {"parallel": {"cp": 2}}) == {"kind": "shapes"}
