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


def _descendants(pid: int) -> set[int]:
    """The processes under ``pid`` (from /proc)."""
    import os

    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    import os

    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and os.path.exists(f"/proc/{pid}")


def _chunked_post(port: int, path: str, most: int) -> tuple[bytes, int]:
    """POST a chunked body of up to ``most`` bytes in 16 KiB chunks, stopping as soon as the server answers;
    (the response's first bytes, the bytes sent)."""
    import select
    import socket

    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
              "Content-Type: application/x-www-form-urlencoded\r\n\r\n".encode())
    chunk, sent = b"4000\r\n" + b"x" * 0x4000 + b"\r\n", 0
    try:
        while sent < most:
            if select.select([s], [], [], 0)[0]:
                break
            if not select.select([], [s], [], 5)[1]:
                break                                    # the server stopped reading: wait for its answer
            sent += s.send(chunk)
        s.settimeout(10)
        return s.recv(4096), sent
    except (BrokenPipeError, ConnectionResetError):
        return s.recv(4096) if select.select([s], [], [], 1)[0] else b"", sent
    finally:
        s.close()


def test_serve_bounds_bodies_ignores_forwarded_for_and_dies_with_its_pid(tmp_path):
    """A real ``serve`` with two workers: a chunked body is cut at the limit (not read to its 48 MiB),
    X-Forwarded-For moves no one's sign-in count, and SIGKILL of serve's PID alone (as an operator or systemd
    would) takes its workers with it: the port is free and a new serve starts on it."""
    import os
    import re
    import signal
    import time

    import httpx

    url = str(tmp_path / "rate.db")
    upgrade(url)
    add_users(Database(url), "alice")
    server = Server(url, workers=2).start()
    try:
        head, sent = _chunked_post(server.port, "/login", 48 << 20)
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert b"content-security-policy" in head.lower()
        assert sent < 16 << 20, sent                                     # socket buffers, not the 48 MiB
        # X-Forwarded-For from a client is not believed: thirty failures from this address, whatever it claims.
        c = httpx.Client(base_url=server.url)
        token = re.search(r'name="csrf" value="([^"]+)"', c.get("/login").text).group(1)
        codes = [c.post("/login", data={"name": f"n{i}", "password": "wrong password", "csrf": token},
                        headers={"X-Forwarded-For": f"192.0.2.{i}"}).status_code for i in range(31)]
        assert codes == [401] * 30 + [429], codes
        workers = _descendants(server.proc.pid)
        assert len(workers) >= 2
        os.kill(server.proc.pid, signal.SIGKILL)                         # the PID alone: not its group
        server.proc.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "serve's workers outlived it"
        again = Server(url, workers=2, port=server.port).start()        # the same port: nothing holds it
        try:
            assert httpx.get(again.url + "/login").status_code == 200
        finally:
            again.stop()
    finally:
        server.kill()


def _head(port: int, pieces: list[bytes], gap: float) -> tuple[bytes, float]:
    """Send a request's head in ``pieces``, ``gap`` seconds apart (stopping once the server answers or closes);
    (what the server sent back, seconds from the first byte to its answer or close)."""
    import select
    import socket
    import time

    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    t0, got = time.monotonic(), b""
    try:
        for piece in pieces:
            if select.select([s], [], [], gap)[0]:
                break
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
        while select.select([s], [], [], 30)[0]:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        return got, time.monotonic() - t0
    except ConnectionResetError:
        return got, time.monotonic() - t0
    finally:
        s.close()


def test_serve_times_out_a_request_head_sent_slowly(tmp_path):
    """``serve --header-timeout 1``: a head trickled a byte at a time (each gap under any idle timeout), or a
    connection that sends nothing, gets 408 and is closed at the deadline; a request sent in time is served."""
    import httpx

    url = str(tmp_path / "rate.db")
    upgrade(url)
    server = Server(url, workers=1, extra=["--header-timeout", "1"]).start()
    try:
        head = b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
        got, took = _head(server.port, [head[i:i + 1] for i in range(len(head))], 0.1)     # ~6 s if not cut
        assert got.startswith(b"HTTP/1.1 408") and 0.8 < took < 3, (got[:100], took)
        got, took = _head(server.port, [], 0)                                               # nothing at all
        assert got.startswith(b"HTTP/1.1 408") and took < 3, (got[:100], took)
        with httpx.Client(base_url=server.url) as c:                   # keep-alive: two requests, one connection
            assert c.get("/login").status_code == 200
            import time
            time.sleep(1.5)
            assert c.get("/login").status_code == 200
    finally:
        server.stop()
