"""Fault injection for the reliability harness (``bench/chaos.py``) and tests.

Faults are armed by the environment variable ``DIFFTRAIN_FAULTS``: a comma-separated list of
``KIND@STEP`` or ``KIND@STEP:RANK`` (rank 0 when not given; ``*`` = every rank), steps numbered from 1 as
in the metrics. Kinds:

- ``kill``: SIGKILL of the rank before step STEP runs;
- ``killsave``: SIGKILL of rank 0 while the checkpoint of STEP is being sealed (shards written, no marker);
- ``enospc`` / ``erofs``: the checkpoint of STEP fails in the storage writer with that errno;
- ``nan``: the loss of STEP is made non-finite on the rank;
- ``hang``: the rank stops making progress before step STEP (sleeps), for the watchdog to find;
- ``slow``: the rank sleeps ``DIFFTRAIN_SLOW_S`` seconds (default 0.5) in every step from STEP on;
- ``pause``: the rank sleeps ``DIFFTRAIN_SLOW_S`` seconds once, before step STEP (a long compilation);
- ``sigterm``: the rank sends itself SIGTERM before step STEP runs (a preemption notice);
- ``corrupt``: before step STEP, the rank flips bytes in the newest complete checkpoint's largest file, then
  SIGKILLs itself (the restart must detect the damage and resume from the previous checkpoint);
- ``truncate``: the same with that file cut to half its length (a shard a full disk or a lost write left short);
- ``enospc_partial``: the checkpoint of STEP writes the rank's first shard file, cuts it to half its length and
  fails with ENOSPC (a disk that filled up part way through a shard);
- ``unreadable``: a store-fed rank's first row of step STEP reads as damaged (the row is left out of the step and
  counted against ``data.max_error_rate``), every time the step is read: unlike the others, it has no marker;
- ``sealfail``: sealing the checkpoint of STEP fails on rank 0 alone (``trainer.json`` cannot be written: ENOSPC),
  after every rank wrote its shards;
- ``valunreadable``: the store rows of the rank's share of the validation set at step STEP read as damaged (every
  time, like ``unreadable``);
- ``savefail``: every checkpoint from step STEP on fails on the rank with EIO in the storage writer (a filesystem
  that keeps failing; unlike ``enospc``, not once).

``DIFFTRAIN_SAMPLE_LOG=PATH`` makes every rank append, per step, the sample ids of its batches to
``PATH.rank<R>`` (JSON lines), so that a harness can check the sample stream for repeats and gaps.

Each fault but ``unreadable``, ``valunreadable`` and ``savefail`` fires once per run directory (a marker under ``RUN/faults/`` records it), so a
restarted or requeued job does not meet it again; unset, nothing here does anything.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("kill", "killsave", "enospc", "erofs", "nan", "hang", "slow", "pause", "sigterm", "corrupt", "truncate",
         "enospc_partial", "unreadable", "sealfail", "valunreadable", "savefail")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: str     # a rank number or "*"

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


def parse(spec: str) -> list[Fault]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, rest = item.partition("@")
        step, _, rank = rest.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and rank != "*" and not rank.isdigit()):
            raise ValueError(f"DIFFTRAIN_FAULTS: {item!r} is not KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}")
        out.append(Fault(kind, int(step), rank or "0"))
    return out


_state: dict = {"faults": [], "dir": None, "rank": 0}


def configure(run_dir: str | Path, rank: int) -> None:
    """Arm the faults of ``DIFFTRAIN_FAULTS`` for this rank of this run directory."""
    _state["faults"] = parse(os.environ.get("DIFFTRAIN_FAULTS", ""))
    _state["dir"] = Path(run_dir) / "faults"
    _state["rank"] = rank


def _armed(kind: str, step: int | None = None) -> Fault | None:
    rank = _state["rank"]
    for f in _state["faults"]:
        if f.kind != kind or (step is not None and f.step != step) or f.rank not in ("*", str(rank)):
            continue
        marker = _state["dir"] / f"{f.name}.r{rank}"
        if marker.exists():
            continue
        return f
    return None


def _fire(f: Fault) -> None:
    d = _state["dir"]
    d.mkdir(parents=True, exist_ok=True)
    marker = d / f"{f.name}.r{_state['rank']}"
    with marker.open("w") as fh:
        fh.write(f"{time.time()}\n")
        fh.flush()
        os.fsync(fh.fileno())


def at_step(step: int, wait=None) -> None:
    """Called before step ``step`` runs: kill, corrupt, hang, slow and SIGTERM faults (``wait``: finishes a
    checkpoint in flight)."""
    if not _state["faults"]:
        return
    for kind in ("corrupt", "truncate"):
        if (f := _armed(kind, step)) is not None:
            if wait is not None:
                wait()
            ckpts = _state["dir"].parent / "checkpoints"
            done = sorted(p for p in ckpts.glob("step_*") if (p / "COMPLETE.json").is_file())
            if done:
                target = max(done[-1].glob("*.safetensors"), key=lambda p: p.stat().st_size)
                size = target.stat().st_size
                with target.open("r+b") as fh:
                    if kind == "truncate":
                        fh.truncate(size // 2)
                    else:
                        fh.seek(size // 2)
                        chunk = bytearray(fh.read(64))
                        fh.seek(size // 2)
                        fh.write(bytes(b ^ 0xFF for b in chunk))
            _fire(f)
            os.kill(os.getpid(), signal.SIGKILL)
    if (f := _armed("kill", step)) is not None:
        _fire(f)
        os.kill(os.getpid(), signal.SIGKILL)
    if (f := _armed("sigterm", step)) is not None:
        _fire(f)
        os.kill(os.getpid(), signal.SIGTERM)
    if (f := _armed("hang", step)) is not None:
        _fire(f)
        while True:              # a rank that stopped making progress: only the watchdog ends this
            time.sleep(3600)
    if (f := _armed("pause", step)) is not None:
        _fire(f)
        time.sleep(float(os.environ.get("DIFFTRAIN_SLOW_S", "0.5")))
    for f in _state["faults"]:
        if f.kind == "slow" and step >= f.step and f.rank in ("*", str(_state["rank"])):
            time.sleep(float(os.environ.get("DIFFTRAIN_SLOW_S", "0.5")))


def record_samples(step: int, ids: list[int]) -> None:
    path = os.environ.get("DIFFTRAIN_SAMPLE_LOG")
    if not path:
        return
    line = json.dumps({"step": step, "ids": ids}) + "\n"
    fd = os.open(f"{path}.rank{_state['rank']}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def nan_at(step: int) -> bool:
    if not _state["faults"] or (f := _armed("nan", step)) is None:
        return False
    _fire(f)
    return True


def unreadable_at(step: int) -> bool:
    """Whether this rank's first row of store step ``step`` is to read as damaged: every time that step is read (a
    damaged row stays damaged, so a replay of the step after a restart meets it again)."""
    rank = str(_state["rank"])
    return any(f.kind == "unreadable" and f.step == step and f.rank in ("*", rank) for f in _state["faults"])


def validation_unreadable_at(step: int) -> bool:
    """Whether this rank's share of the store's validation rows at step ``step`` is to read as damaged."""
    rank = str(_state["rank"])
    return any(f.kind == "valunreadable" and f.step == step and f.rank in ("*", rank) for f in _state["faults"])


def seal_fails(step: int) -> None:
    """Called on rank 0 as it seals the checkpoint of ``step``: an ENOSPC there, once."""
    if _state["faults"] and (f := _armed("sealfail", step)) is not None:
        _fire(f)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "trainer.json")


def before_marker(step: int) -> None:
    """Called on rank 0 between the shards and the completion marker of the checkpoint of ``step``."""
    if _state["faults"] and (f := _armed("killsave", step)) is not None:
        _fire(f)
        os.kill(os.getpid(), signal.SIGKILL)


def storage_writer(cls, path: str, step: int | None = None, **kwargs):
    """DCP storage writer for a checkpoint; one that fails with ENOSPC/EROFS when such a fault is armed."""
    for kind, code in (("enospc", errno.ENOSPC), ("erofs", errno.EROFS)):
        if _state["faults"] and step is not None and (f := _armed(kind, step)) is not None:
            _fire(f)

            class Failing(cls):
                def write_data(self, plan, planner):
                    raise OSError(code, os.strerror(code), path)
            return Failing(path, **kwargs)
    rank = str(_state["rank"])
    if step is not None and any(f.kind == "savefail" and step >= f.step and f.rank in ("*", rank)
                                for f in _state["faults"]):
        class Broken(cls):
            def write_data(self, plan, planner):
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return Broken(path, **kwargs)
    if _state["faults"] and step is not None and (f := _armed("enospc_partial", step)) is not None:
        _fire(f)

        class PartlyWritten(cls):
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                results = fut.wait()
                if results:
                    first = Path(self.path) / results[0].storage_data.relative_path
                    with first.open("r+b") as fh:
                        fh.truncate(first.stat().st_size // 2)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return PartlyWritten(path, **kwargs)
    return cls(path, **kwargs)
