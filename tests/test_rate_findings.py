"""The rating app's answers to the last probe findings, on real SQLite and PostgreSQL: R bounded (importer, CHECK,
migration), tokens compared as bytes, counts kept at R when a rater is unflagged, malformed gold files and batch
folders refused in one line, images served only while they are the files imported, a 503 while the database is
away, a sign-in an attacker cannot plant, GETs that take nothing, an unlock that frees a user at their address."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from difftrain_rate import assign, auth
from difftrain_rate.app import create_app
from difftrain_rate.batches import import_batch
from difftrain_rate.cli import import_folders
from difftrain_rate.db import Assignment, Database, Image, RatingBatch, User, upgrade
from difftrain_rate.errors import RateError

from rate_helpers import PASSWORD, add_users, candidates_folder, database_url, page_state, post_answer, rate_page
from test_rate_app import client, rate  # noqa: F401 - the fixture: a migrated database of each kind, four users


# ---- R is bounded ----------------------------------------------------------------------------------------------
def test_r_is_bounded_by_the_importer_and_the_database(rate):
    db, url, tmp = rate
    folder = candidates_folder(tmp / "c", prompts=1, k=2)
    for bad in (0, 101, 2 ** 30, -1, True, 2.5):
        with pytest.raises(RateError, match=r"--raters .*expected an integer in \[1, 100\]"):
            import_batch(db, f"b{time.monotonic_ns()}", [str(folder)], raters=bad)
    assert import_batch(db, "ok", [str(folder)], raters=100)["raters"] == 100
    for raters in (0, 101, 2 ** 30):
        with pytest.raises(IntegrityError, match="ck_batches_raters"):
            with db.write() as s:
                s.execute(text("UPDATE batches SET raters = :r"), {"r": raters})


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_migration_clamps_r_above_100(kind, tmp_path):
    from alembic import command

    from difftrain_rate.db import _alembic_config

    url, drop = database_url(kind, tmp_path)
    command.upgrade(_alembic_config(url), "0004")
    db = Database(url)
    with db.engine.begin() as c:
        for i, (raters, least) in enumerate(((2 ** 30, 2 ** 29), (3, None), (100, 100))):
            c.execute(text("insert into batches (id, name, kind, folders, models, raters, min_raters, gold_rate, "
                           "questions, status, created_at) values (:i, :n, 'pairwise', '[]', '[]', :r, :m, 0.0, "
                           "'[\"overall\"]', 'open', 0)"), {"i": i + 1, "n": f"b{i}", "r": raters, "m": least})
    upgrade(url)
    with db.read() as s:
        got = {b.name: (b.raters, b.min_raters) for b in s.scalars(select(RatingBatch))}
    assert got == {"b0": (100, 100), "b1": (3, None), "b2": (100, 100)}
    db.engine.dispose()
    drop()


# ---- tokens compared as bytes ----------------------------------------------------------------------------------
def test_a_csrf_token_of_any_characters_is_a_403_not_a_500(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompts=1, k=2))], raters=1)
    c = TestClient(create_app(url), raise_server_exceptions=False)
    from rate_helpers import sign_in
    assert sign_in(c, "root").status_code == 303
    st = page_state(rate_page(c))
    body = json.dumps({"assignment": int(st["assignment"]), "key": "k1", "order": st["handles"]})
    for token in ("é" * 10, "\u2603", "x\udcff"):
        for path in ("/api/answer", "/api/undo", "/api/next"):
            r = c.post(path, content=body, headers={"X-CSRF-Token": token.encode("utf-8", "surrogateescape"),
                                                    "Content-Type": "application/json"})
            assert r.status_code == 403, (path, token, r.status_code)
        for path in ("/logout", "/admin/unlock", "/next"):
            form = "csrf=" + "".join(f"%{b:02X}" for b in token.encode("utf-8", "surrogateescape")) + "&name=alice"
            r = c.post(path, content=form, headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert r.status_code == 403, (path, token, r.status_code)
    assert auth.same_token("é", "é") and not auth.same_token("é", "e") and not auth.same_token(None, "x")


# ---- counts kept at R ------------------------------------------------------------------------------------------
class _Rng(random.Random):
    """Chooses gold (0.0) or not (0.99) every time: which item next_item serves, decided by the test."""
    def __init__(self, draw: float):
        super().__init__(0)
        self.draw = draw

    def random(self) -> float:
        return self.draw


def _answer(db, rater: int, rng, against_gold: bool = False):
    served = assign.next_item(db, rater, rng=rng)
    assert served is not None
    handles = [v[0] for v in served.order]
    order = list(reversed(served.item.gold)) if against_gold and served.item.gold else handles
    assign.answer(db, rater, served.assignment, f"{rater}-{served.assignment}", order, "ranked", {})
    return served.item


def test_unflagging_a_rater_never_takes_an_item_past_r(rate):
    db, url, tmp = rate
    folder = candidates_folder(tmp / "c", prompts=3, k=3)          # a ranking of 3: a gold item is 3 units
    gold = tmp / "gold.jsonl"
    gold.write_text("".join(json.dumps({"prompt_id": f"p{p:03d}", "order": [f"p{p:03d}-{j}" for j in range(3)]})
                            + "\n" for p in (1, 2)))
    import_batch(db, "b1", [str(folder)], kind="ranking", raters=2, gold=str(gold), gold_rate=0.5)
    with db.read() as s:
        ids = {u.name: u.id for u in s.scalars(select(User))}
    ordinary = _answer(db, ids["alice"], _Rng(0.99))                   # alice rates the one ordinary item
    assert ordinary.gold is None
    _answer(db, ids["alice"], _Rng(0.0), against_gold=True)
    _answer(db, ids["alice"], _Rng(0.0), against_gold=True)           # 6 gold units, none agreeing: flagged
    with db.read() as s:
        assert s.get(User, ids["alice"]).flagged is True
    for name in ("bob", "carol"):                                      # her slot reopened: R = 2 others
        assert _answer(db, ids[name], _Rng(0.99)).id == ordinary.id
    assert assign.undo(db, ids["alice"]) is not None                  # 3 gold units, under MIN_GOLD: unflagged
    with db.read() as s:
        assert s.get(User, ids["alice"]).flagged is False
        counting = s.scalar(select(func.count()).select_from(Assignment)
                            .where(Assignment.item_id == ordinary.id, Assignment.counts.is_(True)))
    assert counting == 2


def test_an_undone_skip_never_takes_an_item_past_r(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompts=1, k=2))], kind="pairwise", raters=1)
    with db.read() as s:
        ids = {u.name: u.id for u in s.scalars(select(User))}
    served = assign.next_item(db, ids["alice"])
    assign.answer(db, ids["alice"], served.assignment, "skip-1", [], "skip", {})
    _answer(db, ids["bob"], None)                                      # the skipped slot went to bob
    assert assign.undo(db, ids["alice"]) == served.item.id
    with db.read() as s:
        counting = s.scalar(select(func.count()).select_from(Assignment).where(Assignment.counts.is_(True)))
    assert counting == 1


# ---- malformed gold files and batch folders --------------------------------------------------------------------
def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftrain_rate", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


GOLD_LINES = [
    (b'{"prompt_id": "p000", "order": null}\n', "gold.jsonl:1: order None"),
    (b'{"prompt_id": "p000", "order": 5}\n', "gold.jsonl:1: order 5"),
    (b'{"prompt_id": "p000", "order": [1, 2]}\n', r"gold.jsonl:1: order \[1, 2\]"),
    (b'{"prompt_id": ["p000"], "order": ["p000-0", "p000-1"]}\n', r"gold.jsonl:1: prompt_id \['p000'\]"),
    (b'{"prompt_id": {"a": 1}, "order": []}\n', "gold.jsonl:1: prompt_id {'a': 1}"),
    (b'{"prompt_id": "\\ud800", "order": ["p000-0", "p000-1"]}\n', r"gold.jsonl:1: prompt_id '\\ud800'"),
    (b'{"prompt_id": "p000", "order": ["\\ud800", "p000-1"]}\n', "gold.jsonl:1: order"),
    (b'\xff\xfe{"prompt_id": "p000"}\n', "gold.jsonl: not UTF-8"),
    (b'[1, 2]\n', "gold.jsonl:1: expected an object"),
    (b'{"prompt_id": "p000", "order": ["p000-0", "p000-1"], "x": 1}\n', r"gold.jsonl:1: unknown key\(s\) \['x'\]"),
]


def test_malformed_gold_files_are_one_line_errors_naming_file_and_field(tmp_path):
    url = str(tmp_path / "rate.db")
    upgrade(url)
    folder = candidates_folder(tmp_path / "c", prompts=2, k=2)
    for content, pattern in GOLD_LINES:
        (folder / "gold.jsonl").write_bytes(content)
        r = _cli("import", "--db", url, "--name", f"b{time.monotonic_ns()}", str(folder), "--gold",
                 str(folder / "gold.jsonl"), "--gold-rate", "0.2")
        assert r.returncode == 2 and "Traceback" not in r.stderr, (content, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (content, r.stderr)
        import re
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    # serve --batches with the same file: one line and exit 2 before it listens, no traceback.
    batches = tmp_path / "batches"
    candidates_folder(batches / "good", prompts=1, k=2)
    bad = candidates_folder(batches / "bad", prompts=1, k=2)
    (bad / "gold.jsonl").write_bytes(b'{"prompt_id": "p000", "order": null}\n')
    (bad / "batch.json").write_text(json.dumps({"gold": "gold.jsonl", "gold_rate": 0.2}))
    r = _cli("serve", "--db", url, "--batches", str(batches), "--port", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "gold.jsonl:1: order None" in r.stderr


def test_a_batch_folder_that_is_a_link_is_refused(rate):
    db, url, tmp = rate
    outside = candidates_folder(tmp / "outside", prompts=1, k=2)
    batches = tmp / "batches"
    candidates_folder(batches / "inside", prompts=1, k=2)
    (batches / "sneaky").symlink_to(outside, target_is_directory=True)
    with pytest.raises(RateError, match="sneaky is a symbolic link"):
        import_folders(db, str(batches))
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(RatingBatch)) == 0
    (batches / "sneaky").unlink()
    assert [m["batch"] for m in import_folders(db, str(batches))] == ["inside"]
    # The folder stored is the resolved one, inside DIR.
    with db.read() as s:
        assert s.scalar(select(RatingBatch.folders)) == [str((batches / "inside").resolve())]


# ---- an image is served while it is the file imported ----------------------------------------------------------
def test_an_image_swapped_after_import_is_not_served(rate):
    db, url, tmp = rate
    folder = candidates_folder(tmp / "c", prompts=1, k=2)
    import_batch(db, "b1", [str(folder)], raters=1)
    c = client(url, "alice")
    st = page_state(rate_page(c))
    ok = c.get(st["images"][0])
    assert ok.status_code == 200 and ok.content.startswith(b"\x89PNG")
    with db.read() as s:
        paths = [s.get(Image, u.rsplit("/", 1)[1]).path for u in st["images"]]
    secret = tmp / "secret.bin"                        # a file of the database's kind: a hard link in its place
    secret.write_bytes(b"SECRET" * 10)
    os.unlink(paths[0])
    os.link(secret, paths[0])
    r = c.get(st["images"][0])
    assert r.status_code == 410 and b"SECRET" not in r.content
    # Another file put in its place (here of another size) is not the file imported either; a FIFO never blocks.
    original = open(paths[1], "rb").read()
    os.unlink(paths[1])
    os.mkfifo(paths[1])
    assert c.get(st["images"][1]).status_code == 410
    os.unlink(paths[1])
    open(paths[1], "wb").write(original + b"\0")
    assert c.get(st["images"][1]).status_code == 410


# ---- the database away: 503 ------------------------------------------------------------------------------------
def test_a_database_that_cannot_be_reached_gives_503_with_retry_after(tmp_path):
    url, drop = database_url("postgresql", tmp_path)
    upgrade(url)
    db = Database(url)
    add_users(db, "alice")
    import_batch(db, "b1", [str(candidates_folder(tmp_path / "c", prompts=1, k=2))], raters=1)
    token = auth.new_token(db, "alice")
    c = TestClient(create_app(url), raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"})
    assert c.get("/api/next").status_code == 200
    import psycopg

    name = url.rsplit("/", 1)[1]
    db.engine.dispose()
    with psycopg.connect(os.environ["DIFFTRAIN_TEST_PG"], autocommit=True) as conn:    # from another database
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
    try:
        for method, path in (("GET", "/api/next"), ("POST", "/api/next"), ("POST", "/api/undo"), ("GET", "/")):
            r = c.request(method, path)
            assert r.status_code == 503 and r.headers["retry-after"] == "2", (path, r.status_code, r.text[:200])
            assert "unavailable" in r.json()["error"]
    finally:
        with psycopg.connect(os.environ["DIFFTRAIN_TEST_PG"], autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    assert c.get("/api/next").status_code == 200                      # back, the same app
    c.close()
    drop()


# ---- sign-in cannot be planted ---------------------------------------------------------------------------------
def test_a_planted_sign_in_cookie_or_a_cross_site_sign_in_is_refused(rate):
    db, url, tmp = rate
    planted = "attacker-chosen-token-0123456789"
    victim = TestClient(create_app(url))
    victim.cookies.set("dr_login", planted)
    page = victim.get("/login").text
    assert planted not in page                                          # the page never adopts it
    # The attacker's form on another site, posting the planted token with the attacker's name and password.
    for header in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Origin": "https://evil.test"},
                   {"Origin": "null"}):
        v = TestClient(create_app(url))
        v.cookies.set("dr_login", planted)
        r = v.post("/login", data={"name": "bob", "password": PASSWORD, "csrf": planted}, headers=header,
                   follow_redirects=False)
        assert r.status_code == 403 and "dr_session" not in r.headers.get("set-cookie", ""), header
    # The site's own form still signs in (same-origin, or a client that says nothing).
    for header in ({"Sec-Fetch-Site": "same-origin"}, {"Origin": "http://testserver"}, {}):
        v = TestClient(create_app(url))
        token = v.get("/login").text.split('name="csrf" value="')[1].split('"')[0]
        r = v.post("/login", data={"name": "bob", "password": PASSWORD, "csrf": token}, headers=header,
                   follow_redirects=False)
        assert r.status_code == 303, (header, r.status_code)
    # Behind TLS the cookie is __Host-: a plain dr_login (settable by a sibling domain) is not read.
    s = TestClient(create_app(url, secure_cookies=True), base_url="https://testserver")
    assert "__Host-dr_login=" in s.get("/login").headers["set-cookie"]
    s.cookies.clear()
    s.cookies.set("dr_login", planted)
    r = s.post("/login", data={"name": "bob", "password": PASSWORD, "csrf": planted}, follow_redirects=False)
    assert r.status_code == 403


# ---- GET takes nothing -----------------------------------------------------------------------------------------
def test_no_get_takes_an_item(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompts=2, k=2))], raters=1)
    c = client(url, "alice")
    token = auth.new_token(db, "bob")
    bot = TestClient(create_app(url), headers={"Authorization": f"Bearer {token}"})
    for _ in range(3):
        assert c.get("/api/next").json()["item"] is None and 'id="take"' in c.get("/").text
        assert bot.get("/api/next").json()["item"] is None and c.get("/done").status_code == 200
        assert c.head("/").status_code in (200, 405)
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(Assignment)) == 0
    it = bot.post("/api/next").json()                                   # POST takes one; GET then shows it
    assert bot.get("/api/next").json()["assignment"] == it["assignment"]
    st = page_state(rate_page(c))                                       # the page's form takes alice's
    assert st["assignment"] is not None and page_state(c.get("/").text)["assignment"] == st["assignment"]
    assert post_answer(c, st["csrf"], st["assignment"], st["handles"], "a1").status_code == 200
    r = c.post("/next", data={"csrf": st["csrf"]}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/done"   # nothing left for alice (R = 1)


# ---- unlock frees a user at their address ----------------------------------------------------------------------
def test_unlock_clears_the_back_off_of_the_users_address(rate):
    db, url, tmp = rate
    for i in range(auth.FAILS_PER_ADDRESS):                            # a sprayer at alice's NAT
        assert auth.login(db, f"nobody{i}", "guess", "10.5.5.5") is None
    with pytest.raises(auth.TooManyAttempts):
        auth.login(db, "alice", PASSWORD, "10.5.5.5")                  # alice, new there, is held back
    assert auth.unlock(db, "alice") >= 0
    assert auth.login(db, "alice", PASSWORD, "10.5.5.5") is not None  # unlocked: she signs in at her address
    with pytest.raises(auth.TooManyAttempts):                            # the sprayer is still held back there
        auth.login(db, "carol", PASSWORD, "10.5.5.5")
    # Guesses at alice's own (name, address) still back off after the unlock.
    for _ in range(auth.FAILS_PER_PAIR):
        assert auth.login(db, "alice", "guess", "10.5.5.5") is None
    with pytest.raises(auth.TooManyAttempts):
        auth.login(db, "alice", PASSWORD, "10.5.5.5")
