"""Where the routes' work runs: one thread per process, answers before pages.

Database work and Argon2 never run on the event loop (it would stall every connection of the process). Nor do
routes run in a crowd of pool threads: on a small machine several page threads fighting for the GIL and
SQLite's write lock made a 3 ms answer wait behind all of them. One thread runs the routes' work in order of
priority, then arrival: an answer waits at most for the page in progress (docs/rating.md, the load figures).
Sign-ins run in a pool of their own (``app.SIGN_IN_THREADS``): Argon2 releases the GIL.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading

ANSWERS = 0          # short writes a rater waits on: answer, undo, sign out
PAGES = 1            # pages, the API's next item, images, admin


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RouteThread:
    def __init__(self, name: str = "difftrain-rate-routes"):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            _, _, work, future, loop = self._queue.get()
            try:
                result, error = work(), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting route, which raises it
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:         # the loop closed meanwhile (a test client went away): nothing awaits
                pass

    async def run(self, priority: int, work):
        """``work()`` on the route thread; its result (or its exception) here."""
        self._ensure_started()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._order), work, future, loop))
        return await future
