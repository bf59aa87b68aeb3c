"""Request bodies read and checked before anything uses them: every field's type, range and length, no NUL byte
(PostgreSQL refuses them in text), no NaN or Infinity, bounded nesting. A bad body raises ``BadInput`` with a
message naming the field, which the app answers with 400 (or 415 for a form of another encoding)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
HANDLE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OUTCOMES = ("ranked", "tie", "both_bad", "skip")
MAX_ID = 2 ** 31 - 1
MAX_CANDIDATES = 64
MAX_EXTRA = 8


class BadInput(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _no_constants(name: str):
    raise BadInput(f"{name} is not a JSON number")


def json_object(body: bytes) -> dict:
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except BadInput:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        raise BadInput("expected a JSON object (UTF-8)") from None
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object")
    return data


def text(value, field: str, most: int, pattern: re.Pattern | None = None) -> str:
    if not isinstance(value, str) or not value or len(value) > most or "\x00" in value:
        raise BadInput(f"{field}: expected text of 1-{most} characters")
    if pattern is not None and not pattern.match(value):
        raise BadInput(f"{field} {value[:40]!r}: not of the expected form")
    return value


@dataclass
class AnswerBody:
    assignment: int
    key: str
    order: list
    outcome: str
    extra: dict


def answer_body(body: bytes) -> AnswerBody:
    """``{"assignment": int, "key": str, "order": [handle | [handle, ...], ...], "outcome": str, "extra": {str: str}}``;
    order, outcome and extra may be left out (ranked, no extra)."""
    data = json_object(body)
    unknown = sorted(set(data) - {"assignment", "key", "order", "outcome", "extra"})
    if unknown:
        raise BadInput(f"unknown field(s) {[u[:32] for u in unknown[:5]]}")
    a = data.get("assignment")
    if isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= MAX_ID:
        raise BadInput(f"assignment: expected an integer in [1, {MAX_ID}]")
    key = text(data.get("key"), "key", 100, KEY)
    outcome = data.get("outcome", "ranked")
    if outcome not in OUTCOMES:
        raise BadInput(f"outcome: expected one of {OUTCOMES}")
    order = data.get("order", [])
    if not isinstance(order, list) or len(order) > MAX_CANDIDATES:
        raise BadInput(f"order: expected a list of at most {MAX_CANDIDATES} handles or lists of handles")
    for g in order:
        group = g if isinstance(g, list) else [g]
        if not group or len(group) > MAX_CANDIDATES:
            raise BadInput("order: an empty or oversized group")
        for h in group:
            text(h, "order's handle", 64, HANDLE)
    extra = data.get("extra") or {}
    if not isinstance(extra, dict) or len(extra) > MAX_EXTRA:
        raise BadInput(f"extra: expected an object of at most {MAX_EXTRA} text answers")
    for k, v in extra.items():
        text(k, "extra's question", 32)
        text(v, f"extra[{k!r}]", 64)
    return AnswerBody(a, key, order, outcome, extra)


def form(body: bytes, content_type: str | None, fields: dict[str, int]) -> dict[str, str]:
    """An HTML form (``application/x-www-form-urlencoded``): each of ``fields`` (name -> most characters), '' when
    absent, longer values cut to their most; no other encoding."""
    if (content_type or "").split(";")[0].strip().lower() != "application/x-www-form-urlencoded":
        raise BadInput("expected a form (application/x-www-form-urlencoded)", status=415)
    try:
        parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=32)
    except (UnicodeDecodeError, ValueError):
        raise BadInput("a form of at most 32 UTF-8 fields") from None
    out = {}
    for name, most in fields.items():
        v = parsed.get(name, [""])[0]
        if "\x00" in v:
            raise BadInput(f"{name}: a NUL byte")
        out[name] = v[:most]
    return out
