"""Which phase of a step or a checkpoint each rank is in, for a fault harness that kills at random moments
(``bench/chaos.py``'s ``anytime`` fault) and must say what each kill hit.

Armed by the environment variable ``DIFFTRAIN_PHASE_BOARD=PATH``: each rank maps ``PATH.rank<R>``, a small
file holding its pid and one counter a phase (several may be active at once: an async checkpoint writes in a
background thread while the next step runs), which it raises on entering a phase and lowers on leaving.
``DIFFTRAIN_PHASE_DWELL_S`` makes every phase last at least that long (a sleep on entering: nothing computed
changes), so that a harness polling the board can land a kill inside even a millisecond phase. Unset, ``phase``
is a no-op context manager.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PHASES = ("forward", "backward", "optimizer", "staging", "write", "seal")
_HEADER = struct.Struct("<q")          # the pid
SIZE = _HEADER.size + len(PHASES)

_state: dict = {"board": None, "dwell": 0.0, "lock": threading.Lock()}


def configure(rank: int) -> None:
    """Map this rank's board when ``DIFFTRAIN_PHASE_BOARD`` is set (every phase at 0)."""
    base = os.environ.get("DIFFTRAIN_PHASE_BOARD")
    if not base:
        _state["board"] = None
        return
    path = Path(f"{base}.rank{rank}")
    with open(path, "wb") as fh:
        fh.write(_HEADER.pack(os.getpid()) + bytes(len(PHASES)))
    fd = os.open(path, os.O_RDWR)
    try:
        _state["board"] = mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)
    _state["dwell"] = float(os.environ.get("DIFFTRAIN_PHASE_DWELL_S", "0") or 0)


@contextmanager
def phase(name: str):
    board = _state["board"]
    if board is None:
        yield
        return
    i = _HEADER.size + PHASES.index(name)
    with _state["lock"]:
        board[i] = min(255, board[i] + 1)
    try:
        if _state["dwell"]:
            time.sleep(_state["dwell"])
        yield
    finally:
        with _state["lock"]:
            board[i] = max(0, board[i] - 1)


def read(path: str | Path) -> tuple[int, list[str]] | None:
    """(pid, active phases) of a board file, or None when it is not (yet) there."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if len(raw) < SIZE:
        return None
    (pid,) = _HEADER.unpack_from(raw)
    return pid, [p for j, p in enumerate(PHASES) if raw[_HEADER.size + j]]
