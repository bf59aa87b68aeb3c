"""The rating app through its HTTP interface, on a real SQLite database migrated by Alembic: accounts and
sessions, the rating flow (answers committed, retried posts counted once, undo), assignment rules enforced by the
database, and what bad input and other people's requests get."""

from __future__ import annotations

import json
import sqlite3

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from difftrain_rate.app import create_app
from difftrain_rate.batches import import_batch
from difftrain_rate.db import Answer, Assignment, Database, Item, upgrade
from difftrain_rate.errors import RateError

from rate_helpers import (PASSWORD, add_users, candidates_folder, database_url, page_state, post_answer, rate_page,
                          sign_in)


@pytest.fixture(params=["sqlite", "postgresql"])
def rate(request, tmp_path):
    url, drop = database_url(request.param, tmp_path)
    upgrade(url)
    db = Database(url)
    add_users(db, "alice", "bob", "carol")
    add_users(db, "root", role="admin")
    yield db, url, tmp_path
    db.engine.dispose()
    drop()


def client(url: str, name: str | None = None) -> TestClient:
    c = TestClient(create_app(url))
    if name:
        assert sign_in(c, name).status_code == 303
    return c


def test_sqlite_is_migrated_by_alembic_with_wal_and_full_sync(tmp_path):
    from difftrain_rate.db import current_revision, head_revision

    url = str(tmp_path / "rate.db")
    upgrade(url)
    db = Database(url)
    assert current_revision(db.engine) == head_revision() == "0005"
    with db.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2           # FULL
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    raw = sqlite3.connect(url)
    tables = {r[0] for r in raw.execute("select name from sqlite_master where type='table'")}
    assert {"users", "sessions", "items", "assignments", "answers", "alembic_version"} <= tables
    # A database not at the schema is refused with what to do.
    raw.execute("update alembic_version set version_num = 'zzz'")
    raw.commit()
    with pytest.raises(RateError, match="schema revision zzz.*difftrain rate upgrade"):
        Database(url).check()


def test_rate_answer_retry_undo_and_progress(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c"))], raters=2)
    c = client(url, "alice")
    assert 'id="take"' in c.get("/").text and c.get("/api/next").json()["item"] is None    # a GET takes nothing
    with db.read() as s:
        assert s.scalar(select(Assignment)) is None
    page = rate_page(c)
    assert "a red circle" in page
    st = page_state(page)
    assert len(st["handles"]) == 3 and len(st["images"]) == 3
    img = c.get(st["images"][0])
    assert img.status_code == 200 and img.headers["content-type"] == "image/png"
    assert "immutable" in img.headers["cache-control"]
    r = post_answer(c, st["csrf"], st["assignment"], st["handles"], "key-1")
    assert r.status_code == 200 and r.json()["repeat"] is False
    again = post_answer(c, st["csrf"], st["assignment"], st["handles"], "key-1")      # a retried post
    assert again.status_code == 200 and again.json() == {"answer": r.json()["answer"], "repeat": True}
    with db.read() as s:
        assert len(s.scalars(select(Answer)).all()) == 1                            # counted once
    nxt = c.post("/api/next", headers={"X-CSRF-Token": st["csrf"]}).json()
    assert nxt["assignment"] != int(st["assignment"]) and nxt["progress"] == [1, 4]
    assert c.post("/api/next").status_code == 403                                 # a cookie's post needs its CSRF
    # Undo: the last answer is gone and its item is served again.
    assert c.post("/api/undo", headers={"X-CSRF-Token": st["csrf"]}).json()["undone"]
    with db.read() as s:
        assert s.scalars(select(Answer)).all() == []
    assert c.get("/api/next").json()["assignment"] == int(st["assignment"])
    # A reload serves the same open assignment (not a new item).
    assert c.get("/api/next").json()["assignment"] == int(st["assignment"])


def test_each_item_gets_r_distinct_raters_enforced_by_the_database(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompts=3))], raters=2)
    seen: dict[str, set] = {}
    for name in ("alice", "bob", "carol"):
        c = client(url, name)
        for n in range(10):
            page_state(rate_page(c))
            it = c.get("/api/next").json()
            if it["item"] is None:
                break
            seen.setdefault(it["item"], set()).add(name)
            r = post_answer(c, None, it["assignment"], [x["handle"] for x in it["candidates"]],
                            f"{name}-{n}")
            assert r.status_code == 403                                  # no CSRF header: refused
            st = page_state(c.get("/").text)
            assert post_answer(c, st["csrf"], st["assignment"], st["handles"], f"{name}-{n}").status_code == 200
    assert len(seen) == 3 and all(len(v) == 2 for v in seen.values())   # R = 2 each, then nothing for carol
    with db.write() as s:
        a = s.scalars(select(Assignment)).first()
    for dup in ({"rater_id": a.rater_id, "slot": 7}, {"rater_id": 3 if a.rater_id != 3 else 1, "slot": a.slot}):
        with pytest.raises(IntegrityError):                               # (item, rater) and (item, slot) unique
            with db.write() as s:
                s.add(Assignment(item_id=a.item_id, order=a.order, answered=False, **dup))


def test_pages_images_and_api_need_a_session_or_token(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c"))], raters=2)
    alice = client(url, "alice")
    st = page_state(rate_page(alice))
    anon = client(url)
    for path in ("/", "/admin", "/admin/answers.csv"):
        r = anon.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/login"
    for path in ("/api/next", "/api/admin", st["images"][0]):
        assert anon.get(path).status_code == 401
    assert anon.post("/api/answer", json={}).status_code == 401
    assert anon.post("/api/undo").status_code == 401
    assert anon.get("/static/rate.js").status_code == 200                  # the script itself is public
    # Headers on every page: no framing, no inline script, no sniffing.
    r = alice.get("/")
    assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
    # A rater is not an admin.
    assert alice.get("/admin").status_code == 403 and alice.get("/api/admin").status_code == 403
    # An API token works without a cookie (and needs no CSRF: it is not ambient).
    from difftrain_rate.auth import new_token, set_disabled

    token = new_token(db, "bob")
    bot = TestClient(create_app(url))
    it = bot.post("/api/next", headers={"Authorization": f"Bearer {token}"}).json()
    r = bot.post("/api/answer", headers={"Authorization": f"Bearer {token}"},
                 json={"assignment": it["assignment"], "key": "bot-1",
                       "order": [x["handle"] for x in it["candidates"]], "outcome": "ranked", "extra": {}})
    assert r.status_code == 200
    assert bot.get("/api/next", headers={"Authorization": "Bearer drt_wrong"}).status_code == 401
    set_disabled(db, "bob")                                                 # disabled: token and sessions gone
    assert bot.get("/api/next", headers={"Authorization": f"Bearer {token}"}).status_code == 401


def test_csrf_other_raters_traversal_injection_and_script(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompt="<script>alert(1)</script>' OR 1=1; -- {p}"))],
                 raters=1)                  # one rater an item: bob's item is not alice's
    alice, bob = client(url, "alice"), client(url, "bob")
    page = rate_page(alice)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    st = page_state(page)
    # CSRF missing or wrong.
    assert post_answer(alice, None, st["assignment"], st["handles"], "x1").status_code == 403
    assert post_answer(alice, "wrong", st["assignment"], st["handles"], "x2").status_code == 403
    assert alice.post("/logout", data={"csrf": "wrong"}).status_code == 403
    # Another rater's assignment and images.
    bst = page_state(rate_page(bob))
    assert post_answer(alice, st["csrf"], bst["assignment"], bst["handles"], "x3").status_code == 409
    assert alice.get(bst["images"][0]).status_code == 404
    # Path traversal and odd ids: never a file outside the batch.
    for bad in ("../../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2e%2e", "a" * 200, "x'%20OR%201=1--"):
        assert alice.get(f"/img/{bad}").status_code in (404, 422)
    # SQL in form fields: a failed sign-in, nothing else.
    evil = client(url)
    assert sign_in(evil, "alice' OR '1'='1", "x' OR '1'='1").status_code == 401
    assert sign_in(evil, "alice'; DROP TABLE users; --", PASSWORD).status_code == 401
    assert client(url, "carol").get("/").status_code == 200                   # the users table is still there
    # Bad answers: named, refused, nothing stored.
    for order, outcome in ((st["handles"][:2], "ranked"), (st["handles"] + ["zzz"], "ranked"), ([], "maybe"),
                           (st["handles"], "skip")):
        r = post_answer(alice, st["csrf"], st["assignment"], order, f"bad-{outcome}-{len(order)}", outcome)
        assert r.status_code == 400, r.text
    assert alice.post("/api/answer", content=b"{not json", headers={"X-CSRF-Token": st["csrf"],
                                                                    "Content-Type": "application/json"}).status_code == 400
    assert alice.post("/api/answer", content=b"x" * 70000, headers={"X-CSRF-Token": st["csrf"]}).status_code == 413
    with db.read() as s:
        assert s.scalars(select(Answer)).all() == []


def test_login_is_rate_limited_per_name(rate):
    db, url, _ = rate
    c = client(url)
    for _ in range(5):
        assert sign_in(c, "alice", "wrong password").status_code == 401
    r = sign_in(c, "alice")                                                    # even the right password now
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    assert sign_in(c, "bob").status_code == 303                                # another name is not locked
    # Disabled users cannot sign in.
    from difftrain_rate.auth import set_disabled
    set_disabled(db, "carol")
    assert sign_in(c, "carol").status_code == 401


def test_gold_items_look_like_any_other_and_score_raters(rate):
    db, url, tmp = rate
    folder = candidates_folder(tmp / "c", prompts=8, k=2)
    gold = tmp / "gold.jsonl"
    gold.write_text("".join(json.dumps({"prompt_id": f"p{p:03d}", "order": [f"p{p:03d}-1", f"p{p:03d}-0"]}) + "\n"
                            for p in range(4)))
    out = import_batch(db, "b1", [str(folder)], kind="pairwise", raters=1, gold=str(gold), gold_rate=0.5, seed=0)
    assert out["items"] == 4 and out["gold_items"] == 4
    c = client(url, "alice")
    pages = []
    while True:
        html = rate_page(c)
        st = page_state(html)
        if st["assignment"] is None:
            break
        pages.append(html)
        with db.read() as s:
            item = s.get(Item, s.get(Assignment, int(st["assignment"])).item_id)
        # prefer the second of the gold order's first handle (a rater who always answers against gold)
        order = st["handles"] if item.gold is None else list(reversed(item.gold))
        assert post_answer(c, st["csrf"], st["assignment"], order, f"a{len(pages)}").status_code == 200
    assert len(pages) == 8
    keys = [set(__import__("re").findall(r'(data-[a-z]+)=', p)) for p in pages]
    assert all(k == keys[0] for k in keys) and not any("gold" in p.lower() for p in pages)
    from difftrain_rate.report import admin_figures
    f = admin_figures(db)["raters"]["alice"]
    assert f["gold_units"] == 4 and f["gold_agreement"] == 0.0 and f["flagged"] is False   # under MIN_GOLD = 5


def test_bad_batches_are_refused_naming_the_file(rate):
    db, url, tmp = rate
    with pytest.raises(RateError, match="no manifest.json"):
        import_batch(db, "x", [str(tmp)])
    folder = candidates_folder(tmp / "c")
    (folder / "images" / "p000-0.png").unlink()
    with pytest.raises(RateError, match=r"candidates.jsonl:1: image images/p000-0.png not found"):
        import_batch(db, "x", [str(folder)])
    other = candidates_folder(tmp / "d")
    lines = (other / "candidates.jsonl").read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), "image": "../../../etc/passwd"})
    (other / "candidates.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RateError, match=r"candidates.jsonl:3: image '../../../etc/passwd' is outside the folder"):
        import_batch(db, "x", [str(other)])
    with pytest.raises(RateError, match="--raters 0"):
        import_batch(db, "x", [str(candidates_folder(tmp / "e"))], raters=0)
    with pytest.raises(RateError, match="cannot reach the database"):
        Database("postgresql://nobody:wrong@127.0.0.1:1/none").check()
    with db.read() as s:
        assert s.scalars(select(Item)).all() == []


def test_session_cookie_flags_secure_behind_tls_and_sign_out_ends_the_session(rate):
    db, url, tmp = rate
    tls = TestClient(create_app(url), base_url="https://rate.example")
    r = sign_in(tls, "alice")
    cookie = r.headers["set-cookie"]
    assert r.status_code == 303 and "HttpOnly" in cookie and "Secure" in cookie and "samesite=lax" in cookie.lower()
    plain = client(url)
    assert "Secure" not in sign_in(plain, "alice").headers["set-cookie"]       # no TLS, no --secure-cookies
    forced = TestClient(create_app(url, secure_cookies=True))         # --secure-cookies (TLS ends at a proxy)
    assert "Secure" in forced.get("/login").headers["set-cookie"]
    # A sign-in form posted without its own token (a cross-site post) is refused.
    assert client(url).post("/login", data={"name": "alice", "password": PASSWORD}).status_code == 403
    # Sign out: the old cookie no longer opens anything, even replayed.
    c = client(url, "carol")
    token = c.cookies.get("dr_session")
    csrf = page_state(rate_page(c))["csrf"]
    assert c.post("/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    replay = client(url)
    replay.cookies.set("dr_session", token)
    assert replay.get("/api/next").status_code == 401
