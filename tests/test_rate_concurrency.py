"""Many raters at once, on real SQLite and PostgreSQL: answers to one item posted at the same instant (threads
released by a barrier, each rater through an app of its own, as separate server processes are), gold answers that
flag and unflag their rater, undos in between. Every acknowledged answer is stored once, no request gets a 5xx, no
item passes its R or its 2R slots; and the rules that keep it so (the lock order, the retries, the timeouts, the pool)
are what the database sees."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text

from difftrain_rate.app import create_app
from difftrain_rate.auth import new_token
from difftrain_rate.batches import import_batch
from difftrain_rate.db import Answer, Assignment, Database, Item, User, upgrade

from rate_helpers import add_users, candidates_folder, database_url

RATERS = 6
ORDINARY = 5
GOLD = 6


@pytest.fixture(params=["sqlite", "postgresql"])
def crowd(request, tmp_path):
    url, drop = database_url(request.param, tmp_path)
    upgrade(url)
    db = Database(url)
    yield db, url, tmp_path
    db.engine.dispose()
    drop()


def _take(c: TestClient) -> dict | None:
    r = c.post("/api/next")
    assert r.status_code == 200, (r.status_code, r.text[:300])
    data = r.json()
    return data if data.get("item") else None


def test_answers_to_one_item_at_one_instant_with_flags_and_undos_are_stored_once(crowd):
    db, url, tmp = crowd
    names = [f"r{i}" for i in range(RATERS)]
    add_users(db, *names)
    # Ranking of K = 3 (a gold item is 3 units: two wrong gold answers flag a rater, undoing one unflags them);
    # R = every rater, and a stopping rule that never stops early, so that every answer settles its item again
    # and every flag change settles the rater's items.
    folder = candidates_folder(tmp / "c", prompts=ORDINARY + GOLD, k=3)
    gold = tmp / "gold.jsonl"
    gold.write_text("".join(json.dumps({"prompt_id": f"p{p:03d}", "order": [f"p{p:03d}-{j}" for j in range(3)]})
                            + "\n" for p in range(GOLD)))
    import_batch(db, "crowd", [str(folder)], kind="ranking", raters=RATERS, gold=str(gold), gold_rate=0.5,
                 stop_confidence=0.999, min_raters=RATERS, seed=0)
    with db.read() as s:
        gold_of = {i.id: i.gold for i in s.scalars(select(Item).where(Item.gold.is_not(None)))}
        ids = {u.name: u.id for u in s.scalars(select(User))}
    clients = {n: TestClient(create_app(url), raise_server_exceptions=False,
                             headers={"Authorization": f"Bearer {new_token(db, n)}"}) for n in names}
    bad = set(names[:2])                             # these two answer every gold item backwards
    acked: dict[str, str] = {}                       # idempotency key -> rater, acknowledged and not undone
    last: dict[str, list[str]] = {n: [] for n in names}
    statuses: list[tuple[str, int, str]] = []
    flags_seen: dict[str, set[bool]] = {n: set() for n in names}
    rng = random.Random(0)
    barrier = threading.Barrier(RATERS)

    def act(name: str, it: dict | None, undo: bool, key: str):
        c = clients[name]
        barrier.wait()                               # every rater's request leaves at the same instant
        if undo:
            r = c.post("/api/undo")
        elif it is None:
            return name, None, None, key
        else:
            handles = [x["handle"] for x in it["candidates"]]
            g = gold_of.get(it["item"])
            order = (list(reversed(g)) if name in bad else list(g)) if g else rng.sample(handles, len(handles))
            r = c.post("/api/answer", json={"assignment": it["assignment"], "key": key, "order": order})
        return name, r, undo, key

    rounds = 0
    with ThreadPoolExecutor(RATERS) as pool:
        while rounds < 80:
            rounds += 1
            # Takes one after another: each rater is given the item with the most raters that still needs one, so
            # that the answers of the round below go to the same item.
            items = {n: _take(clients[n]) for n in names}
            if not any(items.values()):
                break
            undos = {n for k, n in enumerate(names) if rounds <= 16 and (rounds + k) % 4 == 0 and last[n]}
            futures = [pool.submit(act, n, items[n], n in undos, f"{n}-{rounds}") for n in names]
            for f in futures:
                name, r, undo, key = f.result()
                if r is None:
                    continue
                statuses.append((name, r.status_code, r.text[:200]))
                if r.status_code != 200:
                    continue
                if undo:
                    if r.json()["undone"] is not None:
                        acked.pop(last[name].pop())
                else:
                    acked[key] = name
                    last[name].append(key)
            with db.read() as s:
                for u in s.scalars(select(User)):
                    if u.name in flags_seen:
                        flags_seen[u.name].add(bool(u.flagged))
    errors = [x for x in statuses if x[1] >= 500]
    assert not errors, f"{len(errors)} of {len(statuses)} requests got a 5xx: {errors[:3]}"
    assert all(code == 200 for _, code, _ in statuses), [x for x in statuses if x[1] != 200][:3]
    assert rounds < 80, "the raters never finished"
    assert any(flags_seen[n] == {True, False} for n in bad), flags_seen          # a flag went on and off again
    with db.read() as s:
        stored = s.execute(select(Answer.idempotency_key, Answer.rater_id)).all()
        counting = dict(s.execute(select(Assignment.item_id, func.count()).where(Assignment.counts.is_(True))
                                  .group_by(Assignment.item_id)).all())
        taken = dict(s.execute(select(Assignment.item_id, func.count()).group_by(Assignment.item_id)).all())
        ordinary = set(s.scalars(select(Item.id).where(Item.gold.is_(None))))
    assert len(stored) == len({k for k, _ in stored})                              # no key twice
    assert {k: r for k, r in stored} == {k: ids[n] for k, n in acked.items()}      # each acknowledged one, once
    assert max(counting[i] for i in ordinary if i in counting) <= RATERS
    assert max(taken[i] for i in ordinary) <= 2 * RATERS
    for c in clients.values():
        c.close()


def test_a_deadlock_victim_is_run_again_and_timeouts_and_pool_are_set(tmp_path):
    """PostgreSQL: two transactions locking two rows in opposite orders (a deadlock the server breaks by aborting
    one) both complete under ``db.retried``; every connection of the app has its statement and idle-transaction
    timeouts; the app's pool is what one process needs, and ``serve`` refuses more workers than the server's
    connections allow."""
    from difftrain_rate import app as rate_app
    from difftrain_rate.cli import check_connections
    from difftrain_rate.db import STATEMENT_TIMEOUT_MS, retried
    from difftrain_rate.errors import RateError

    url, drop = database_url("postgresql", tmp_path)
    upgrade(url)
    db = Database(url)
    add_users(db, "a", "b")
    tries: list[str] = []
    meet = threading.Barrier(2)

    @retried
    def lock_both(first: str, second: str) -> None:
        tries.append(first)
        with db.write() as s:
            s.execute(text("UPDATE users SET disabled = false WHERE name = :n"), {"n": first})
            if len(tries) <= 2:
                meet.wait(10)                  # both hold their first row: the second locks cross
            s.execute(text("UPDATE users SET disabled = false WHERE name = :n"), {"n": second})

    threads = [threading.Thread(target=lock_both, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(tries) == 3                     # one victim, run once more; no exception reached the caller
    app = rate_app.create_app(url)
    appdb = app.state.db
    with appdb.engine.connect() as c:
        assert c.execute(text("SHOW statement_timeout")).scalar() == f"{STATEMENT_TIMEOUT_MS // 1000}s"
        assert c.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "1min"
    assert appdb.engine.pool.size() == rate_app.POOL_SIZE == 1 + rate_app.SIGN_IN_THREADS + 1
    check_connections(appdb, 2)
    with pytest.raises(RateError, match="--workers 64: .*over the .* the server allows"):
        check_connections(appdb, 64)
    appdb.engine.dispose()
    db.engine.dispose()
    drop()
