"""Read a data source ahead in a background thread, keeping its state exact.

``Prefetched(source, depth)`` runs ``next(source)`` up to ``depth`` steps ahead of the trainer and keeps,
with each step's batches, the source's state *after* that step. ``state_dict`` returns the state of the
last step the trainer consumed (not of the steps read ahead), so a checkpoint resumes exactly where the
optimizer stopped; ``load_state_dict`` before the first step restores the source directly.
"""

from __future__ import annotations

import copy
import queue
import threading


class Prefetched:
    def __init__(self, source, depth: int = 2):
        self.source, self.depth = source, max(1, int(depth))
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._state = copy.deepcopy(source.state_dict())

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = (next(self.source), copy.deepcopy(self.source.state_dict()))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._queue.put(e)

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="difftrain-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batches, self._state = item
        return batches

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load the data source's state before the first step")
        self.source.load_state_dict(state)
        self._state = copy.deepcopy(self.source.state_dict())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while True:                      # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=30)
        if hasattr(self.source, "close"):
            self.source.close()

    def __getattr__(self, name):             # the wrapped source's other attributes (e.g. errors)
        return getattr(self.source, name)
