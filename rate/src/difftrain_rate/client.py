"""A scripted rater: answers through the app's HTTP API with an API token, as a person's browser would (one
idempotency key per item, so a retried post after a lost response counts once)."""

from __future__ import annotations

import time
import uuid

import httpx


class RaterClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)

    def next(self) -> dict | None:
        """Take the next item (the one held, if any): POST, as taking one changes what the server holds."""
        r = self.http.post("/api/next")
        r.raise_for_status()
        data = r.json()
        return data if data.get("item") else None

    def image(self, url: str) -> bytes:
        r = self.http.get(url)
        r.raise_for_status()
        return r.content

    def answer(self, item: dict, order: list, outcome: str = "ranked", extra: dict | None = None,
               key: str | None = None, retries: int = 5) -> dict:
        """Post an answer; on a lost connection or a 5xx, post it again with the same key."""
        body = {"assignment": item["assignment"], "key": key or uuid.uuid4().hex, "order": order, "outcome": outcome,
                "extra": extra or {}}
        for attempt in range(retries + 1):
            try:
                r = self.http.post("/api/answer", json=body)
                if r.status_code < 500:
                    r.raise_for_status()
                    return r.json()
            except httpx.TransportError:
                if attempt == retries:
                    raise
            time.sleep(0.2 * (attempt + 1))
        r.raise_for_status()
        return r.json()

    def undo(self) -> str | None:
        r = self.http.post("/api/undo")
        r.raise_for_status()
        return r.json()["undone"]

    def close(self) -> None:
        self.http.close()
