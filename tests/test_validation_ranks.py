"""The validation loss over data-parallel ranks: each rank reads and forwards its share of the set, the sums are added,
and the figure equals one process's. A row one rank cannot read is a verdict every rank hears before any forward:
every rank skips that validation the same way and training goes on (before, the rank that lost rows ran fewer
forwards or raised alone, and the other waited in an FSDP collective until the timeout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from test_rare_events import _two_ranks, store_cfg
from test_store_loader import make_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("valranks"))


def _cfg(store: str, parallel: dict | None = None):
    cfg = store_cfg(store, parallel=parallel, steps=4, checkpoint_every=0, async_checkpoint=False)
    cfg.validation.every, cfg.validation.source, cfg.validation.n, cfg.validation.timesteps = 2, "curated", 5, 2
    return cfg


def _val_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "val_loss" in r or "val_skipped" in r}


def _worker(rank: int, world: int, port: int, store: str, out: str, faults: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DIFFTRAIN_FAULTS=faults)
    torch.set_num_threads(1)
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer

    cfg = _cfg(store, {"dp_shard": 2})
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    forwards = []
    validate = tr._validate

    def counted():
        validate()
        forwards.append((tr.step, tr.val_forwards, tr.val_values))
        tr.val_forwards = 0

    tr._validate = counted
    result = {"rank": rank, "steps": tr.fit()["steps"], "forwards": [(s, n) for s, n, v in forwards if v],
              "values": {s: v for s, n, v in forwards if v}}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    tr.close()
    os._exit(0)


def test_two_ranks_share_the_set_and_agree_with_one(store, tmp_path, monkeypatch):
    from difftrain.train import build_trainer

    monkeypatch.setenv("DIFFTRAIN_FAULTS", "")
    one = build_trainer(_cfg(store), tmp_path / "one")
    one.fit()
    whole = one.val_forwards
    one.close()
    want = _val_rows(tmp_path / "one")
    assert sorted(want) == [2, 4] and whole >= 2
    _two_ranks(_worker, (store, str(tmp_path / "two"), ""), 180, "a rank was left waiting in validation")
    got = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        assert g["steps"] == 4
        assert [n for _, n in g["forwards"]] == [-(-whole // 2)] * 2, got        # its share, not the whole set
    rows = _val_rows(tmp_path / "two" / "run")
    for step in (2, 4):
        for key in ("val_loss", "val_loss_t0", "val_loss_t1"):
            assert rows[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert got[0]["values"][str(step)]["val_loss"] == got[1]["values"][str(step)]["val_loss"]


def test_rows_one_rank_cannot_read_skip_the_validation_on_every_rank(store, tmp_path):
    """Rank 1's share of the set at step 2 reads as damaged: both ranks skip that validation (no forward, no hang),
    the run logs it and goes on, and step 4's validation runs on both."""
    _two_ranks(_worker, (store, str(tmp_path), "valunreadable@2:1"), 180,
               "a rank was left waiting: the ranks did not hear the same verdict on the validation's reads")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        assert g["steps"] == 4
        assert g["values"]["2"] == {"val_skipped": 1}, got
        assert "val_loss" in g["values"]["4"], got
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e.get("kind") == "validation_skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 2 and skipped[0]["unreadable"] > 0, skipped
    rows = _val_rows(tmp_path / "run")
    assert rows[2].get("val_skipped") == 1 and "val_loss" in rows[4]
