"""``difftrain align``: preference rounds, each resumable at any stage.

A round, in ``OUT/round_NNN/``:
1. ``candidates``: K candidates a prompt from the round's checkpoint (``difftrain candidates``);
2. ``batch``: the candidates imported into the rating app's database as a ranking batch, or a pairwise one
   (``--kind``; with ``--select-items N`` only N pairs, one a prompt, chosen by ``difftrain select`` into
   ``selected/``), R raters an item (with ``--stop-confidence`` the most: adaptive stopping), optionally gold
   items at a rate;
3. ``rated``: wait until every item has its answers (and record their cost in pairwise judgements); with ``--rater auto:NAME[:POLICY]`` scripted raters answer
   through the app's HTTP API meanwhile (the app at ``--app``, or one started here on the database);
4. ``pairs``: the answers -> the pairs file (``difftrain rate export``'s rules: majority over raters, ties dropped,
   raters flagged by gold left out);
5. ``dpo``: ``difftrain dpo`` from the round's checkpoint on those pairs (the config's other settings);
6. ``eval``: the shapes world's evaluation of the checkpoint before and after (``--eval-n 0``: skipped).
``round.json`` records each finished stage (what was rated, by whom, agreement, pairs, beta, the DPO run, the
figures before and after, seconds); a rerun skips finished stages and finishes the others (the candidates and the
DPO run resume themselves). The next round starts from the round's DPO run.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from difftrain.config import Config, load_config, preset_path, to_toml
from difftrain.errors import UserError

log = logging.getLogger("difftrain")
STAGES = ("candidates", "batch", "rated", "pairs", "dpo", "eval")


def _cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "difftrain", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise UserError(f"'difftrain {args[0]}' failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


class Round:
    def __init__(self, out: Path, number: int):
        self.dir = out / f"round_{number:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "round.json"
        self.number = number
        self.record = json.loads(self.path.read_text()) if self.path.is_file() else {"round": number, "stages": {}}

    def done(self, stage: str) -> bool:
        return stage in self.record["stages"]

    def finish(self, stage: str, **facts) -> None:
        self.record["stages"][stage] = {"at": time.time(), **facts}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(self.path)


class LocalApp:
    """``difftrain-rate serve`` on the database, for the rating stage, when no ``--app`` is given."""

    def __init__(self, db: str, workers: int = 2):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "difftrain_rate", "serve", "--db", db, "--port",
                                      str(self.port), "--workers", str(workers)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        import httpx

        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"the rating app did not start: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/login", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise UserError("the rating app did not answer within 60 s")

    def close(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _gold_file(cands: Path, measure: str, share: float, seed: int, out: Path) -> Path | None:
    """Gold orders for a share of the prompts, from what a rater reading ``measure`` makes of the candidates' pixels
    (``raters.read``: with ``+caption`` the caption first); pairs an honest rater would call a tie or "both bad"
    left out."""
    if not share:
        return None
    import hashlib

    import numpy as np
    from PIL import Image

    from difftrain.align.raters import JND, base_measure, read, unfaithful

    base = base_measure(measure)
    rows = [json.loads(x) for x in (cands / "candidates.jsonl").read_text().splitlines() if x.strip()]
    by: dict[str, list] = {}
    for r in rows:
        # salted apart from the train/validation split (the same hash would make gold exactly its low end)
        pick = int.from_bytes(hashlib.sha256(f"gold:{seed}:{r['prompt_id']}".encode()).digest()[:8], "big") / 2**64
        if pick < share:
            with Image.open(cands / r["image"]) as im:
                value = read(measure, np.asarray(im.convert("RGB")), r.get("prompt"), r.get("task", "t2i"))
            by.setdefault(r["prompt_id"], []).append((value, r["id"]))

    with out.open("w") as f:
        for pid, xs in sorted(by.items()):
            # a pair the measure cannot tell apart is no gold question: an honest rater calls it a tie (or both bad),
            # and would be flagged for it (a ranking asks for a full order and keeps its gold)
            if len(xs) == 2 and (abs(xs[0][0] - xs[1][0]) < JND[base] or all(unfaithful(v) for v, _ in xs)):
                continue
            f.write(json.dumps({"prompt_id": pid, "order": [c for _, c in sorted(xs, key=lambda x: -x[0])]}) + "\n")
    return out


def _wait_rated(db, batch: str, raters: list[tuple[str, str]], app_url: str | None, timeout: float,
                seed: int) -> dict:
    from sqlalchemy import select

    from difftrain.align.raters import answer_all
    from difftrain_rate.auth import add_user, new_token
    from difftrain_rate.db import RatingBatch, User
    from difftrain_rate.report import batch_figures, batch_progress, judgements, rater_quality

    app = None
    threads: list[threading.Thread] = []
    answered: dict[str, int] = {}
    try:
        if raters:
            if app_url is None:
                app = LocalApp(db.url)
                app_url = app.url
            import secrets

            for name, _ in raters:
                with db.read() as s:
                    exists = s.scalar(select(User).where(User.name == name)) is not None
                if not exists:
                    add_user(db, name, secrets.token_urlsafe(24), "rater")
            tokens = {name: new_token(db, name) for name, _ in raters}

        def start_pass(n: int) -> list[threading.Thread]:
            """Every scripted rater answers until nothing is left for it. A rater stops when nothing is served to it
            at that moment; an item can open again later (a rater flagged by gold no longer counts towards it, an
            assignment expires), so a pass that ran out with items open is followed by another."""
            out = []
            for i, (name, policy) in enumerate(raters):
                def work(name=name, policy=policy, i=i):
                    answered[name] = answered.get(name, 0) + answer_all(app_url, tokens[name], policy,
                                                                        seed * 100 + i + 1000 * n)

                out.append(threading.Thread(target=work, daemon=True))
            for t in out:
                t.start()
            return out

        passes, pass_answers = 0, -1
        if raters:
            threads = start_pass(0)
        deadline = time.time() + timeout
        last = None
        while True:
            with db.read() as s:
                b = s.scalar(select(RatingBatch).where(RatingBatch.name == batch))
                fig = batch_progress(s, b)          # counts only: the figures once, at the end
            if fig["complete"] + fig["given_up"] == fig["items"]:     # given up: every slot skipped
                break
            if (fig["complete"], fig["answers"]) != last:
                log.info("batch %s: %d of %d items rated by %d raters (%d answers)", batch, fig["complete"],
                         fig["items"], b.raters, fig["answers"])
                last = (fig["complete"], fig["answers"])
            if (threads and not any(t.is_alive() for t in threads)
                    and fig["complete"] + fig["given_up"] < fig["items"]):
                if fig["answers"] == pass_answers:          # a whole pass answered nothing: no one can
                    raise UserError(f"batch {batch}: the automatic raters ran out of items with {fig['complete']} "
                                    f"of {fig['items']} complete: give more raters than --raters-per-item")
                passes, pass_answers = passes + 1, fig["answers"]
                threads = start_pass(passes)
            if time.time() > deadline:
                raise UserError(f"batch {batch}: {fig['complete']} of {fig['items']} items rated after "
                                f"{timeout:.0f} s; rerun 'difftrain align' to keep waiting")
            time.sleep(1.0)
        for t in threads:
            t.join(30)
    finally:
        if app is not None:
            app.close()
    with db.read() as s:
        quality = rater_quality(s)
        b = s.scalar(select(RatingBatch).where(RatingBatch.name == batch))
        fig = batch_figures(s, b, {n for n, r in quality.items() if r["flagged"]})
        cost = judgements(s, b)
    return {"figures": fig, "raters": quality, "cost": cost}


def run_rounds(cfg_path: str, prompts: str, db_url: str, out: str, rounds: int = 1, k: int = 4,
               raters_per_item: int = 3, raters: list[str] | None = None, app: str | None = None,
               gold: str | None = None, gold_measure: str = "light", gold_share: float = 0.0, gold_rate: float = 0.0,
               eval_n: int = 64, wait: float = 7 * 24 * 3600, overrides: list[str] | None = None,
               seed: int = 0, until: str | None = None, kind: str = "ranking", min_raters: int | None = None,
               stop_confidence: float | None = None, select_items: int = 0,
               select_rule: str = "spread") -> list[dict]:
    from difftrain_rate.batches import import_batch
    from difftrain_rate.cli import _db
    from difftrain_rate.errors import RateError

    from difftrain.align.raters import parse_rater

    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    base: Config = load_config(preset_path(cfg_path), list(overrides or []))
    if not base.dpo.init:
        raise UserError(f"{cfg_path}: dpo.init is empty: the checkpoint the first round starts from")
    prompts_path = Path(prompts).resolve()
    if not prompts_path.is_file():
        raise UserError(f"--prompts {prompts}: no such file")
    if until is not None and until not in STAGES:
        raise UserError(f"--until {until!r}: expected one of {STAGES}")
    if kind not in ("ranking", "pairwise"):
        raise UserError(f"--kind {kind!r}: expected 'ranking' or 'pairwise'")
    if select_items and kind != "pairwise":
        raise UserError(f"--select-items {select_items}: chosen pairs are pairwise items (add --kind pairwise)")
    auto = [parse_rater(r) for r in raters or []]
    if auto and len(auto) < raters_per_item:
        raise UserError(f"{len(auto)} automatic rater(s) for --raters-per-item {raters_per_item}: each item needs "
                        "that many distinct raters")
    try:
        db = _db(db_url, migrate=True)
    except RateError as e:
        raise UserError(str(e)) from None
    checkpoint = str(Path(base.dpo.init).resolve())
    records = []
    for number in range(1, rounds + 1):
        r = Round(out_dir, number)
        r.record.setdefault("start", checkpoint)
        if r.record["start"] != checkpoint:
            raise UserError(f"{r.path}: this round started from {r.record['start']}, not {checkpoint}")
        t0 = time.time()
        cands = r.dir / "candidates"
        round_seed = seed * 1000 + number
        if not r.done("candidates"):
            got = json.loads(_cli("candidates", checkpoint, str(prompts_path), "--k", str(k), "--out", str(cands),
                                  "--seed", str(round_seed), "--no-progress", cwd=r.dir).splitlines()[-1])
            r.finish("candidates", folder=str(cands), k=k, seed=round_seed, written=got["candidates"],
                     digest=got["digest"], seconds=round(time.time() - t0, 1))
        if until == "candidates":
            return records + [r.record]
        batch = f"{out_dir.name}-round-{number:03d}"
        if not r.done("batch"):
            from sqlalchemy import select

            from difftrain_rate.db import RatingBatch

            with db.read() as s:
                have = s.scalar(select(RatingBatch).where(RatingBatch.name == batch)) is not None
            folder, selected = cands, None
            if select_items:             # the pairs the model chooses: a candidates folder of one pair a prompt
                from difftrain.align.select import select_pairs

                folder = r.dir / "selected"
                if (folder / "manifest.json").is_file():
                    selected = json.loads((folder / "manifest.json").read_text())["selected"]
                else:
                    shutil.rmtree(folder, ignore_errors=True)
                    selected = select_pairs(cands, folder, select_items, select_rule, seed=round_seed)
            gold_path = gold or _gold_file(folder, gold_measure, gold_share, round_seed, r.dir / "gold.jsonl")
            made = {"batch": batch, "existing": True}
            if not have:
                try:
                    made = import_batch(db, batch, [str(folder)], kind, raters_per_item,
                                        gold_rate if gold_path else 0.0, str(gold_path) if gold_path else None,
                                        seed=round_seed, min_raters=min_raters, stop_confidence=stop_confidence)
                except RateError as e:
                    raise UserError(str(e)) from None
            r.finish("batch", **made, gold=str(gold_path) if gold_path else None, selected=selected)
        if until == "batch":             # people rate now; rerun 'difftrain align' to wait for them and go on
            return records + [r.record]
        if not r.done("rated"):
            t = time.time()
            rated = _wait_rated(db, batch, auto, app, wait, round_seed)
            r.finish("rated", batch=rated["figures"], raters=rated["raters"], cost=rated["cost"],
                     automatic=[f"{n}:{p}" for n, p in auto], seconds=round(time.time() - t, 1))
        if until == "rated":
            return records + [r.record]
        pairs = r.dir / "pairs.parquet"
        if not r.done("pairs"):
            got = json.loads(_cli("rate", "export", "--db", db.url, "--out", str(pairs), "--batch", batch,
                                  "--seed", str(round_seed), cwd=r.dir).splitlines()[-1])
            r.finish("pairs", file=str(pairs), **{k2: got[k2] for k2 in ("pairs", "train", "validation", "rankings",
                                                                          "ties_dropped") if k2 in got})
        if until == "pairs":
            return records + [r.record]
        run = r.dir / "dpo"
        if not r.done("dpo"):
            t = time.time()
            cfg = load_config(preset_path(cfg_path), [*(overrides or []), f'dpo.init="{checkpoint}"',
                                                      f'dpo.pairs="{pairs}"', f"run.seed={round_seed}"])
            (r.dir / "dpo.toml").write_text(to_toml(cfg))
            summary = json.loads(_cli("dpo", str(r.dir / "dpo.toml"), "--run-dir", str(run), "--no-progress",
                                      cwd=r.dir).splitlines()[-1])
            r.finish("dpo", run=str(run), beta=cfg.dpo.beta, steps=summary.get("steps"),
                     reference=cfg.dpo.reference, seconds=round(time.time() - t, 1))
        if until == "dpo":
            return records + [r.record]
        if not r.done("eval"):
            figures = {}
            if eval_n:
                for name, ckpt in (("before", checkpoint), ("after", str(run))):
                    figures[name] = json.loads(_cli("eval", ckpt, "--json", "--n", str(eval_n), cwd=r.dir)
                                               .splitlines()[-1])
            r.finish("eval", **figures)
        records.append(r.record)
        checkpoint = str(run)
    return records
