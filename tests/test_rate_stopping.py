"""Adaptive stopping in the rating app (``difftrain_rate.stopping``): an item stops being served once its answers
settle it, so obvious items take fewer raters and contested ones up to R; on a real SQLite and PostgreSQL database
migrated by Alembic, through the app's serving and answering code."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from difftrain_rate.assign import answer, next_item, undo
from difftrain_rate.batches import import_batch
from difftrain_rate.cli import _batch_settings
from difftrain_rate.db import Answer, Database, Item, RatingBatch, User, _alembic_config, upgrade
from difftrain_rate.errors import RateError
from difftrain_rate.report import batch_progress, judgements
from difftrain_rate.stopping import settled, wilson_lower

from rate_helpers import add_users, candidates_folder, database_url, sign_in

RATERS = ("r1", "r2", "r3", "r4", "r5")


def test_wilson_bound_and_what_settles_a_pair():
    assert wilson_lower(0, 0, 0.9) == 0.0
    assert wilson_lower(2, 2, 0.9) == pytest.approx(0.5487, abs=1e-3)     # two agreeing answers
    assert wilson_lower(2, 2, 0.95) < 0.5 < wilson_lower(3, 3, 0.95)
    h = ["a", "b"]
    a_wins, b_wins = (["a", "b"], "ranked"), (["b", "a"], "ranked")
    assert settled([a_wins, a_wins], h, 2, 0.9) and not settled([a_wins, a_wins], h, 2, 0.95)
    assert settled([a_wins] * 3, h, 2, 0.95)
    assert not settled([a_wins], h, 2, 0.5001)                            # below the least raters
    assert not settled([a_wins, a_wins, b_wins], h, 2, 0.9)              # split: contested
    assert not settled([(["a", "b"], "ranked"), ([], "tie"), ([], "tie")], h, 2, 0.9)   # called equal
    assert not settled([a_wins, ([], "skip"), ([], "skip")], h, 2, 0.9)  # a skip is no answer
    # a ranking: every pair must be decided (here c against b is not)
    k3 = ["a", "b", "c"]
    assert settled([(["a", "b", "c"], "ranked")] * 3, k3, 2, 0.9)
    assert not settled([(["a", "b", "c"], "ranked"), (["a", "c", "b"], "ranked"), (["a", ["b", "c"]], "ranked")],
                       k3, 2, 0.9)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    url, drop = database_url(request.param, tmp_path)
    upgrade(url)
    d = Database(url)
    add_users(d, *RATERS)
    yield d
    d.engine.dispose()
    drop()


def _ids(db) -> dict[str, int]:
    with db.read() as s:
        return {u.name: u.id for u in s.scalars(select(User)).all()}


def _rate(db, ids, prefer) -> int:
    """Every rater takes items until none is left, answering ``prefer(prompt, rater)`` (the candidate index it puts
    first). Returns the answers given."""
    n = 0
    for name in RATERS:
        for step in range(50):
            served = next_item(db, ids[name])
            if served is None:
                break
            handles = {c: v[0] for c, v in zip(("0", "1"), served.item.images)}
            first = handles[str(prefer(served.item.prompt_id, name))]
            order = [first] + [h for h in handles.values() if h != first]
            answer(db, ids[name], served.assignment, f"{name}-{step}", order, "ranked", {})
            n += 1
    return n


def test_obvious_items_stop_early_and_contested_ones_get_up_to_r(db, tmp_path):
    # 6 prompts of 2 candidates (one item each); R = 5 at most, 2 at least, confidence 0.9
    made = import_batch(db, "adaptive", [str(candidates_folder(tmp_path / "c", prompts=6, k=2))], raters=5,
                        min_raters=2, stop_confidence=0.9, seed=0)
    assert made["min_raters"] == 2 and made["stop_confidence"] == 0.9
    ids = _ids(db)
    contested = {"p001", "p003"}            # raters split on these; everyone prefers candidate 0 of the others
    given = _rate(db, ids, lambda pid, name: (RATERS.index(name) % 2) if pid in contested else 0)
    with db.read() as s:
        per_item = dict(s.execute(select(Item.prompt_id, func.count(Answer.id)).join(Answer, Answer.item_id == Item.id)
                                  .group_by(Item.prompt_id)).all())
        settled_items = {i.prompt_id for i in s.scalars(select(Item).where(Item.settled.is_(True))).all()}
        progress = batch_progress(s, s.scalar(select(RatingBatch)))
    assert per_item == {f"p{p:03d}": (5 if f"p{p:03d}" in contested else 2) for p in range(6)}
    assert settled_items == {f"p{p:03d}" for p in range(6)} - contested
    assert given == 4 * 2 + 2 * 5 == progress["answers"] and progress["target"] == 30
    assert progress["complete"] == 6 and progress["settled"] == 4 and progress["given_up"] == 0
    with db.read() as s:
        cost = judgements(s, s.scalar(select(RatingBatch)))
    assert cost["judgements"] == cost["answers"] == 18 and cost["gold"] == 0   # a pairwise answer is 1 judgement
    assert sum(cost["by_rater"].values()) == 18 and cost["by_rater"]["r5"] == 2           # r5: the contested two
    # the admin page says so
    from fastapi.testclient import TestClient

    from difftrain_rate.app import create_app

    add_users(db, "root", role="admin")
    admin = TestClient(create_app(db.url))
    assert sign_in(admin, "root").status_code == 303
    page = admin.get("/admin")
    assert page.status_code == 200 and "6 / 6 (4 settled early)" in page.text and "18 / 30 at most" in page.text
    # undo: the last answer of a settled item taken back, the item is open again and served to the next rater
    first = ids["r1"]
    item_id = undo(db, ids["r2"])                            # r2's last answer: the last item r2 rated
    with db.read() as s:
        item = s.get(Item, item_id)
    assert item.prompt_id not in contested and not item.settled
    assert next_item(db, first) is None                      # r1 answered every item already
    served = next_item(db, ids["r2"])                        # the reopened assignment is r2's again
    assert served.item.id == item_id


def test_a_batch_of_fixed_r_is_served_as_before(db, tmp_path):
    made = import_batch(db, "fixed", [str(candidates_folder(tmp_path / "c", prompts=3, k=2))], raters=3, seed=0)
    assert "stop_confidence" not in made
    given = _rate(db, _ids(db), lambda pid, name: 0)        # unanimous, and still R = 3 each
    with db.read() as s:
        assert not s.scalars(select(Item).where(Item.settled.is_(True))).all()
    assert given == 9


def test_answers_are_counted_as_pairwise_judgements(db, tmp_path):
    """A ranking of K is K - 1 judgements, a tie 1, a skip none; gold items count (they were spent)."""
    folder = candidates_folder(tmp_path / "c", prompts=3, k=3)
    rows = [json.loads(x) for x in (folder / "candidates.jsonl").read_text().splitlines()]
    gold = tmp_path / "gold.jsonl"
    p0 = [r["id"] for r in rows if r["prompt_id"] == "p000"]
    gold.write_text(json.dumps({"prompt_id": "p000", "order": p0}) + "\n")
    import_batch(db, "ranks", [str(folder)], "ranking", raters=2, gold_rate=0.5, gold=str(gold), seed=0)
    ids = _ids(db)
    spent = {}
    for name, outcomes in (("r1", ["ranked", "ranked", "ranked"]), ("r2", ["skip", "ranked", "ranked"])):
        spent[name] = 0
        for step, outcome in enumerate(outcomes):
            served = next_item(db, ids[name])
            if served is None:
                break
            order = [v[0] for v in served.item.images] if outcome == "ranked" else []
            answer(db, ids[name], served.assignment, f"{name}-{step}", order, outcome, {})
            spent[name] += 2 if outcome == "ranked" else 0
    with db.read() as s:
        batch = s.scalar(select(RatingBatch).where(RatingBatch.name == "ranks"))
        cost = judgements(s, batch)
        n_gold = s.scalar(select(func.count(Answer.id)).join(Item, Item.id == Answer.item_id)
                          .where(Item.batch_id == batch.id, Item.gold.is_not(None), Answer.outcome != "skip"))
    assert cost["by_rater"] == spent and cost["judgements"] == sum(spent.values()) > 0
    assert cost["gold"] == 2 * n_gold


def test_bad_stopping_settings_are_refused_naming_the_option(tmp_path):
    url = str(tmp_path / "rate.db")
    upgrade(url)
    db = Database(url)
    folder = str(candidates_folder(tmp_path / "c", prompts=2, k=2))
    for kwargs, match in (({"stop_confidence": 0.5}, "--stop-confidence 0.5"),
                          ({"stop_confidence": 1.0}, "--stop-confidence 1.0"),
                          ({"stop_confidence": 0.9, "min_raters": 4}, "--min-raters 4: expected 1..3"),
                          ({"stop_confidence": 0.9, "min_raters": 0}, "--min-raters 0"),
                          ({"min_raters": 2}, "--min-raters 2: only with --stop-confidence")):
        with pytest.raises(RateError, match=match):
            import_batch(db, "bad", [folder], raters=3, **kwargs)
    with db.read() as s:
        assert s.scalars(select(RatingBatch)).all() == []          # nothing half-made
    (tmp_path / "c" / "batch.json").write_text(json.dumps({"stop_confidence": "high"}))
    with pytest.raises(RateError, match="batch.json: stop_confidence 'high'"):
        _batch_settings(tmp_path / "c", tmp_path)
    (tmp_path / "c" / "batch.json").write_text(json.dumps({"raters": 4, "stop_confidence": 0.95, "min_raters": 3}))
    assert _batch_settings(tmp_path / "c", tmp_path)["stop_confidence"] == 0.95


def test_a_database_at_the_previous_schema_is_upgraded_in_place(tmp_path):
    from alembic import command

    url = str(tmp_path / "rate.db")
    command.upgrade(_alembic_config(url), "0003")
    import sqlite3

    raw = sqlite3.connect(url)
    raw.execute("insert into batches (id, name, kind, folders, models, raters, gold_rate, questions, status, "
                "created_at) values (1, 'old', 'pairwise', '[]', '[]', 3, 0.0, '[\"overall\"]', 'open', 0)")
    raw.execute("insert into items (id, batch_id, prompt_id, prompt, task, images, context, frames, seq) "
                "values ('i1', 1, 'p0', 'a red circle', 't2i', '[]', '[]', 1, 0)")
    raw.commit()
    raw.close()
    upgrade(url)
    db = Database(url)
    db.check()
    with db.read() as s:
        batch, item = s.get(RatingBatch, 1), s.get(Item, "i1")
    assert batch.stop_confidence is None and batch.min_raters is None and item.settled is False
