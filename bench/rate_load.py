"""The rating app under load: ``difftrain-rate serve`` with 2 worker processes, a load generator in a process of its
own (50 raters in one asyncio loop), on SQLite and on PostgreSQL.

Each rater signs in (a session cookie), then repeatedly: GET / (the page: it assigns the next item), GET its two
images, POST /api/answer (with the page's CSRF token), then waits an exponential think time (mean ``--think`` s).
Three phases per database:
1. ``--answers`` answers with think time: latencies (p50/p95 of the page and of the post) and errors;
2. saturated: no think time, for ``--saturate-seconds``: answers a second;
3. the server SIGKILLed (every worker) while raters answer with a short think time, then started again and the
   raters go on: every answer the server acknowledged must be in the database.
Then from the database: ``answers_lost`` (acknowledged, not stored), ``answers_duplicated`` (an (item, rater) or
an idempotency key stored twice), ``over_assigned`` (items with more than R answers that count, or more than 2R
assignments), ``db_locked_errors`` (5xx answers plus "database is locked" in the server's log).

Targets: lost, duplicated, over-assigned and locked all 0; ``p95_post_ms`` <= 200; ``p95_page_ms`` <= 300.

    python bench/rate_load.py [--dbs sqlite postgresql] [--answers 2000] [--raters 50] [--think 2.0]
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


# ---- the load generator (its own process) ---------------------------------------------------------------------
async def _rater(http, name: str, state: dict, acks, stats: dict, think: float, rng: random.Random) -> None:
    import httpx

    try:
        r = await http.get("/login")
        token = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
        r = await http.post("/login", data={"name": name, "password": PASSWORD, "csrf": token})
    except httpx.HTTPError:
        stats["errors"] += 1
        return
    pending = None                     # an answer sent without a response: sent again with the same key
    while not state["stop"] and state["acked"] < state["target"]:
        try:
            if pending is None:
                t0 = time.perf_counter()
                r = await http.get("/")
                stats["page_ms"].append(1000 * (time.perf_counter() - t0))
                if r.status_code >= 500:
                    stats["5xx"] += 1
                    continue
                html = r.text
                m = re.search(r'data-assignment="(\d+)"', html)
                if m is None:
                    return                                           # nothing left for this rater
                csrf = re.search(r'data-csrf="([^"]+)"', html).group(1)
                handles = re.findall(r'data-handle="([^"]+)"', html)
                for src in re.findall(r'src="(/img/[^"]+)"', html)[:2]:
                    await http.get(src)
                pending = {"assignment": int(m.group(1)), "key": f"{name}-{m.group(1)}-{rng.random():.9f}",
                           "order": rng.sample(handles, len(handles)), "outcome": "ranked", "extra": {}}
                pending_csrf = csrf
            t0 = time.perf_counter()
            r = await http.post("/api/answer", json=pending, headers={"X-CSRF-Token": pending_csrf})
            stats["post_ms"].append(1000 * (time.perf_counter() - t0))
            if r.status_code >= 500:
                stats["5xx"] += 1
                continue
            if r.status_code == 200:
                acks.write(json.dumps({"rater": name, "key": pending["key"], "assignment": pending["assignment"]}) + "\n")
                state["acked"] += 1
            else:
                stats["refused"] += 1
            pending = None
        except httpx.HTTPError:
            stats["errors"] += 1
            if state["stop"]:
                return
            await asyncio.sleep(0.5)
            continue
        if think:
            await asyncio.sleep(rng.expovariate(1.0 / think))


async def _generate(url: str, raters: int, target: int, think: float, seconds: float, acks_path: str, seed: int) -> dict:
    import httpx

    state = {"stop": False, "acked": 0, "target": target}
    stats = {"page_ms": [], "post_ms": [], "5xx": 0, "errors": 0, "refused": 0}
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    clients = [httpx.AsyncClient(base_url=url, timeout=30, limits=limits) for _ in range(raters)]
    t0 = time.perf_counter()
    with open(acks_path, "a") as acks:
        tasks = [asyncio.create_task(_rater(c, f"r{i}", state, acks, stats, think, random.Random(seed * 1000 + i)))
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
    g = a.parse_args(argv)
    print(json.dumps(asyncio.run(_generate(g.url, g.raters, g.target, g.think, g.seconds, g.acks, g.seed))))


def generator(url: str, raters: int, target: int, think: float, acks: str, seconds: float = 0, seed: int = 0):
    return subprocess.Popen([sys.executable, __file__, "--generate", "--url", url, "--raters", str(raters), "--target",
                             str(target), "--think", str(think), "--acks", acks, "--seconds", str(seconds), "--seed",
                             str(seed)], stdout=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate()
    return json.loads(out.strip().splitlines()[-1])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else float("nan")


# ---- one database --------------------------------------------------------------------------------------------
def run_one(kind: str, args, tmp: Path) -> dict:
    from sqlalchemy import func, select

    from difftrain_rate.auth import add_user
    from difftrain_rate.batches import import_batch
    from difftrain_rate.db import Answer, Assignment, Database, upgrade
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
                   p50_post_ms=_pct(load["post_ms"], .5), p95_post_ms=_pct(load["post_ms"], .95),
                   load_5xx=load["5xx"], load_errors=load["errors"], load_refused=load["refused"])
        sat = _result(generator(server.url, args.raters, 10**9, 0.0, acks, seconds=args.saturate_seconds, seed=2))
        out.update(answers_per_s_saturated=round(sat["acked"] / sat["wall_s"], 1),
                   p95_post_ms_saturated=_pct(sat["post_ms"], .95), p95_page_ms_saturated=_pct(sat["page_ms"], .95),
                   saturated_5xx=sat["5xx"])
        # Kill mid-load, restart, go on.
        gen = generator(server.url, args.raters, 10**9, 0.2, acks, seconds=15.0, seed=3)
        time.sleep(8.0)                                      # raters signed in and answering
        server.kill()
        killed = _result(gen)
        server.start()
        after = _result(generator(server.url, args.raters, 100, 0.2, acks, seed=4))
        out.update(kill_acked_before=killed["acked"], kill_errors=killed["errors"], after_restart_acked=after["acked"])
    finally:
        server.stop()
        err = (server.proc.stderr.read() if server.proc and server.proc.stderr else "")
        log.write_text(err)
    acked = [json.loads(x) for x in Path(acks).read_text().splitlines()]
    with db.read() as s:
        stored = {k for (k,) in s.execute(select(Answer.idempotency_key))}
        n_answers = s.scalar(select(func.count()).select_from(Answer))
        pairs = s.scalar(select(func.count()).select_from(select(Answer.item_id, Answer.rater_id).distinct().subquery()))
        # R = 3 answers that count (a skip gives its slot back), at most 2R assignments an item in all
        over_answers = s.scalar(select(func.count()).select_from(
            select(Answer.item_id).where(Answer.outcome != "skip").group_by(Answer.item_id)
            .having(func.count() > 3).subquery()))
        over_assign = s.scalar(select(func.count()).select_from(
            select(Assignment.item_id).group_by(Assignment.item_id).having(func.count() > 6).subquery()))
    out.update(answers_acknowledged=len(acked), answers_stored=n_answers,
               answers_lost=sum(1 for a in acked if a["key"] not in stored),
               answers_duplicated=(n_answers - pairs) + (len(acked) - len({a["key"] for a in acked})),
               over_assigned=over_answers + over_assign,
               db_locked_errors=out.get("load_5xx", 0) + out.get("saturated_5xx", 0) + err.count("database is locked"))
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
