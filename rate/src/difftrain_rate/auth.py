"""Accounts, sessions, API tokens and the sign-in back-off.

Passwords are hashed with Argon2id (argon2-cffi's defaults). A web session is a random token in an HttpOnly,
SameSite=Lax cookie (Secure behind TLS); the database keeps only its SHA-256, with the session's CSRF token,
which every form post and every API write made with the cookie must echo (a hidden field or the
``X-CSRF-Token`` header). Scripted raters use API tokens (``Authorization: Bearer ...``; no cookie, so no
CSRF), also kept only as hashes.

Failed sign-ins back off rather than lock out, so that no one can turn the limit against a user who knows the
password. Failures are counted over ``FAIL_WINDOW`` per (name, address), per address and per name; past a
count's limit, the next attempt waits 2^(failures - limit) seconds (at most the window) after the last failure,
and gets 429 until then, whatever the password (checked before the password, so a guesser learns nothing):
- (name, address): ``FAILS_PER_PAIR``; the only limit on an address the user has signed in from before;
- address: ``FAILS_PER_ADDRESS`` over all names (a password sprayer), except for names known at that address;
- name: ``FAILS_PER_NAME`` from all addresses (a guesser spread over many), except at the user's known addresses.
So a guesser elsewhere, or thirty failures from one NAT, never block a user at an address they have used. An
attempt is counted as a failure before the password is checked and forgiven once it proves right, inside one
serialised transaction (SQLite's ``BEGIN IMMEDIATE``, PostgreSQL advisory locks on the name and the address):
concurrent guesses cannot pass a limit. Admins unlock a name (``user unlock``, the admin page): its failures are
forgotten, and each address it failed or was held back at in the window becomes one of its known addresses, so the
per-address and per-name back-offs (other people's failures there) no longer hold it; the (name, address) limit
still does.

Tokens are compared as bytes (``same_token``): a header or field of any characters is a mismatch, never an error.
A sign-in posted from another site is refused (``cross_site``: login CSRF).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import struct
import threading

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import delete, func, or_, select, text

from difftrain_rate.db import ApiToken, Database, KnownSignIn, LoginFailure, User, WebSession, now
from difftrain_rate.errors import RateError

ROLES = ("rater", "admin")
# A new name never starts with a spreadsheet formula character (= + - @): names reach CSV exports.
NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.@-]{0,63}$")
SIGN_IN_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")      # what older versions admitted: those accounts sign in
SESSION_SECONDS = 12 * 3600
FAIL_WINDOW = 15 * 60
FAILS_PER_PAIR = 5
FAILS_PER_ADDRESS = 30
FAILS_PER_NAME = 50
MIN_PASSWORD = 8

_hasher = PasswordHasher()
# One Argon2 computation at a time per process: each takes 64 MiB and four lanes, and the routes run in a thread
# pool, so 50 raters signing in at once would otherwise run 50 hashes together and starve the rating routes of
# CPU. Waiting sign-ins hold a pool thread, not a core (the hash itself runs without the GIL).
_hashing = threading.BoundedSemaphore(1)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def same_token(sent: str | None, expected: str | None) -> bool:
    """Whether ``sent`` is ``expected``, compared in constant time as UTF-8 bytes (``hmac.compare_digest`` refuses
    str with non-ASCII characters: a hostile header was a 500)."""
    if not sent or not expected:
        return False
    return hmac.compare_digest(sent.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def cross_site(headers, own_netloc: str) -> bool:
    """Whether the browser says the request came from another site: ``Sec-Fetch-Site`` cross-site or same-site (a
    sibling domain, where cookies can be planted), or, from a browser that does not send it, an ``Origin`` that is
    not this host. A request with neither (a script, curl) is not a browser's cross-site form."""
    site = (headers.get("sec-fetch-site") or "").strip().lower()
    if site:
        return site in ("cross-site", "same-site")
    origin = (headers.get("origin") or "").strip()
    if not origin:
        return False
    return origin == "null" or origin.split("://", 1)[-1].rstrip("/").lower() != own_netloc.lower()


def add_user(db: Database, name: str, password: str, role: str = "rater") -> int:
    if not NAME.match(name or ""):
        raise RateError(f"user name {name!r}: expected 1-64 letters, digits or . _ @ -, not starting with @ or -")
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
        super().__init__(f"too many failed sign-ins: try again in {retry_after} s")
        self.retry_after = retry_after


def _keys(name: str, address: str) -> dict[str, str]:
    return {"pair": f"pair:{name}|{address}", "name": f"name:{name}", "ip": f"ip:{address}"}


def _wait(s, key: str, limit: int, t: float) -> float:
    """Seconds still to wait for ``key`` (0: none): past ``limit`` failures in the window, 2^(n - limit) s after
    the last one, at most the window."""
    n, last = s.execute(select(func.count(), func.max(LoginFailure.at))
                        .where(LoginFailure.key == key, LoginFailure.at >= t - FAIL_WINDOW)).one()
    if n < limit:
        return 0.0
    return max(0.0, last + min(2.0 ** (n - limit), FAIL_WINDOW) - t)


def _serialise(s, keys: list[str]) -> None:
    """PostgreSQL: transaction locks on the attempt's name and address (in one order: no deadlock), so counting
    and recording a failure is one step; SQLite's ``BEGIN IMMEDIATE`` has already serialised every writer."""
    if s.get_bind().dialect.name != "postgresql":
        return
    for k in sorted(struct.unpack(">q", hashlib.sha256(k.encode()).digest()[:8])[0] for k in keys):
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": k})


def login(db: Database, name: str, password: str, address: str) -> tuple[str, str] | None:
    """(session token, CSRF token) for a right name and password of an active user, else None; raises
    ``TooManyAttempts`` while a back-off is in force (see the module docstring)."""
    name = name if SIGN_IN_NAME.match(name or "") else "?"        # never a user's name: its own counts
    address = (address or "?")[:64]
    keys = _keys(name, address)
    t = now()
    with db.write() as s:
        _serialise(s, [keys["name"], keys["ip"]])
        s.execute(delete(LoginFailure).where(LoginFailure.at < t - FAIL_WINDOW))
        u = s.scalar(select(User).where(User.name == name))
        known = u is not None and s.scalar(select(KnownSignIn.id).where(KnownSignIn.user_id == u.id,
                                                                          KnownSignIn.address == address)) is not None
        limits = [("pair", FAILS_PER_PAIR)] + ([] if known else [("ip", FAILS_PER_ADDRESS), ("name", FAILS_PER_NAME)])
        wait = max(_wait(s, keys[k], limit, t) for k, limit in limits)
        if wait > 0:
            if u is not None:
                # Remembered, once per (user, address) and counted by no limit: an admin's unlock then knows the
                # address the user is held back at.
                held = f"held:{name}|{address}"
                s.execute(delete(LoginFailure).where(LoginFailure.key == held))
                s.add(LoginFailure(key=held, at=t))
        else:
            pending = [LoginFailure(key=k, at=t) for k in keys.values()]   # forgiven below if the password is right
            s.add_all(pending)
            s.flush()
            pending_ids = [f.id for f in pending]
    if wait > 0:
        raise TooManyAttempts(math.ceil(wait))
    # The hash is checked outside any write transaction (it takes ~50 ms).
    ok = False
    with _hashing:
        if u is not None and not u.disabled:
            try:
                ok = _hasher.verify(u.password_hash, password)
            except (VerificationError, InvalidHashError):
                ok = False
        else:
            _hasher.hash(password or "x")          # the same work for an unknown name: no timing oracle
    if not ok:
        return None
    with db.write() as s:
        s.execute(delete(LoginFailure).where(or_(LoginFailure.id.in_(pending_ids), LoginFailure.key == keys["pair"])))
        if s.scalar(select(KnownSignIn).where(KnownSignIn.user_id == u.id, KnownSignIn.address == address)) is None:
            s.add(KnownSignIn(user_id=u.id, address=address, at=t))
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        s.add(WebSession(id=digest(token), user_id=u.id, csrf=csrf, created_at=t, expires_at=t + SESSION_SECONDS))
        return token, csrf


def unlock(db: Database, name: str) -> int:
    """Forget the failed sign-ins of ``name`` (from every address), and make each address it failed or was held
    back at one of its known addresses (the per-address and per-name back-offs no longer hold it there); the number
    of failures forgotten."""
    with db.write() as s:
        uid = s.scalar(select(User.id).where(User.name == name))
        if uid is None:
            raise RateError(f"no user {name!r}")
        k = _keys(name, "")
        held = f"held:{name}|"
        mine = or_(LoginFailure.key.startswith(k["pair"], autoescape=True),
                   LoginFailure.key.startswith(held, autoescape=True))
        addresses = {key.split("|", 1)[1] for key in s.scalars(select(LoginFailure.key).where(mine))}
        known = set(s.scalars(select(KnownSignIn.address).where(KnownSignIn.user_id == uid)))
        s.add_all(KnownSignIn(user_id=uid, address=a, at=now()) for a in sorted(addresses - known))
        n = s.execute(delete(LoginFailure).where(or_(LoginFailure.key == k["name"], mine)))
        return n.rowcount or 0


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
        return self.csrf is None or same_token(sent, self.csrf)


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
