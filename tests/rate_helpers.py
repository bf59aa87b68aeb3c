"""Shared helpers of the rating app's tests: candidates folders written directly (no model needed), a signed-in
client, an answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from PIL import Image

PASSWORD = "correct horse battery"


def candidates_folder(d: Path, prompts: int = 4, k: int = 3, prompt: str = "a red circle {p}", step: int = 10,
                      shade=lambda p, k: 30 + 60 * k, task: str = "t2i") -> Path:
    """A folder in the layout ``difftrain candidates`` writes: manifest.json, candidates.jsonl, images/."""
    (d / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    source = ""
    if task == "edit":
        Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(d / "source.png")
        source = "source.png"
    for p in range(prompts):
        for j in range(k):
            cid = f"p{p:03d}-{j}"
            Image.fromarray(np.full((32, 32, 3), shade(p, j), np.uint8)).save(d / "images" / f"{cid}.png")
            rows.append({"id": cid, "prompt_id": f"p{p:03d}", "prompt": prompt.format(p=p), "task": task, "k": j,
                         "seed": 0, "noise_seed": 1000 * p + j, "image": f"images/{cid}.png", "frames": [],
                         "source": source})
    (d / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({"format": "difftrain-candidates-1", "k": k, "digest": f"digest-{d.name}", "checkpoint": str(d),
                                                 "step": step, "prompts": []}))
    return d


def add_users(db, *names: str, role: str = "rater") -> None:
    from difftrain_rate.auth import add_user

    for n in names:
        add_user(db, n, PASSWORD, role)


def sign_in(client, name: str, password: str = PASSWORD):
    r = client.get("/login")
    token = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
    return client.post("/login", data={"name": name, "password": password, "csrf": token}, follow_redirects=False)


def rate_page(client) -> str:
    """The rate page as a browser ends on it: GET / shows the item the rater holds; without one it is a form that
    takes the next (its script posts it at once), then GET / again (or /done)."""
    r = client.get("/")
    if 'id="take"' in r.text:
        csrf = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
        r = client.post("/next", data={"csrf": csrf})
    return r.text


def page_state(html: str) -> dict:
    """What the rate page carries: the CSRF token, the assignment, the candidates' handles and image urls."""
    get = lambda pat: (m.group(1) if (m := re.search(pat, html)) else None)  # noqa: E731
    return {"csrf": get(r'data-csrf="([^"]+)"'), "assignment": get(r'data-assignment="(\d+)"'),
            "handles": re.findall(r'data-handle="([^"]+)"', html), "images": re.findall(r'src="(/img/[^"]+)"', html)}


def post_answer(client, csrf: str | None, assignment, order, key: str, outcome: str = "ranked", extra=None):
    headers = {"X-CSRF-Token": csrf} if csrf else {}
    return client.post("/api/answer", json={"assignment": int(assignment), "key": key, "order": order,
                                            "outcome": outcome, "extra": extra or {}}, headers=headers)


def database_url(kind: str, tmp_path: Path):
    """A fresh, empty database of ``kind`` ('sqlite' or 'postgresql') and a function that drops it. PostgreSQL:
    a new database on the server ``DIFFTRAIN_TEST_PG`` names (a role that may create databases); CI starts one
    (``.ci/run``); elsewhere the PostgreSQL cases are skipped without it."""
    import os
    import uuid

    import pytest

    if kind == "sqlite":
        return str(tmp_path / "rate.db"), lambda: None
    base = os.environ.get("DIFFTRAIN_TEST_PG")
    if not base:
        if os.environ.get("CI"):
            pytest.fail("DIFFTRAIN_TEST_PG is not set: CI runs the PostgreSQL tests (.ci/run starts a server)")
        pytest.skip("no PostgreSQL server: set DIFFTRAIN_TEST_PG=postgresql://user:pass@host/db")
    import psycopg

    name = f"rate_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')

    def drop():
        # FORCE terminates the app's own connections; a server backend of another role on the database (autovacuum
        # finishing its pass) cannot be terminated by this role: try again for a while, then leave the scratch
        # database behind with a warning (cleanup, not what the test checks)
        import time
        import warnings

        for attempt in range(20):
            try:
                with psycopg.connect(base, autocommit=True) as c:
                    c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                return
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ObjectInUse) as e:
                last = e
                time.sleep(0.5)
        warnings.warn(f"scratch database {name} left behind: {last}")
    return base.rsplit("/", 1)[0] + "/" + name, drop
