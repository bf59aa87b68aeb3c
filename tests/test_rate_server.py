"""The app as it runs: ``difftrain-rate serve`` with two uvicorn worker processes on SQLite and on PostgreSQL,
scripted raters answering at once through the HTTP API, then the server SIGKILLed mid-stream and started again:
every answered item is there, none twice, no item over its R raters."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from difftrain_rate.auth import new_token
from difftrain_rate.batches import import_batch
from difftrain_rate.client import RaterClient
from difftrain_rate.db import Answer, Assignment, Database, RatingBatch, upgrade

from rate_helpers import add_users, candidates_folder, database_url
from rate_server import Server

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_workers_concurrent_raters_and_a_sigkill_lose_nothing(kind, tmp_path):
    url, drop = database_url(kind, tmp_path)
    upgrade(url)
    db = Database(url)
    names = [f"r{i}" for i in range(6)]
    add_users(db, *names)
    tokens = {n: new_token(db, n) for n in names}
    import_batch(db, "b1", [str(candidates_folder(tmp_path / "c", prompts=30, k=2))], kind="pairwise", raters=3)
    server = Server(url, workers=2).start()
    acked: dict[str, list[str]] = {n: [] for n in names}
    errors: list[BaseException] = []
    stop = threading.Event()

    def rater(name: str, limit: int) -> None:
        c = RaterClient(server.url, tokens[name], timeout=10)
        try:
            while not stop.is_set() and len(acked[name]) < limit:
                it = c.next()
                if it is None:
                    return
                for cand in it["candidates"]:
                    c.image(cand["frames"][0])
                h = [x["handle"] for x in it["candidates"]]
                c.answer(it, h, key=f"{name}-{it['assignment']}")
                acked[name].append(it["item"])
        except Exception as e:  # noqa: BLE001 - the kill below breaks connections; counted, not fatal
            if not stop.is_set():
                errors.append(e)
        finally:
            c.close()

    try:
        threads = [threading.Thread(target=rater, args=(n, 8)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        first = sum(len(v) for v in acked.values())
        assert first == 48
        # Mid-stream: raters keep answering while the server is killed.
        threads = [threading.Thread(target=rater, args=(n, 30)) for n in names]
        for t in threads:
            t.start()
        import time
        time.sleep(1.0)
        server.kill()
        stop.set()
        for t in threads:
            t.join(30)
        acknowledged = {(n, i) for n, items in acked.items() for i in items}
        server.start()                                                   # again, on the same database
        stop.clear()
        errors.clear()
        threads = [threading.Thread(target=rater, args=(n, 1000)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors[:3]
    finally:
        server.stop()
    with db.read() as s:
        rows = s.execute(select(Answer.item_id, Answer.rater_id)).all()
        per_item = dict(s.execute(select(Answer.item_id, func.count()).group_by(Answer.item_id)).all())
        over = s.scalar(select(func.count()).select_from(
            select(Assignment.item_id).group_by(Assignment.item_id).having(func.count() > 3).subquery()))
        users = {u.id: u.name for u in s.execute(select(__import__("difftrain_rate.db").db.User)).scalars()}
        assert s.scalar(select(RatingBatch.raters)) == 3
    stored = {(users[r], i) for i, r in rows}
    assert acknowledged <= stored                                        # nothing acknowledged is lost
    assert len(rows) == len(set(rows)) == 30 * 3                         # none twice; every item at R = 3 at the end
    assert set(per_item.values()) == {3} and over == 0
    db.engine.dispose()
    drop()
