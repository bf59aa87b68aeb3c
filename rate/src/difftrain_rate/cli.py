"""``difftrain-rate`` (also ``difftrain rate``): serve the app, manage users, import batches, export answers.

    difftrain-rate serve --db URL [--batches DIR] [--host 127.0.0.1] [--port 8000] [--workers 2] [--secure-cookies]
                         [--forwarded-allow-ips PROXY,...] [--assignment-ttl SECONDS] [--header-timeout SECONDS]
    difftrain-rate user add NAME [--role rater|admin]      (password from DIFFTRAIN_RATE_PASSWORD or asked)
    difftrain-rate user disable NAME | user enable NAME | user token NAME | user unlock NAME
    difftrain-rate import --db URL --name NAME FOLDER [FOLDER_B] [--kind ranking|pairwise] [--raters R]
                          [--gold FILE --gold-rate F] [--questions overall aesthetics prompt_fit]
                          [--stop-confidence C [--min-raters M]]
    difftrain-rate export --db URL --out rankings.jsonl [--batch NAME] [--include-flagged]
    difftrain-rate answers --db URL --out answers.csv|answers.parquet
    difftrain-rate figures --db URL
    difftrain-rate upgrade --db URL

URL: a SQLite file path (the default kind) or postgresql://user:pass@host/db. ``serve --batches DIR`` imports each
candidates folder under DIR not imported yet (settings from its ``batch.json``, if any: kind, raters, gold,
gold_rate, questions, compare_with, min_raters, stop_confidence) before it starts; every file it names stays inside DIR. ``serve`` trusts no
proxy's ``X-Forwarded-*`` headers unless ``--forwarded-allow-ips`` names it. Its worker processes end with it, even
when it is killed with SIGKILL (each asks the kernel for a signal when its parent dies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from difftrain_rate.errors import RateError


def _db(url: str, migrate: bool = False):
    import logging

    from difftrain_rate.db import Database, upgrade

    logging.getLogger("alembic").setLevel(logging.WARNING)
    if migrate:
        try:
            upgrade(url)
        except Exception as e:  # noqa: BLE001 - the driver's errors differ; the message says which database
            msg = str(getattr(e, "orig", e)).strip().splitlines()
            raise RateError(f"--db {url}: cannot open or migrate the database ({msg[0] if msg else type(e).__name__})"
                            ) from None
    db = Database(url)
    db.check()
    return db


def _password(name: str) -> str:
    pw = os.environ.get("DIFFTRAIN_RATE_PASSWORD")
    if pw is None:
        import getpass
        pw = getpass.getpass(f"password for {name}: ")
    return pw


def import_folders(db, root: str) -> list[dict]:
    """Import each candidates folder under ``root`` (one with manifest.json) not imported yet."""
    from sqlalchemy import select

    from difftrain_rate.batches import import_batch
    from difftrain_rate.db import RatingBatch

    r = Path(root)
    if not r.is_dir():
        raise RateError(f"--batches {root}: no such folder")
    top = r.resolve()
    with db.read() as s:
        have = set(s.scalars(select(RatingBatch.name)))
    todo = []
    for d in sorted(r.iterdir()):
        if d.is_symlink():
            # A link may point anywhere (outside DIR, at another user's files): a batch folder is a real folder.
            if (d / "manifest.json").exists():
                raise RateError(f"--batches {root}: {d.name} is a symbolic link (to {os.readlink(d)}): a batch "
                                "folder must be a folder inside DIR, not a link")
            continue
        if not d.is_dir() or not (d / "manifest.json").is_file():
            continue
        folder = d.resolve()
        if not folder.is_relative_to(top) or folder.parent != top:
            raise RateError(f"--batches {root}: {d.name} resolves to {folder}, outside {top}")
        if d.name not in have:
            todo.append((d.name, _batch_settings(folder, top)))
    # Every folder placed and its settings checked before any is imported.
    return [import_batch(db, name, **settings) for name, settings in todo]


BATCH_KEYS = {"kind": str, "raters": int, "gold": str, "gold_rate": (int, float), "questions": list,
              "compare_with": str, "min_raters": int, "stop_confidence": (int, float)}


def _batch_settings(d: Path, root: Path) -> dict:
    """import_batch's arguments from ``d/batch.json``, checked: known keys of the right types, files inside ``d``,
    a comparison's other folder inside ``root``."""
    from difftrain_rate.batches import confined

    out = {"folders": [str(d)]}
    path = d / "batch.json"
    if not path.is_file():
        return out
    where = str(path)
    confined(d.resolve(), "batch.json", where, "batch.json")
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RateError(f"{where}: not JSON ({e})") from None
    if not isinstance(settings, dict):
        raise RateError(f"{where}: expected an object")
    unknown = set(settings) - set(BATCH_KEYS)
    if unknown:
        raise RateError(f"{where}: unknown key(s) {sorted(unknown)}")
    for key, kind in BATCH_KEYS.items():
        if key in settings and (isinstance(settings[key], bool) or not isinstance(settings[key], kind)):
            raise RateError(f"{where}: {key} {settings[key]!r:.40}: expected a {getattr(kind, '__name__', 'number')}")
    if "compare_with" in settings:
        other = (d / settings["compare_with"]).resolve()
        if not other.is_relative_to(root) or not other.is_dir():
            raise RateError(f"{where}: compare_with {settings['compare_with']!r}: expected a folder inside {root}")
        out["folders"].append(str(other))
    if "gold" in settings:
        out["gold"] = str(confined(d.resolve(), settings["gold"], where, "gold"))
    for key in ("kind", "raters", "gold_rate", "questions", "min_raters", "stop_confidence"):
        if key in settings:
            out[key] = settings[key]
    return out


def serve(args) -> None:
    import uvicorn

    db = _db(args.db, migrate=True)
    if not 1 <= args.workers <= 64:
        raise RateError(f"--workers {args.workers}: expected 1-64")
    check_connections(db, args.workers)
    header_timeout(args.header_timeout)
    if args.batches:
        for m in import_folders(db, args.batches):
            print(json.dumps({"imported": m}), flush=True)
    from difftrain_rate.app import assignment_ttl

    os.environ["DIFFTRAIN_RATE_DB"] = args.db
    os.environ["DIFFTRAIN_RATE_ASSIGNMENT_TTL"] = str(assignment_ttl(args.assignment_ttl))
    os.environ["DIFFTRAIN_RATE_PARENT"] = str(os.getpid())       # the workers end when this process does
    if args.secure_cookies:
        os.environ["DIFFTRAIN_RATE_SECURE"] = "1"
    proxies = args.forwarded_allow_ips or ""
    # No proxy named: X-Forwarded-For and -Proto are ignored, the client is the socket's peer (uvicorn would
    # otherwise trust 127.0.0.1, so anyone on the host could claim any address and pass the per-address limit).
    os.environ["DIFFTRAIN_RATE_HEADER_TIMEOUT"] = str(header_timeout(args.header_timeout))
    from difftrain_rate.guard import HeadDeadlineH11

    # uvicorn's h11 protocol with a deadline on each request's line and headers (uvicorn has none: a client sending
    # a header a minute would hold its connection forever).
    uvicorn.run("difftrain_rate.app:factory", factory=True, host=args.host, port=args.port, workers=args.workers,
                proxy_headers=bool(proxies), forwarded_allow_ips=proxies or None, log_level=args.log_level,
                timeout_graceful_shutdown=5, http=HeadDeadlineH11)


def header_timeout(value) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = float("nan")
    if not 0.5 <= t <= 300:
        raise RateError(f"--header-timeout {value!r}: expected seconds in [0.5, 300]")
    return t


def check_connections(db, workers: int) -> None:
    """PostgreSQL: the workers' pools together fit the server's connections (what is left to ordinary roles), so a
    busy hour never meets 'too many clients' (a 500 it would have been, a 503 it is now): refused at start."""
    from sqlalchemy import text

    from difftrain_rate.app import POOL_OVERFLOW, POOL_SIZE

    if db.engine.dialect.name != "postgresql":
        return
    with db.engine.connect() as c:
        most = int(c.execute(text("SHOW max_connections")).scalar())
        reserved = int(c.execute(text("SHOW superuser_reserved_connections")).scalar())
    need = workers * (POOL_SIZE + POOL_OVERFLOW)
    if need > most - reserved:
        raise RateError(f"--workers {workers}: {workers} x {POOL_SIZE + POOL_OVERFLOW} database connections "
                        f"= {need}, over the {most - reserved} the server allows (max_connections {most}): fewer "
                        "workers, or raise max_connections")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="difftrain-rate", description="difftrain's rating app")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def with_db(p):
        p.add_argument("--db", required=True, help="a SQLite file path or postgresql://user:pass@host/db")
        return p

    p = with_db(sub.add_parser("serve", help="run the web app"))
    p.add_argument("--batches", help="import each candidates folder under DIR not imported yet")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--secure-cookies", action="store_true", help="mark cookies Secure (behind a TLS proxy)")
    p.add_argument("--forwarded-allow-ips", default="",
                   help="the reverse proxies (addresses, comma-separated) whose X-Forwarded-For/-Proto are trusted; "
                        "none by default")
    p.add_argument("--assignment-ttl", default=30 * 60, type=float,
                   help="seconds an item is held for a rater before it is released for others (default 1800)")
    p.add_argument("--header-timeout", default=10.0, type=float,
                   help="seconds a client has to send a request's line and headers (default 10); then 408 and close")
    p.add_argument("--log-level", default="warning")

    u = sub.add_parser("user", help="accounts")
    usub = u.add_subparsers(dest="action", required=True)
    add = with_db(usub.add_parser("add"))
    add.add_argument("name")
    add.add_argument("--role", default="rater", choices=("rater", "admin"))
    for action in ("disable", "enable", "token", "unlock"):
        with_db(usub.add_parser(action)).add_argument("name")

    p = with_db(sub.add_parser("import", help="import a candidates folder (two: a comparison) as a batch"))
    p.add_argument("folders", nargs="+")
    p.add_argument("--name", required=True)
    p.add_argument("--kind", default="ranking", choices=("ranking", "pairwise"))
    p.add_argument("--raters", type=int, default=3)
    p.add_argument("--gold")
    p.add_argument("--gold-rate", type=float, default=0.0)
    p.add_argument("--questions", nargs="+", default=["overall"])
    p.add_argument("--stop-confidence", type=float, default=None,
                   help="adaptive stopping: an item stops once its answers settle every pair at this confidence "
                        "(--raters is then the most it gets)")
    p.add_argument("--min-raters", type=int, default=None, help="with --stop-confidence: the least (default 2)")

    p = with_db(sub.add_parser("export", help="answers as rankings JSONL (difftrain pairs' input)"))
    p.add_argument("--out", required=True)
    p.add_argument("--batch")
    p.add_argument("--include-flagged", action="store_true")

    p = with_db(sub.add_parser("answers", help="every answer as CSV or Parquet"))
    p.add_argument("--out", required=True)
    with_db(sub.add_parser("figures", help="the admin page's figures as JSON"))
    with_db(sub.add_parser("upgrade", help="create or upgrade the database schema"))
    return ap


def run(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cmd == "serve":
        serve(args)
        return
    if args.cmd == "upgrade":
        _db(args.db, migrate=True)
        print(json.dumps({"db": args.db, "revision": "head"}))
        return
    db = _db(args.db, migrate=args.cmd in ("user", "import"))
    if args.cmd == "user":
        from difftrain_rate import auth

        if args.action == "add":
            uid = auth.add_user(db, args.name, _password(args.name), args.role)
            print(json.dumps({"user": args.name, "id": uid, "role": args.role}))
        elif args.action in ("disable", "enable"):
            auth.set_disabled(db, args.name, args.action == "disable")
            print(json.dumps({"user": args.name, "disabled": args.action == "disable"}))
        elif args.action == "unlock":
            print(json.dumps({"user": args.name, "failures_forgotten": auth.unlock(db, args.name)}))
        else:
            print(auth.new_token(db, args.name))
    elif args.cmd == "import":
        from difftrain_rate.batches import import_batch

        print(json.dumps(import_batch(db, args.name, args.folders, args.kind, args.raters, args.gold_rate, args.gold,
                                      args.questions, min_raters=args.min_raters,
                                      stop_confidence=args.stop_confidence)))
    elif args.cmd == "export":
        from difftrain_rate.export import write_rankings

        print(json.dumps(write_rankings(db, args.out, args.batch, args.include_flagged)))
    elif args.cmd == "answers":
        from difftrain_rate.export import write_answers

        print(json.dumps({"answers": write_answers(db, args.out), "out": args.out}))
    elif args.cmd == "figures":
        from difftrain_rate.report import admin_figures

        print(json.dumps(admin_figures(db), indent=1))


def main(argv: list[str] | None = None) -> None:
    try:
        run(argv)
    except RateError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
