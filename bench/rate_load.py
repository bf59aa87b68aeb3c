"""The rating app under load: ``difftrain-rate serve`` with 2 worker processes, a load generator in a process of its
own (50 raters in one asyncio loop), on SQLite and on PostgreSQL.

Each rater signs in (a session cookie), then repeatedly: POST /api/next (takes the next item: no GET takes one),
GET / (the page showing it), GET its two images, POST /api/answer (with the page's CSRF token), then waits an
exponential think time (mean ``--think`` s). Four phases per database:
1. ``--answers`` answers with think time: latencies (p50/p95 of the page, of taking the next item, of the post);
2. saturated: no think time, for ``--saturate-seconds``: answers a second;
3. collisions (``--collide-seconds``; the interleaving of issue #53's deadlock): a batch of R = 10 with gold items
   and adaptive stopping that never stops early, the raters in lockstep rounds: each takes its next item (so that
   most of a round's raters hold the same item), then all post their answers at one instant (an asyncio barrier);
   answers are random, so gold answers flag and unflag raters as they go, and one answer in 8 is undone in the next
   round, at the same instant as the others' answers;
4. the server SIGKILLed (every worker) while raters answer with a short think time, then started again and the
   raters go on: every answer the server acknowledged must be in the database.
Then from the database: ``answers_lost`` (acknowledged, not undone, not stored), ``answers_duplicated`` (an (item,
rater) or an idempotency key stored twice, or an undone answer still stored), ``over_assigned`` (items with more
than R assignments that count, or more than 2R assignments), ``5xx`` (every 5xx any phase got) and
``db_locked_errors`` ("database is locked" or "deadlock detected" in the server's log).

Targets: lost, duplicated, over-assigned, 5xx and locked all 0; ``p95_post_ms`` <= 200; ``p95_page_ms`` <= 300.

    python bench/rate_load.py [--dbs sqlite postgresql] [--answers 2000] [--raters 50] [--think 2.0]
                              [--saturate-seconds 20] [--collide-seconds 30]
    (PostgreSQL: DIFFTRAIN_TEST_PG=postgresql://user:pass@host/db, a role that may create databases)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

PASSWORD = "correct horse battery"
COLLIDE_R = 10


# ---- the load generator (its own process) ---------------------------------------------------------------------
def _new_stats() -> dict:
    return {"page_ms": [], "next_ms": [], "post_ms": [], "undo_ms": [], "5xx": 0, "errors": 0, "refused": 0,
            "undone": 0, "error_kinds": {}}


def _error(stats: dict, e: BaseException) -> None:
    """Counted, with what it was (an httpx error's type, or the status a route answered)."""
    kind = str(e)[:60] if isinstance(e, RuntimeError) else type(e).__name__
    stats["errors"] += 1
    stats["error_kinds"][kind] = stats["error_kinds"].get(kind, 0) + 1


async def _sign_in(http) -> str:
    r = await http.get("/login")
    token = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
    await http.post("/login", data={"name": http.rater, "password": PASSWORD, "csrf": token})
    r = await http.get("/")
    return re.search(r'data-csrf="([^"]+)"', r.text).group(1)


async def _timed(stats: dict, key: str, request):
    t0 = time.perf_counter()
    r = await request
    stats[key].append(1000 * (time.perf_counter() - t0))
    if r.status_code >= 500:
        stats["5xx"] += 1
    return r


async def _take(http, csrf: str, stats: dict) -> dict | None:
    """POST /api/next, then GET / (the page showing the item): the page's assignment, CSRF token and handles, or
    None when nothing is left; raises on a 5xx (the caller counts it and tries again)."""
    r = await _timed(stats, "next_ms", http.post("/api/next", headers={"X-CSRF-Token": csrf}))
    if r.status_code != 200:
        raise RuntimeError(f"next: {r.status_code}")
    if r.json().get("item") is None:
        return None
    r = await _timed(stats, "page_ms", http.get("/"))
    if r.status_code != 200:
        raise RuntimeError(f"page: {r.status_code}")
    html = r.text
    m = re.search(r'data-assignment="(\d+)"', html)
    if m is None:
        return None
    for src in re.findall(r'src="(/img/[^"]+)"', html)[:2]:
        await http.get(src)
    return {"assignment": int(m.group(1)), "csrf": re.search(r'data-csrf="([^"]+)"', html).group(1),
            "handles": re.findall(r'data-handle="([^"]+)"', html)}


async def _answer(http, it: dict, key: str, rng: random.Random, stats: dict, acks) -> bool:
    body = {"assignment": it["assignment"], "key": key, "order": rng.sample(it["handles"], len(it["handles"])),
            "outcome": "ranked", "extra": {}}
    for _ in range(5):                 # a 5xx or a lost response: the same key again (counted once)
        try:
            r = await _timed(stats, "post_ms", http.post("/api/answer", json=body,
                                                         headers={"X-CSRF-Token": it["csrf"]}))
        except Exception as e:  # noqa: BLE001 - httpx's transport errors: counted, sent again
            _error(stats, e)
            await asyncio.sleep(0.2)
            continue
        if r.status_code >= 500:
            await asyncio.sleep(0.2)
            continue
        if r.status_code == 200:
            acks.write(json.dumps({"rater": http.rater, "key": key, "assignment": it["assignment"]}) + "\n")
            return True
        stats["refused"] += 1
        return False
    return False


async def _rater(http, state: dict, acks, stats: dict, think: float, rng: random.Random) -> None:
    import httpx

    try:
        csrf = await _sign_in(http)
    except (httpx.HTTPError, AttributeError) as e:
        _error(stats, e)
        return
    while not state["stop"] and state["acked"] < state["target"]:
        try:
            it = await _take(http, csrf, stats)
            if it is None:
                return                                                   # nothing left for this rater
            if await _answer(http, it, f"{http.rater}-{it['assignment']}-{rng.random():.9f}", rng, stats, acks):
                state["acked"] += 1
        except (httpx.HTTPError, RuntimeError) as e:
            _error(stats, e)
            if state["stop"]:
                return
            await asyncio.sleep(0.5)
            continue
        if think:
            await asyncio.sleep(rng.expovariate(1.0 / think))


async def _collider(http, state: dict, acks, stats: dict, rng: random.Random, rounds) -> None:
    """Lockstep rounds: take the next item, wait for every rater, then answer (or undo the last answer) at the same
    instant as all the others."""
    import httpx

    try:
        csrf = await _sign_in(http)
    except (httpx.HTTPError, AttributeError) as e:
        _error(stats, e)
        csrf = None
    last = None
    while True:
        it = None
        undo = last is not None and not state["stop"] and rng.random() < 1 / 8
        if csrf and not undo and not state["stop"]:
            try:
                it = await _take(http, csrf, stats)
            except (httpx.HTTPError, RuntimeError) as e:
                _error(stats, e)
        if it is not None or undo:
            state["busy"] += 1
        await rounds.wait()                                              # every rater has taken its item
        if state["busy"] == 0:
            return                                                       # a round with no work: all done
        await rounds.wait()                                              # every rater has read the count
        if undo:                                                         # now: all at one instant
            r = await _timed(stats, "undo_ms", http.post("/api/undo", headers={"X-CSRF-Token": csrf}))
            if r.status_code == 200 and r.json().get("undone"):
                acks.write(json.dumps({"undo": last}) + "\n")
                stats["undone"] += 1
                last = None
        elif it is not None:
            key = f"{http.rater}-c{it['assignment']}-{rng.random():.9f}"
            if await _answer(http, it, key, rng, stats, acks):
                state["acked"] += 1
                last = key
        if await rounds.wait() == 0:                                     # the round's posts are in
            state["busy"] = 0
        await rounds.wait()                                              # the next round counts afresh


async def _generate(url: str, raters: int, target: int, think: float, seconds: float, acks_path: str, seed: int,
                    collide: bool = False) -> dict:
    import httpx

    state = {"stop": False, "acked": 0, "target": target, "busy": 0}
    stats = _new_stats()
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    clients = [httpx.AsyncClient(base_url=url, timeout=30, limits=limits) for _ in range(raters)]
    for i, c in enumerate(clients):
        c.rater = f"r{i}"
    t0 = time.perf_counter()
    rounds = asyncio.Barrier(raters)
    with open(acks_path, "a") as acks:
        if collide:
            tasks = [asyncio.create_task(_collider(c, state, acks, stats, random.Random(seed * 1000 + i), rounds))
                     for i, c in enumerate(clients)]
        else:
            tasks = [asyncio.create_task(_rater(c, state, acks, stats, think, random.Random(seed * 1000 + i)))
                     for i, c in enumerate(clients)]
        if seconds:
            done, _ = await asyncio.wait(tasks, timeout=seconds)
            state["stop"] = True
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - t0
    for c in clients:
        await c.aclose()
    return {"acked": state["acked"], "wall_s": wall, **stats}


def generate_main(argv: list[str]) -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--url")
    a.add_argument("--raters", type=int)
    a.add_argument("--target", type=int)
    a.add_argument("--think", type=float)
    a.add_argument("--seconds", type=float, default=0)
    a.add_argument("--acks")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--collide", action="store_true")
    g = a.parse_args(argv)
    print(json.dumps(asyncio.run(_generate(g.url, g.raters, g.target, g.think, g.seconds, g.acks, g.seed,
                                           g.collide))))


def generator(url: str, raters: int, target: int, think: float, acks: str, seconds: float = 0, seed: int = 0,
              collide: bool = False):
    return subprocess.Popen([sys.executable, __file__, "--generate", "--url", url, "--raters", str(raters), "--target",
                             str(target), "--think", str(think), "--acks", acks, "--seconds", str(seconds), "--seed",
                             str(seed)] + (["--collide"] if collide else []), stdout=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate()
    return json.loads(out.strip().splitlines()[-1])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else float("nan")


# ---- one database --------------------------------------------------------------------------------------------
def _collide_batch(db, tmp: Path, kind: str, prompts: int, gold: int) -> None:
    """R = COLLIDE_R, a ranking of 3 (a gold item is 3 units: random answers flag and unflag raters), gold items at
    a rate of 0.3, and a stopping rule that never stops early (every answer settles its item again)."""
    from difftrain_rate.batches import import_batch
    from rate_helpers import candidates_folder

    folder = candidates_folder(tmp / f"collide-{kind}", prompts=prompts + gold, k=3)
    (folder / "gold.jsonl").write_text("".join(json.dumps({"prompt_id": f"p{p:03d}",
                                                           "order": [f"p{p:03d}-{j}" for j in range(3)]}) + "\n"
                                               for p in range(gold)))
    import_batch(db, "collide", [str(folder)], kind="ranking", raters=COLLIDE_R, gold=str(folder / "gold.jsonl"),
                 gold_rate=0.3, stop_confidence=0.999, min_raters=COLLIDE_R, seed=0)


def _status(db, name: str, status: str) -> None:
    from sqlalchemy import update

    from difftrain_rate.db import RatingBatch

    with db.write() as s:
        s.execute(update(RatingBatch).where(RatingBatch.name == name).values(status=status))


def run_one(kind: str, args, tmp: Path) -> dict:
    from sqlalchemy import func, select

    from difftrain_rate.auth import add_user
    from difftrain_rate.batches import import_batch
    from difftrain_rate.db import Answer, Assignment, Database, Item, RatingBatch, User, upgrade
    from rate_helpers import candidates_folder, database_url
    from rate_server import Server

    url, drop = database_url(kind, tmp)
    upgrade(url)
    db = Database(url)
    for i in range(args.raters):
        add_user(db, f"r{i}", PASSWORD)
    items = int(-(-(args.answers + 600 + 40 * args.saturate_seconds) // 3))
    import_batch(db, "load", [str(candidates_folder(tmp / f"c-{kind}", prompts=items, k=2))], kind="pairwise",
                 raters=3)
    log = tmp / f"server-{kind}.log"
    server = Server(url, workers=args.workers)
    server.start()
    acks = str(tmp / f"acks-{kind}.jsonl")
    out: dict = {"db": kind, "items": items, "raters": args.raters, "workers": args.workers}
    try:
        load = _result(generator(server.url, args.raters, args.answers, args.think, acks, seed=1))
        out.update(answers=load["acked"], load_wall_s=round(load["wall_s"], 1),
                   p50_page_ms=_pct(load["page_ms"], .5), p95_page_ms=_pct(load["page_ms"], .95),
                   p50_next_ms=_pct(load["next_ms"], .5), p95_next_ms=_pct(load["next_ms"], .95),
                   p50_post_ms=_pct(load["post_ms"], .5), p95_post_ms=_pct(load["post_ms"], .95),
                   load_5xx=load["5xx"], load_errors=load["errors"], load_refused=load["refused"],
                   load_error_kinds=load["error_kinds"])
        sat = _result(generator(server.url, args.raters, 10**9, 0.0, acks, seconds=args.saturate_seconds, seed=2))
        out.update(answers_per_s_saturated=round(sat["acked"] / sat["wall_s"], 1),
                   p95_post_ms_saturated=_pct(sat["post_ms"], .95), p95_page_ms_saturated=_pct(sat["page_ms"], .95),
                   saturated_5xx=sat["5xx"])
        # Collisions: answers to one item at one instant, flags changing, undos among them.
        _status(db, "load", "closed")
        _collide_batch(db, tmp, kind, prompts=args.collide_prompts, gold=max(2, args.collide_prompts // 4))
        col = _result(generator(server.url, args.raters, 10**9, 0.0, acks, seconds=args.collide_seconds, seed=5,
                                collide=True))
        out.update(collide_answers=col["acked"], collide_undone=col["undone"], collide_wall_s=round(col["wall_s"], 1),
                   p95_post_ms_collide=_pct(col["post_ms"], .95), p95_undo_ms_collide=_pct(col["undo_ms"], .95),
                   p95_page_ms_collide=_pct(col["page_ms"], .95), collide_5xx=col["5xx"],
                   collide_errors=col["errors"], collide_error_kinds=col["error_kinds"],
                   collide_refused=col["refused"])
        _status(db, "load", "open")
        # Kill mid-load, restart, go on.
        gen = generator(server.url, args.raters, 10**9, 0.2, acks, seconds=15.0, seed=3)
        time.sleep(8.0)                                      # raters signed in and answering
        server.kill()
        killed = _result(gen)
        server.start()
        after = _result(generator(server.url, args.raters, 100, 0.2, acks, seed=4))
        out.update(kill_acked_before=killed["acked"], kill_errors=killed["errors"], after_restart_acked=after["acked"],
                   after_restart_5xx=after["5xx"])
    finally:
        server.stop()
        err = (server.proc.stderr.read() if server.proc and server.proc.stderr else "")
        log.write_text(err)
    lines = [json.loads(x) for x in Path(acks).read_text().splitlines()]
    undone = {a["undo"] for a in lines if "undo" in a}
    acked = [a for a in lines if "key" in a]
    with db.read() as s:
        stored = {k for (k,) in s.execute(select(Answer.idempotency_key))}
        n_answers = s.scalar(select(func.count()).select_from(Answer))
        pairs = s.scalar(select(func.count()).select_from(select(Answer.item_id, Answer.rater_id).distinct().subquery()))
        # each item: at most R assignments that count (a skip or a flagged rater gives its slot back), 2R in all
        counting = (select(Assignment.item_id, func.count().label("n")).where(Assignment.counts.is_(True))
                    .group_by(Assignment.item_id).subquery())
        taken = select(Assignment.item_id, func.count().label("n")).group_by(Assignment.item_id).subquery()
        over = 0
        for sub, most in ((counting, RatingBatch.raters), (taken, 2 * RatingBatch.raters)):
            over += s.scalar(select(func.count()).select_from(sub).join(Item, Item.id == sub.c.item_id)
                             .join(RatingBatch, RatingBatch.id == Item.batch_id)
                             .where(Item.gold.is_(None), sub.c.n > most))
        flagged = s.scalar(select(func.count()).select_from(User).where(User.flagged.is_(True)))
        # How often the collisions phase did what it is for: answers to one item committed within 50 ms of another
        collide = s.execute(select(Answer.item_id, Answer.created_at).join(Item, Item.id == Answer.item_id)
                            .join(RatingBatch, RatingBatch.id == Item.batch_id)
                            .where(RatingBatch.name == "collide").order_by(Answer.item_id, Answer.created_at)).all()
        together = sum(1 for a, b in zip(collide, collide[1:]) if a.item_id == b.item_id
                       and b.created_at - a.created_at < 0.05)
    out.update(answers_acknowledged=len(acked) - len(undone), answers_undone=len(undone), answers_stored=n_answers,
               answers_lost=sum(1 for a in acked if a["key"] not in stored and a["key"] not in undone),
               answers_duplicated=(n_answers - pairs) + (len(acked) - len({a["key"] for a in acked}))
               + len(undone & stored),
               over_assigned=over, raters_flagged_at_end=flagged, collide_answers_within_50ms_of_another=together,
               **{"5xx": sum(out.get(k, 0) for k in ("load_5xx", "saturated_5xx", "collide_5xx", "after_restart_5xx"))},
               db_locked_errors=err.count("database is locked") + err.count("deadlock detected"))
    db.engine.dispose()
    drop()
    return out


def main() -> None:
    if "--generate" in sys.argv:
        generate_main([a for a in sys.argv[1:] if a != "--generate"])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dbs", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("--answers", type=int, default=2000)
    ap.add_argument("--raters", type=int, default=50)
    ap.add_argument("--think", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--saturate-seconds", type=float, default=20.0)
    ap.add_argument("--collide-seconds", type=float, default=60.0)
    ap.add_argument("--collide-prompts", type=int, default=40, help="ordinary items of the collision batch")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.dbs:
            if kind == "postgresql" and not os.environ.get("DIFFTRAIN_TEST_PG"):
                results.append({"db": kind, "skipped": "set DIFFTRAIN_TEST_PG"})
                continue
            results.append(run_one(kind, args, Path(tmp)))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
