"""The rating web app (FastAPI): server-rendered pages, a little JavaScript (``static/rate.js``), no build step.

Pages: ``/login``, ``/`` (the rater's item: pairwise or ranking), ``/admin`` (admins). API (a session cookie
with its CSRF token, or an API token): ``POST /api/next`` (takes the next item), ``GET /api/next`` (the item the
rater holds; it changes nothing), ``POST /api/answer``, ``POST /api/undo``, ``GET /api/admin``. No GET changes
anything: the page shows the item the rater holds, and its script (or the form it carries) posts to take the next.
Images: ``/img/{id}``, an opaque id, served only to a rater who holds an assignment showing it (or an admin), from
the batch's imported files only, and only while each is the file imported (its inode and size). Every page, image and API call needs a session or a token; every
post needs the session's CSRF token; responses carry a strict Content-Security-Policy (scripts and images from
this site only, no inline script) and no framing. A database that cannot answer (unreachable, a statement past its
timeout, the pool exhausted, a transaction still a deadlock victim after its retries) gives 503 with Retry-After,
never a 500.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import select
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from difftrain_rate import assign, auth, inputs
from difftrain_rate.db import Database, Image, RatingBatch, Unavailable
from difftrain_rate.db import unavailable as db_unavailable
from difftrain_rate.errors import RateError
from difftrain_rate.guard import BODY_KEY, MAX_BODY, RateApp  # noqa: F401 - MAX_BODY: the limit, for callers
from difftrain_rate.lanes import ANSWERS, PAGES, RouteThread
from difftrain_rate.report import admin_figures

HERE = Path(__file__).parent
COOKIE = "dr_session"
LOGIN_COOKIE = "dr_login"
# Behind TLS the sign-in cookie is __Host-: a browser takes it only from this host over https, never from a sibling
# domain or a plain-http answer, so no one else can plant it.
SECURE_LOGIN_COOKIE = "__Host-dr_login"
IMAGE_ID = re.compile(r"^[A-Za-z0-9_-]{16,32}$")
SIGN_IN_THREADS = 2
# Database connections a process needs: its one route thread, its sign-in threads, one spare (``serve`` checks
# that workers x this fits the server's max_connections).
POOL_SIZE = 1 + SIGN_IN_THREADS + 1
POOL_OVERFLOW = 2
RETRY_AFTER_S = 2


def assignment_ttl(value) -> float:
    """The assignment TTL in seconds, checked (``serve --assignment-ttl``, ``DIFFTRAIN_RATE_ASSIGNMENT_TTL``)."""
    lo, hi = assign.TTL_RANGE
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        raise RateError(f"--assignment-ttl {value!r}: expected seconds in [{lo}, {hi}]") from None
    if not lo <= ttl <= hi:
        raise RateError(f"--assignment-ttl {value!r}: expected seconds in [{lo}, {hi}]")
    return ttl


def create_app(db_url: str | None = None, secure_cookies: bool | None = None,
               assignment_ttl_s: float | None = None) -> FastAPI:
    """The app on ``db_url`` (default: ``DIFFTRAIN_RATE_DB``; how ``uvicorn --workers`` starts it).
    ``secure_cookies``: mark cookies Secure (default: ``DIFFTRAIN_RATE_SECURE`` = 1, or per request when it
    arrived over https). ``assignment_ttl_s``: seconds an assignment is held (default:
    ``DIFFTRAIN_RATE_ASSIGNMENT_TTL``, else 30 minutes)."""
    url = db_url or os.environ.get("DIFFTRAIN_RATE_DB")
    if not url:
        raise RuntimeError("no database: pass db_url or set DIFFTRAIN_RATE_DB")
    if secure_cookies is None:
        secure_cookies = os.environ.get("DIFFTRAIN_RATE_SECURE", "") == "1"
    ttl = assignment_ttl(assignment_ttl_s if assignment_ttl_s is not None else
                         os.environ.get("DIFFTRAIN_RATE_ASSIGNMENT_TTL", assign.ASSIGNMENT_TTL))
    db = Database(url, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)
    db.check()
    templates = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    # redirect_slashes off: Starlette's redirect from "/path/" builds its target from the Host header
    app = RateApp(title="difftrain rate", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.db = db
    app.state.assignment_ttl = ttl
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    sign_in_threads = anyio.CapacityLimiter(SIGN_IN_THREADS)
    routes = RouteThread()

    def on_route_thread(priority: int):
        """The route's work on the process's route thread (``lanes``), at this priority."""
        def wrap(route):
            @functools.wraps(route)
            async def run(**kw):
                return await routes.run(priority, functools.partial(route, **kw))
            return run
        return wrap

    def page(name: str, status: int = 200, **context) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context), status_code=status)

    @app.exception_handler(inputs.BadInput)
    def bad_input(request: Request, e: inputs.BadInput):
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.exception_handler(DataError)
    def data_error(request: Request, e: DataError):
        # A value the database refuses (a driver's range or encoding check): the request's fault, said plainly.
        return JSONResponse({"error": "a value in the request is out of range for the database"}, status_code=400)

    @app.exception_handler(Unavailable)
    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    def database_error(request: Request, e: Exception):
        # The database down, slow past its timeouts, or every connection busy: 503, and the client may send the
        # same request again (an answer with the same idempotency key counts once). Anything else (a table gone) is
        # the server's fault: 500, logged, its cause not told.
        if db_unavailable(e):
            return JSONResponse({"error": "the database is unavailable or busy: try again in a moment"},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        logging.getLogger("difftrain_rate").error("%s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse({"error": "internal server error"}, status_code=500)

    @app.exception_handler(HTTPException)
    def http_error(request: Request, e: HTTPException):
        return JSONResponse({"error": str(e.detail)}, status_code=e.status_code, headers=e.headers)

    def body(request: Request) -> bytes:
        return request.scope.get(BODY_KEY, b"")

    def secure(request: Request) -> bool:
        return secure_cookies or request.url.scheme == "https"

    def principal(request: Request) -> auth.Principal | None:
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            return auth.from_api_token(db, bearer[7:].strip())
        return auth.from_session(db, request.cookies.get(COOKIE))

    def gate(request: Request, api: bool, admin: bool = False, write: bool = False):
        """(who, None) when the request may go on, else (None, the refusal): no session or token (a page goes to
        sign-in, the API answers 401), not an admin where one is needed, an API write without the CSRF header."""
        p = principal(request)
        if p is None:
            if api:
                return None, JSONResponse({"error": "sign in first (a session cookie or an API token)"},
                                          status_code=401)
            return None, RedirectResponse("/login", status_code=303)
        if admin and not p.is_admin:
            return None, (JSONResponse({"error": "admins only"}, status_code=403) if api else
                          Response("admins only", status_code=403))
        if write and not p.csrf_ok(request.headers.get("x-csrf-token")):
            return None, JSONResponse({"error": "CSRF token missing or wrong"}, status_code=403)
        return p, None

    def posted_form(request: Request, p: auth.Principal, fields: dict[str, int]):
        """(the fields of a page's form, None), or (.., the refusal) when its CSRF field is missing or wrong."""
        form = inputs.form(body(request), request.headers.get("content-type"), {"csrf": 64, **fields})
        if not p.csrf_ok(form["csrf"]):
            return form, Response("CSRF token missing or wrong", status_code=403)
        return form, None

    # ---- sign in / out ------------------------------------------------------------------------------------
    def login_cookie(request: Request) -> str:
        return SECURE_LOGIN_COOKIE if secure(request) else LOGIN_COOKIE

    def login_form(request: Request, status: int = 200, error: str | None = None,
                   token: str | None = None) -> HTMLResponse:
        """The sign-in page with a token minted here, in its form and its cookie: a cookie the browser brought (one
        an attacker may have planted) is never adopted by the page. ``token``: the one this sign-in was just
        checked against (a wrong password: the form is good for another try)."""
        token = token or auth.secrets.token_urlsafe(24)
        r = page("login.html", status, csrf=token, error=error)
        r.set_cookie(login_cookie(request), token, httponly=True, samesite="strict", secure=secure(request))
        return r

    @app.get("/login")
    @on_route_thread(PAGES)
    def login_page(request: Request):
        return login_form(request)

    @app.post("/login")
    async def login(request: Request):
        # Parsing the bounded body is quick; the sign-in itself (Argon2, two transactions) runs in a thread of
        # its own pool, so 50 people signing in at once queue there, not in the pool the rating routes use.
        return await anyio.to_thread.run_sync(sign_in, request, limiter=sign_in_threads)

    def sign_in(request: Request):
        cookie = request.cookies.get(login_cookie(request), "")
        try:
            form = inputs.form(body(request), request.headers.get("content-type"),
                               {"csrf": 64, "name": 64, "password": 1024})
        except inputs.BadInput as e:
            return login_form(request, e.status, f"The form could not be read: {e}.")
        # Login CSRF: a sign-in posted from another site (a planted cookie and a form elsewhere would sign the
        # victim in as the attacker) is refused on the browser's own word of where the form came from.
        if auth.cross_site(request.headers, request.url.netloc):
            return login_form(request, 403, "Sign in from this site's own page.")
        if not cookie or not auth.same_token(form["csrf"], cookie):
            return login_form(request, 403, "The form expired: reload the page and sign in again.")
        address = request.client.host if request.client else "?"
        try:
            got = auth.login(db, form["name"], form["password"], address)
        except auth.TooManyAttempts as e:
            r = login_form(request, 429, f"Too many failed sign-ins: try again in {e.retry_after} s.", cookie)
            r.headers["Retry-After"] = str(e.retry_after)
            return r
        if got is None:
            return login_form(request, 401, "Wrong name or password.", cookie)
        token, _ = got
        r = RedirectResponse("/", status_code=303)
        r.set_cookie(COOKIE, token, httponly=True, samesite="lax", secure=secure(request),
                     max_age=auth.SESSION_SECONDS)
        r.delete_cookie(login_cookie(request), secure=secure(request), httponly=True, samesite="strict")
        return r

    @app.post("/logout")
    @on_route_thread(ANSWERS)
    def logout(request: Request):
        p, refused = gate(request, api=False)
        if refused:
            return refused
        _, refused = posted_form(request, p, {})
        if refused:
            return refused
        auth.logout(db, request.cookies.get(COOKIE, ""))
        r = RedirectResponse("/login", status_code=303)
        r.delete_cookie(COOKIE)
        return r

    # ---- rating -------------------------------------------------------------------------------------------
    def item_json(served: assign.Served) -> dict:
        item = served.item
        return {"assignment": served.assignment, "item": item.id, "kind": served.batch.kind, "prompt": item.prompt,
                "task": item.task, "questions": served.batch.questions,
                "candidates": [{"handle": v[0], "frames": [f"/img/{i}" for i in v]} for v in served.order],
                "context": [f"/img/{i}" for i in item.context], "progress": list(served.progress)}

    @app.get("/")
    @on_route_thread(PAGES)
    def rate_page(request: Request):
        """The item the rater holds; without one, a page whose form (posted by its script at once) takes the next."""
        p, refused = gate(request, api=False)
        if refused:
            return refused
        served = assign.held(db, p.user.id, ttl=ttl)
        if served is None:
            return page("take.html", user=p.user, csrf=p.csrf)
        return page("rate.html", user=p.user, csrf=p.csrf, it=item_json(served))

    @app.get("/done")
    @on_route_thread(PAGES)
    def done_page(request: Request):
        p, refused = gate(request, api=False)
        if refused:
            return refused
        return page("done.html", user=p.user, csrf=p.csrf)

    @app.post("/next")
    @on_route_thread(PAGES)
    def take_page(request: Request):
        """The page's form: take the next item, then show it (303 to /), or /done when there is none."""
        p, refused = gate(request, api=False)
        if refused:
            return refused
        _, refused = posted_form(request, p, {})
        if refused:
            return refused
        try:
            served = assign.next_item(db, p.user.id, ttl=ttl)
        except assign.Conflict as e:
            return Response(f"{e}; reload in a moment", status_code=503, headers={"Retry-After": "1"})
        return RedirectResponse("/" if served is not None else "/done", status_code=303)

    @app.get("/api/next")
    @on_route_thread(PAGES)
    def api_held(request: Request):
        """The item the rater holds ({"item": null} without one): a GET takes nothing; POST takes the next."""
        p, refused = gate(request, api=True)
        if refused:
            return refused
        served = assign.held(db, p.user.id, ttl=ttl)
        return JSONResponse({"item": None, "take": "POST /api/next"} if served is None else item_json(served))

    @app.post("/api/next")
    @on_route_thread(PAGES)
    def api_next(request: Request):
        p, refused = gate(request, api=True, write=True)
        if refused:
            return refused
        try:
            served = assign.next_item(db, p.user.id, ttl=ttl)
        except assign.Conflict as e:
            return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"item": None} if served is None else item_json(served))

    @app.post("/api/answer")
    @on_route_thread(ANSWERS)
    def api_answer(request: Request):
        p, refused = gate(request, api=True, write=True)
        if refused:
            return refused
        a = inputs.answer_body(body(request))
        try:
            result = assign.answer(db, p.user.id, a.assignment, a.key, a.order, a.outcome, a.extra, ttl=ttl)
        except (TypeError, ValueError) as e:
            return JSONResponse({"error": f"bad answer: {e}"}, status_code=400)
        except assign.Conflict as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        return JSONResponse(result)

    @app.post("/api/undo")
    @on_route_thread(ANSWERS)
    def api_undo(request: Request):
        p, refused = gate(request, api=True, write=True)
        if refused:
            return refused
        return JSONResponse({"undone": assign.undo(db, p.user.id)})

    @app.get("/img/{image_id}")
    @on_route_thread(PAGES)
    def image(image_id: str, request: Request):
        p, refused = gate(request, api=True)
        if refused:
            return refused
        if not IMAGE_ID.match(image_id):
            return Response("no such image", status_code=404)
        with db.read() as s:
            img = s.get(Image, image_id)
            allowed = img is not None and (p.is_admin or _shown_to(s, img, p.user.id))
            folders = s.scalar(select(RatingBatch.folders).where(RatingBatch.id == img.batch_id)) if allowed else []
        if not allowed:
            return Response("no such image", status_code=404)
        path = Path(img.path).resolve()
        # Checked again where it is served: a row imported by an older version, or a folder changed since.
        if not any(path.is_relative_to(Path(f).resolve()) for f in folders):
            return Response("no such image", status_code=404)
        data = _read_imported(path, img)
        if data is None:
            return Response("the image's file is missing or changed since its import (re-import the batch)",
                            status_code=410)
        return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=86400, immutable"})

    # ---- admin --------------------------------------------------------------------------------------------
    @app.get("/admin")
    @on_route_thread(PAGES)
    def admin_page(request: Request):
        p, refused = gate(request, api=False, admin=True)
        if refused:
            return refused
        return page("admin.html", user=p.user, csrf=p.csrf, f=admin_figures(db))

    @app.get("/api/admin")
    @on_route_thread(PAGES)
    def api_admin(request: Request):
        p, refused = gate(request, api=True, admin=True)
        if refused:
            return refused
        return JSONResponse(admin_figures(db))

    @app.get("/admin/answers.csv")
    @on_route_thread(PAGES)
    def export_csv(request: Request):
        from difftrain_rate.export import answers_csv

        p, refused = gate(request, api=False, admin=True)
        if refused:
            return refused
        return Response(answers_csv(db), media_type="text/csv",
                        headers={"Content-Disposition": "attachment; filename=answers.csv"})

    @app.post("/admin/unlock")
    @on_route_thread(PAGES)
    def admin_unlock(request: Request):
        p, refused = gate(request, api=False, admin=True)
        if refused:
            return refused
        form, refused = posted_form(request, p, {"name": 64})
        if refused:
            return refused
        try:
            auth.unlock(db, form["name"])
        except RateError as e:
            return Response(str(e), status_code=404)
        return RedirectResponse("/admin", status_code=303)

    return app


def _read_imported(path: Path, img: Image) -> bytes | None:
    """The file's bytes if it is still the file imported: a regular file (not a link, not a FIFO) with the inode
    and size recorded at import, checked on the open descriptor (no swap between the check and the read); else
    None."""
    if img.inode is None or img.size is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != img.inode or st.st_size != img.size:
            return None
        data = f.read(img.size + 1)
    return data if len(data) == img.size else None


def _shown_to(s, img: Image, rater: int) -> bool:
    """Whether the rater holds an assignment of the item showing the image (a candidate's frame or its source)."""
    from difftrain_rate.db import Assignment

    return s.scalar(select(Assignment.id).where(Assignment.item_id == img.item_id, Assignment.rater_id == rater)
                    .limit(1)) is not None


def die_with_parent() -> None:
    """In a worker that ``serve`` started (``DIFFTRAIN_RATE_PARENT``), ask Linux for SIGTERM when that parent dies,
    however it dies (SIGKILL included): no orphaned worker keeps answering and holding the port. A parent already
    gone by now ends the worker at once."""
    import ctypes
    import signal
    import sys

    parent = os.environ.get("DIFFTRAIN_RATE_PARENT", "")
    if not parent.isdigit() or int(parent) == os.getpid() or not sys.platform.startswith("linux"):
        return                      # not started by serve, or serve's own process (one worker runs in it)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):
        os._exit(0)


def factory() -> FastAPI:
    """For ``uvicorn --factory difftrain_rate.app:factory`` (its configuration from the environment)."""
    die_with_parent()
    return create_app()

