"""The rating web app (FastAPI): server-rendered pages, a little JavaScript (``static/rate.js``), no build step.

Pages: ``/login``, ``/`` (the next item: pairwise or ranking), ``/admin`` (admins). API (a session cookie with
its CSRF token, or an API token): ``GET /api/next``, ``POST /api/answer``, ``POST /api/undo``, ``GET
/api/admin``. Images: ``/img/{id}``, an opaque id, served only to a rater who holds an assignment showing it (or an
admin), from the batch's imported files only. Every page, image and API call needs a session or a token; every
post needs the session's CSRF token; responses carry a strict Content-Security-Policy (scripts and images from
this site only, no inline script) and no framing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import select

from difftrain_rate import assign, auth
from difftrain_rate.db import Database, Image
from difftrain_rate.report import admin_figures

HERE = Path(__file__).parent
COOKIE = "dr_session"
LOGIN_COOKIE = "dr_login"
IMAGE_ID = re.compile(r"^[A-Za-z0-9_-]{16,32}$")
KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
MAX_BODY = 64 * 1024
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def create_app(db_url: str | None = None, secure_cookies: bool | None = None) -> FastAPI:
    """The app on ``db_url`` (default: ``DIFFTRAIN_RATE_DB``; how ``uvicorn --workers`` starts it).
    ``secure_cookies``: mark cookies Secure (default: ``DIFFTRAIN_RATE_SECURE`` = 1, or per request when it
    arrived over https)."""
    url = db_url or os.environ.get("DIFFTRAIN_RATE_DB")
    if not url:
        raise RuntimeError("no database: pass db_url or set DIFFTRAIN_RATE_DB")
    if secure_cookies is None:
        secure_cookies = os.environ.get("DIFFTRAIN_RATE_SECURE", "") == "1"
    db = Database(url)
    db.check()
    templates = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    app = FastAPI(title="difftrain rate", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.db = db
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def page(name: str, status: int = 200, **context) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context), status_code=status)

    @app.middleware("http")
    async def headers(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return JSONResponse({"error": f"request body over {MAX_BODY} bytes"}, status_code=413)
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "same-origin"
        if "Cache-Control" not in response.headers:
            response.headers["Cache-Control"] = "no-store"
        return response

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

    # ---- sign in / out ------------------------------------------------------------------------------------
    @app.get("/login")
    def login_page(request: Request):
        token = request.cookies.get(LOGIN_COOKIE) or auth.secrets.token_urlsafe(24)
        r = page("login.html", csrf=token, error=None)
        r.set_cookie(LOGIN_COOKIE, token, httponly=True, samesite="strict", secure=secure(request))
        return r

    @app.post("/login")
    async def login(request: Request):
        form = await request.form()
        sent, cookie = str(form.get("csrf", "")), request.cookies.get(LOGIN_COOKIE, "")
        if not cookie or not auth.hmac.compare_digest(sent, cookie):
            return page("login.html", 403, csrf=cookie, error="The form expired: reload the page and sign in again.")
        name, password = str(form.get("name", ""))[:64], str(form.get("password", ""))[:1024]
        address = request.client.host if request.client else "?"
        try:
            got = auth.login(db, name, password, address)
        except auth.TooManyAttempts as e:
            r = page("login.html", 429, csrf=cookie, error=f"Too many failed sign-ins: try again in {e.retry_after} s.")
            r.headers["Retry-After"] = str(e.retry_after)
            return r
        if got is None:
            return page("login.html", 401, csrf=cookie, error="Wrong name or password.")
        token, _ = got
        r = RedirectResponse("/", status_code=303)
        r.set_cookie(COOKIE, token, httponly=True, samesite="lax", secure=secure(request),
                     max_age=auth.SESSION_SECONDS)
        r.delete_cookie(LOGIN_COOKIE)
        return r

    @app.post("/logout")
    async def logout(request: Request):
        p, refused = gate(request, api=False)
        if refused:
            return refused
        form = await request.form()
        if not p.csrf_ok(str(form.get("csrf", ""))):
            return Response("CSRF token missing or wrong", status_code=403)
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
    def rate_page(request: Request):
        p, refused = gate(request, api=False)
        if refused:
            return refused
        try:
            served = assign.next_item(db, p.user.id)
        except assign.Conflict as e:
            return Response(f"{e}; reload in a moment", status_code=503, headers={"Retry-After": "1"})
        if served is None:
            return page("done.html", user=p.user, csrf=p.csrf)
        return page("rate.html", user=p.user, csrf=p.csrf, it=item_json(served))

    @app.get("/api/next")
    def api_next(request: Request):
        p, refused = gate(request, api=True)
        if refused:
            return refused
        try:
            served = assign.next_item(db, p.user.id)
        except assign.Conflict as e:
            return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"item": None} if served is None else item_json(served))

    async def body_json(request: Request) -> dict | None:
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @app.post("/api/answer")
    async def api_answer(request: Request):
        p, refused = gate(request, api=True, write=True)
        if refused:
            return refused
        data = await body_json(request)
        if data is None:
            return JSONResponse({"error": "expected a JSON object"}, status_code=400)
        try:
            assignment = int(data.get("assignment"))
            key, order = str(data.get("key", "")), data.get("order", [])
            outcome, extra = str(data.get("outcome", "ranked")), data.get("extra") or {}
            if not KEY.match(key):
                raise ValueError("key: 1-100 characters of letters, digits, _ . : -")
            if not isinstance(order, list) or not isinstance(extra, dict) or len(extra) > 8:
                raise ValueError("order is a list, extra an object")
            extra = {str(k)[:32]: str(v)[:64] for k, v in extra.items()}
            result = assign.answer(db, p.user.id, assignment, key, order, outcome, extra)
        except (TypeError, ValueError) as e:
            return JSONResponse({"error": f"bad answer: {e}"}, status_code=400)
        except assign.Conflict as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        return JSONResponse(result)

    @app.post("/api/undo")
    async def api_undo(request: Request):
        p, refused = gate(request, api=True, write=True)
        if refused:
            return refused
        return JSONResponse({"undone": assign.undo(db, p.user.id)})

    @app.get("/img/{image_id}")
    def image(image_id: str, request: Request):
        p, refused = gate(request, api=True)
        if refused:
            return refused
        if not IMAGE_ID.match(image_id):
            return Response("no such image", status_code=404)
        with db.read() as s:
            img = s.get(Image, image_id)
            allowed = img is not None and (p.is_admin or _shown_to(s, img, p.user.id))
        if not allowed:
            return Response("no such image", status_code=404)
        path = Path(img.path)
        if not path.is_file():
            return Response("the image's file is missing (was the candidates folder moved?)", status_code=410)
        return FileResponse(path, media_type="image/png",
                            headers={"Cache-Control": "private, max-age=86400, immutable"})

    # ---- admin --------------------------------------------------------------------------------------------
    @app.get("/admin")
    def admin_page(request: Request):
        p, refused = gate(request, api=False, admin=True)
        if refused:
            return refused
        return page("admin.html", user=p.user, csrf=p.csrf, f=admin_figures(db))

    @app.get("/api/admin")
    def api_admin(request: Request):
        p, refused = gate(request, api=True, admin=True)
        if refused:
            return refused
        return JSONResponse(admin_figures(db))

    @app.get("/admin/answers.csv")
    def export_csv(request: Request):
        from difftrain_rate.export import answers_csv

        p, refused = gate(request, api=False, admin=True)
        if refused:
            return refused
        return Response(answers_csv(db), media_type="text/csv",
                        headers={"Content-Disposition": "attachment; filename=answers.csv"})

    return app


def _shown_to(s, img: Image, rater: int) -> bool:
    """Whether the rater holds an assignment of the item showing the image (a candidate's frame or its source)."""
    from difftrain_rate.db import Assignment

    return s.scalar(select(Assignment.id).where(Assignment.item_id == img.item_id, Assignment.rater_id == rater)
                    .limit(1)) is not None


def factory() -> FastAPI:
    """For ``uvicorn --factory difftrain_rate.app:factory`` (its configuration from the environment)."""
    return create_app()

