"""The rating database: tables, the engine and its migrations.

SQLite (a file; the default) or PostgreSQL, through SQLAlchemy; the schema is created and upgraded by Alembic
(``migrations/``), never by ``create_all``. SQLite runs in WAL mode with ``synchronous=FULL`` (a committed answer
survives a power cut) and a busy timeout, and every writing transaction starts with ``BEGIN IMMEDIATE``: it
takes the write lock before reading, so two server processes never deadlock upgrading a read lock (SQLite's
"database is locked"), they queue on the timeout instead. Read-only work (``read()``) starts a deferred
transaction and does not queue behind writers.

What the database enforces (not only the code): R is 1..``MAX_RATERS``; each item is rated by a rater at most once
(unique (item, rater)) and has at most 2R rating slots (unique (item, slot), slots 0..2R-1: R that count, and those
a skip or a flagged rater gave back; gold items take the rater's id as their slot); an answer is one per assignment
and one per idempotency key, so a retried post counts once. PostgreSQL connections carry a statement timeout and an
idle-in-transaction timeout; a transaction the server aborts as a deadlock victim is run again (``retried``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from sqlalchemy import (JSON, BigInteger, Boolean, CheckConstraint, Float, ForeignKey, Index, Integer, String, Text,
                        UniqueConstraint, create_engine, event, false, true)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from difftrain_rate.errors import RateError


SLOTS_PER_R = 2     # an item's slots in all, per R: R that count, the rest reopened by skips and flagged raters
MAX_RATERS = 100    # R's most (the importer and a CHECK constraint): 2R slots stay small numbers everywhere


class Base(DeclarativeBase):
    pass


def now() -> float:
    return time.time()


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # fails the gold check (report.is_flagged), kept current on each gold answer: the rater's slots reopen
    flagged: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[float] = mapped_column(Float, default=now)
    __table_args__ = (CheckConstraint("role in ('rater', 'admin')", name="ck_users_role"),)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)


class WebSession(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)       # SHA-256 of the cookie's token
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    csrf: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, default=now)
    expires_at: Mapped[float] = mapped_column(Float)


class LoginFailure(Base):
    __tablename__ = "login_failures"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(200), index=True)           # "name:<name>" or "ip:<address>"
    at: Mapped[float] = mapped_column(Float, default=now)


class KnownSignIn(Base):
    """An address a user has signed in from: failures of other people's guesses never block it."""
    __tablename__ = "known_sign_ins"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    address: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float, default=now)
    __table_args__ = (UniqueConstraint("user_id", "address", name="uq_known_sign_in"),)


class RatingBatch(Base):
    __tablename__ = "batches"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))                       # pairwise | ranking
    folders: Mapped[list] = mapped_column(JSON)                          # candidates folders (2: a comparison)
    models: Mapped[list] = mapped_column(JSON)                           # the folders' checkpoints (hidden)
    raters: Mapped[int] = mapped_column(Integer)                         # R: distinct raters per item (the most)
    # adaptive stopping (``stopping``): an item settled by at least min_raters answers at this confidence is
    # served no more; both NULL for a batch of fixed R
    min_raters: Mapped[int | None] = mapped_column(Integer, nullable=True)
    stop_confidence: Mapped[float | None] = mapped_column(Float, nullable=True)
    gold_rate: Mapped[float] = mapped_column(Float, default=0.0)
    questions: Mapped[list] = mapped_column(JSON)                        # ["overall", ...]
    status: Mapped[str] = mapped_column(String(16), default="open")
    created_at: Mapped[float] = mapped_column(Float, default=now)
    __table_args__ = (CheckConstraint("kind in ('pairwise', 'ranking')", name="ck_batches_kind"),
                      CheckConstraint(f"raters >= 1 AND raters <= {MAX_RATERS}", name="ck_batches_raters"))


class Image(Base):
    __tablename__ = "images"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)       # opaque: random, never a path or a seed
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), index=True)
    item_id: Mapped[str] = mapped_column(String(32), index=True)        # the one item showing it
    path: Mapped[str] = mapped_column(Text)                              # absolute, inside one of the batch's folders
    candidate: Mapped[str] = mapped_column(String(200))                  # the candidate id ('' for a source image)
    model: Mapped[int] = mapped_column(Integer, default=0)               # which folder (a comparison's A = 0, B = 1)
    # the file as imported: the image server serves it only while its inode and size are these (NULL: unknown, not
    # served; a row of a version before 0005 whose file was gone at the upgrade)
    inode: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    size: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Item(Base):
    __tablename__ = "items"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)       # opaque
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), index=True)
    prompt_id: Mapped[str] = mapped_column(String(200))
    prompt: Mapped[str] = mapped_column(Text)
    task: Mapped[str] = mapped_column(String(16))
    images: Mapped[list] = mapped_column(JSON)                           # candidate image ids, in import order
    context: Mapped[list] = mapped_column(JSON)                          # an edit's source image id(s)
    frames: Mapped[int] = mapped_column(Integer, default=1)
    # the known order (image ids, best first); SQL NULL for an ordinary item
    gold: Mapped[list | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    seq: Mapped[int] = mapped_column(Integer, default=0)                 # serving order within the batch
    # its answers settle it (a batch with adaptive stopping): served no more
    settled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Assignment(Base):
    __tablename__ = "assignments"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    item_id: Mapped[str] = mapped_column(ForeignKey("items.id"))
    rater_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    slot: Mapped[int] = mapped_column(Integer)
    order: Mapped[list] = mapped_column(JSON)                            # the item's images as this rater sees them
    created_at: Mapped[float] = mapped_column(Float, default=now)
    answered: Mapped[bool] = mapped_column(Boolean, default=False)
    # counts toward the item's R: false once answered with a skip or when its rater is flagged (the item is then
    # served to another rater, in a slot past R, up to 2R slots in all)
    counts: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    __table_args__ = (UniqueConstraint("item_id", "rater_id", name="uq_assignment_item_rater"),
                      UniqueConstraint("item_id", "slot", name="uq_assignment_item_slot"),
                      Index("ix_assignments_rater", "rater_id", "answered"),
                      Index("ix_assignments_open", "answered", "created_at"))


class Answer(Base):
    __tablename__ = "answers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    assignment_id: Mapped[int] = mapped_column(ForeignKey("assignments.id"), unique=True)
    item_id: Mapped[str] = mapped_column(ForeignKey("items.id"), index=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    idempotency_key: Mapped[str] = mapped_column(String(100), unique=True)
    order: Mapped[list] = mapped_column(JSON)        # image ids best first; a sub-list is a tie; [] = skipped
    outcome: Mapped[str] = mapped_column(String(16))  # ranked | tie | both_bad | skip
    extra: Mapped[dict] = mapped_column(JSON)         # answers to the batch's extra questions
    seconds: Mapped[float] = mapped_column(Float)     # from serving the item to the answer
    created_at: Mapped[float] = mapped_column(Float, default=now)


# ---- engine -------------------------------------------------------------------------------------------------
def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def normalize_url(url: str) -> str:
    """A bare path means a SQLite file; ``postgresql://`` uses psycopg 3."""
    if "://" not in url:
        return f"sqlite:///{Path(url).resolve()}"
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


# PostgreSQL: no statement (a lock wait included) runs longer than this, and no transaction idles open longer than
# that (a worker killed mid-transaction frees its locks): a request gets a 503 it may retry, never a hang.
STATEMENT_TIMEOUT_MS = 15_000
IDLE_IN_TRANSACTION_MS = 60_000
POOL_TIMEOUT_S = 10
# SQLSTATEs of a transaction the server aborted for the others' sake (a deadlock, a serialization failure): run
# again from the start, inside the server, before a client ever sees them.
RETRIED_SQLSTATES = ("40P01", "40001")
RETRIES = 6


class Unavailable(Exception):
    """The database cannot serve this request now (unreachable, timed out, or a transaction retried to the end):
    the app answers 503 with Retry-After."""


def transient(e: BaseException) -> bool:
    """A deadlock or serialization failure (PostgreSQL aborts one transaction of the cycle): retried."""
    return getattr(getattr(e, "orig", None), "sqlstate", None) in RETRIED_SQLSTATES


# What a request meets while the database cannot serve it, not a fault of the request or the code: a statement past
# its timeout, a lock not available, too many connections, the server shutting down or starting, a connection lost
# (class 08); SQLite's lock wait given up, its file not openable.
UNAVAILABLE_SQLSTATES = ("57014", "55P03", "53300", "57P01", "57P02", "57P03") + RETRIED_SQLSTATES
SQLITE_UNAVAILABLE = ("database is locked", "unable to open database file", "disk i/o error")


def unavailable(e: BaseException) -> bool:
    """Whether ``e`` means the database cannot serve now (the app's 503), not that the request or the code is wrong."""
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    if isinstance(e, (Unavailable, PoolTimeout)):
        return True
    if not isinstance(e, DBAPIError):
        return False
    if e.connection_invalidated:
        return True
    code = getattr(e.orig, "sqlstate", None)
    if code:
        return code in UNAVAILABLE_SQLSTATES or code.startswith("08")
    if type(e.orig).__module__.startswith("psycopg"):
        return True                    # psycopg's errors without a SQLSTATE: the connection failed
    return any(m in str(e.orig).lower() for m in SQLITE_UNAVAILABLE)


def retried(fn):
    """Run ``fn`` (one or more whole transactions) again when the database aborts it as a deadlock victim or a
    serialization failure, with a short random back-off; after ``RETRIES`` tries, ``Unavailable``."""
    import functools
    import random

    from sqlalchemy.exc import DBAPIError

    @functools.wraps(fn)
    def run(*args, **kw):
        for attempt in range(RETRIES):
            try:
                return fn(*args, **kw)
            except DBAPIError as e:
                if not transient(e):
                    raise
                time.sleep(random.uniform(0.005, 0.02) * 2 ** attempt)
        raise Unavailable(f"the database aborted this request {RETRIES} times as a deadlock victim: retry")
    return run


def make_engine(url: str, pool_size: int = 10, max_overflow: int | None = None) -> Engine:
    url = normalize_url(url)
    if _is_sqlite(url):
        path = url.split("sqlite:///", 1)[-1]
        if path and path != ":memory:" and not Path(path).parent.is_dir():
            raise RateError(f"--db {url}: the folder {Path(path).parent} does not exist")
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None            # transactions are begun below, not by the driver
            cur = dbapi_conn.cursor()
            for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000", "foreign_keys=ON"):
                cur.execute(f"PRAGMA {pragma}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("readonly") else "BEGIN IMMEDIATE")
    else:
        options = (f"-c statement_timeout={STATEMENT_TIMEOUT_MS} "
                   f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}")
        engine = create_engine(url, pool_size=pool_size,
                               max_overflow=pool_size if max_overflow is None else max_overflow,
                               pool_timeout=POOL_TIMEOUT_S, pool_pre_ping=True,
                               connect_args={"options": options, "connect_timeout": 5})
    return engine


class Database:
    """The engine and sessions: ``write()`` (an immediate transaction, committed on exit) and ``read()``."""

    def __init__(self, url: str, pool_size: int = 10, max_overflow: int | None = None):
        self.url = normalize_url(url)
        self.engine = make_engine(url, pool_size, max_overflow)
        self.reader = self.engine.execution_options(readonly=True)

    @contextlib.contextmanager
    def write(self):
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    @contextlib.contextmanager
    def read(self):
        with Session(self.reader, expire_on_commit=False) as s, s.begin():
            yield s

    def check(self) -> None:
        """A clear error for a database that cannot be reached or is not at the current schema."""
        from sqlalchemy import text
        from sqlalchemy.exc import OperationalError

        try:
            with self.engine.connect() as c:
                c.execute(text("select 1"))
        except OperationalError as e:
            msg = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
            raise RateError(f"--db {self.url}: cannot reach the database ({msg})") from None
        have, want = current_revision(self.engine), head_revision()
        if have != want:
            raise RateError(f"--db {self.url}: schema revision {have or 'none'}, this version needs {want}: run "
                            "'difftrain rate upgrade --db URL'")


# ---- migrations ---------------------------------------------------------------------------------------------
def _alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str) -> str:
    """Bring the database to the newest schema (creating it); returns the revision."""
    from alembic import command

    command.upgrade(_alembic_config(url), "head")
    return head_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as c:
        return MigrationContext.configure(c).get_current_revision()
