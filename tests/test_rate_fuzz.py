"""Every route of the rating app fuzzed with Hypothesis, on SQLite and PostgreSQL: any body (JSON of any shape,
answer-like objects with out-of-range numbers, NUL bytes and wrong types, forms, raw bytes), any content type,
signed in as nobody, a rater, an admin or an API token, with a right or wrong CSRF token. No request gets a 500,
every response carries the security headers, and the database keeps its invariants."""

from __future__ import annotations

import json
import re
from urllib.parse import quote, urlencode

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from difftrain_rate.app import create_app
from difftrain_rate.auth import new_token
from difftrain_rate.batches import import_batch
from difftrain_rate.db import Answer, Assignment, RatingBatch

from rate_helpers import candidates_folder, page_state, rate_page, sign_in
from test_rate_app import rate  # noqa: F401 - the fixture: a migrated database of each kind, four users

pytestmark = pytest.mark.slow

ROUTES = [("GET", "/login"), ("POST", "/login"), ("POST", "/logout"), ("GET", "/"), ("GET", "/api/next"),
          ("POST", "/api/next"), ("POST", "/next"), ("GET", "/done"),
          ("POST", "/api/answer"), ("POST", "/api/undo"), ("GET", "/img/{}"), ("GET", "/admin"),
          ("GET", "/api/admin"), ("GET", "/admin/answers.csv"), ("POST", "/admin/unlock"), ("GET", "/static/{}")]
SECURITY = ("content-security-policy", "x-content-type-options", "x-frame-options", "referrer-policy")

scalars = (st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
           | st.sampled_from(["\x00", "=cmd", "../../etc/passwd", "ranked", "skip", "tie", "1" * 300]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=16)
answers = st.fixed_dictionaries({}, optional={
    "assignment": st.integers(min_value=-2 ** 64, max_value=2 ** 64) | json_values,
    "key": st.text(max_size=120) | json_values, "order": st.lists(st.text(max_size=30) | json_values, max_size=5),
    "outcome": st.sampled_from(["ranked", "tie", "both_bad", "skip"]) | json_values,
    "extra": st.dictionaries(st.text(max_size=40), st.text(max_size=80) | json_values, max_size=10)})
forms = st.dictionaries(st.sampled_from(["name", "password", "csrf", "other"]), st.text(max_size=80), max_size=4)
deep = st.integers(min_value=100, max_value=20000).map(lambda n: b"[" * n + b"]" * n)
bodies = st.one_of(json_values.map(lambda v: json.dumps(v).encode()), answers.map(lambda v: json.dumps(v).encode()),
                   forms.map(lambda f: urlencode(f).encode()), st.binary(max_size=512), deep)
ctypes = st.sampled_from(["application/json", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                          "text/plain", None])
segments = st.text(max_size=40) | st.sampled_from(["../app.py", "%2e%2e", "A" * 22, "\x00"])


def test_every_route_answers_any_input_with_a_4xx_at_worst(rate):
    db, url, tmp = rate
    import_batch(db, "b1", [str(candidates_folder(tmp / "c", prompts=3, k=3))], raters=2)
    app = create_app(url)
    clients = {"nobody": TestClient(app, raise_server_exceptions=False)}
    for who, name in (("rater", "alice"), ("admin", "root")):
        c = TestClient(app, raise_server_exceptions=False)
        assert sign_in(c, name).status_code == 303
        clients[who] = c
    csrf = {who: page_state(rate_page(c))["csrf"] for who, c in clients.items() if who != "nobody"}
    token = new_token(db, "bob")
    clients["token"] = TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"})
    login_token = re.search(r'name="csrf" value="([^"]+)"', clients["nobody"].get("/login").text).group(1)
    seen = set()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(ROUTES), who=st.sampled_from(sorted(clients)), body=bodies, ctype=ctypes,
           right_csrf=st.booleans(), segment=segments)
    def one(route, who, body, ctype, right_csrf, segment):
        method, path = route
        path = path.format(quote(segment, safe=""))
        headers = {"Content-Type": ctype} if ctype else {}
        sent = csrf.get(who, login_token) if right_csrf else "wrong"
        headers["X-CSRF-Token"] = sent
        if ctype == "application/x-www-form-urlencoded" and right_csrf:
            body = body + b"&csrf=" + sent.encode()
        r = clients[who].request(method, path, content=body if method == "POST" else None, headers=headers,
                                 follow_redirects=False)
        seen.add((method, route[1]))
        assert r.status_code < 500, (method, path, who, body[:80], r.status_code, r.text[:300])
        assert all(h in r.headers for h in SECURITY), (method, path, r.status_code)

    one()
    assert seen == set(ROUTES)                                   # every route was reached
    with db.read() as s:                                         # and the database kept its rules
        raters = s.scalar(select(RatingBatch.raters))
        per_item = s.execute(select(Assignment.item_id, func.count()).group_by(Assignment.item_id)).all()
        assert all(n <= 2 * raters for _, n in per_item)
        keys = s.execute(select(Answer.idempotency_key, func.count()).group_by(Answer.idempotency_key)).all()
        assert all(n == 1 for _, n in keys)
