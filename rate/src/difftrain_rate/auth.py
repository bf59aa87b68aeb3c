"""Accounts, sessions, API tokens and the login limit.

Passwords are hashed with Argon2id (argon2-cffi's defaults). A web session is a random token in an HttpOnly,
SameSite=Lax cookie (Secure behind TLS); the database keeps only its SHA-256, with the session's CSRF token,
which every form post and every API write made with the cookie must echo (a hidden field or the
``X-CSRF-Token`` header). Scripted raters use API tokens (``Authorization: Bearer ...``; no cookie, so no
CSRF), also kept only as hashes. Failed logins are counted per name and per client address over a window:
past the limit the login answers 429, whatever the password, until the window passes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import delete, func, select

from difftrain_rate.db import ApiToken, Database, LoginFailure, User, WebSession, now
from difftrain_rate.errors import RateError

ROLES = ("rater", "admin")
NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
SESSION_SECONDS = 12 * 3600
FAIL_WINDOW = 15 * 60
FAILS_PER_NAME = 5
FAILS_PER_ADDRESS = 30
MIN_PASSWORD = 8

_hasher = PasswordHasher()


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def add_user(db: Database, name: str, password: str, role: str = "rater") -> int:
    if not NAME.match(name or ""):
        raise RateError(f"user name {name!r}: expected 1-64 letters, digits or . _ @ -")
    if role not in ROLES:
        raise RateError(f"--role {role!r}: expected one of {ROLES}")
    if len(password or "") < MIN_PASSWORD:
        raise RateError(f"user {name!r}: the password needs at least {MIN_PASSWORD} characters")
    with db.write() as s:
        if s.scalar(select(User).where(User.name == name)) is not None:
            raise RateError(f"user {name!r} exists (disable it, or choose another name)")
        u = User(name=name, password_hash=_hasher.hash(password), role=role, disabled=False)
        s.add(u)
        s.flush()
        return u.id


def set_disabled(db: Database, name: str, disabled: bool = True) -> None:
    with db.write() as s:
        u = s.scalar(select(User).where(User.name == name))
        if u is None:
            raise RateError(f"no user {name!r}")
        u.disabled = disabled
        if disabled:        # signed out everywhere, its tokens revoked
            s.execute(delete(WebSession).where(WebSession.user_id == u.id))
            s.execute(delete(ApiToken).where(ApiToken.user_id == u.id))


def new_token(db: Database, name: str) -> str:
    """A new API token for user ``name`` (shown once; only its hash is kept)."""
    token = "drt_" + secrets.token_urlsafe(32)
    with db.write() as s:
        u = s.scalar(select(User).where(User.name == name))
        if u is None or u.disabled:
            raise RateError(f"no active user {name!r}")
        s.add(ApiToken(user_id=u.id, token_hash=digest(token)))
    return token


class TooManyAttempts(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"too many failed logins: try again in {retry_after} s")
        self.retry_after = retry_after


def login(db: Database, name: str, password: str, address: str) -> tuple[str, str] | None:
    """(session token, CSRF token) for a right name and password of an active user, else None; raises
    ``TooManyAttempts`` past the limit (checked before the password, so a guesser learns nothing)."""
    keys = [f"name:{name[:64]}", f"ip:{address}"]
    t = now()
    with db.read() as s:            # the hash is checked outside any write transaction (it takes ~50 ms)
        for key, limit in zip(keys, (FAILS_PER_NAME, FAILS_PER_ADDRESS)):
            n, first = s.execute(select(func.count(), func.min(LoginFailure.at))
                                 .where(LoginFailure.key == key, LoginFailure.at >= t - FAIL_WINDOW)).one()
            if n >= limit:
                raise TooManyAttempts(int(first + FAIL_WINDOW - t) + 1)
        u = s.scalar(select(User).where(User.name == name))
    ok = False
    if u is not None and not u.disabled:
        try:
            ok = _hasher.verify(u.password_hash, password)
        except (VerificationError, InvalidHashError):
            ok = False
    else:
        _hasher.hash(password or "x")          # the same work for an unknown name: no timing oracle
    with db.write() as s:
        s.execute(delete(LoginFailure).where(LoginFailure.at < t - FAIL_WINDOW))
        if not ok:
            s.add_all([LoginFailure(key=k, at=t) for k in keys])
            return None
        s.execute(delete(LoginFailure).where(LoginFailure.key == keys[0]))
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        s.add(WebSession(id=digest(token), user_id=u.id, csrf=csrf, created_at=t, expires_at=t + SESSION_SECONDS))
        return token, csrf


def logout(db: Database, token: str) -> None:
    with db.write() as s:
        s.execute(delete(WebSession).where(WebSession.id == digest(token)))


class Principal:
    """Who a request is: the user, and the session's CSRF token (None for an API token)."""

    def __init__(self, user: User, csrf: str | None):
        self.user, self.csrf = user, csrf

    @property
    def is_admin(self) -> bool:
        return self.user.role == "admin"

    def csrf_ok(self, sent: str | None) -> bool:
        return self.csrf is None or (sent is not None and hmac.compare_digest(self.csrf, sent))


def from_session(db: Database, token: str | None) -> Principal | None:
    if not token or len(token) > 100:
        return None
    with db.read() as s:
        row = s.execute(select(WebSession, User).join(User, User.id == WebSession.user_id)
                        .where(WebSession.id == digest(token))).first()
        if row is None or row[0].expires_at < now() or row[1].disabled:
            return None
        return Principal(row[1], row[0].csrf)


def from_api_token(db: Database, token: str | None) -> Principal | None:
    if not token or len(token) > 100:
        return None
    with db.read() as s:
        row = s.execute(select(ApiToken, User).join(User, User.id == ApiToken.user_id)
                        .where(ApiToken.token_hash == digest(token))).first()
        if row is None or row[1].disabled:
            return None
        return Principal(row[1], None)
