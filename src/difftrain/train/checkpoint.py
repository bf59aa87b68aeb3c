"""Full training-state checkpoints with torch.distributed.checkpoint (DCP), stored as safetensors.

Layout of ``RUN/checkpoints/step_00000123/``:
- ``*.safetensors``: every tensor: ``model.*``, ``ema.*``, ``optim.*`` (flattened AdamW state). Written
  through DCP's safetensors storage: one process writes full tensors; under FSDP each rank writes only
  its own shards (with their offsets in the file header; a replicated tensor is written once), and a
  load reshards onto any other world size. No RNG state is kept: every random draw of training is a
  function of (seed, step, sample index), so nothing per-rank needs restoring.
- ``trainer.json``: everything that is not a tensor: step, samples seen, loader and curriculum state,
  schedule state, optimizer hyper-parameters, the resolved config and the text encoder's vocabulary.
- ``COMPLETE.json``, written last: the size and the CRC-32 of each 64 MiB piece of every other file
  (``difftrain.train.verification``).

A save writes into ``step_N.partial``; the marker is written when every rank's shards and trainer.json
are on disk (and fsynced); then the directory is renamed to ``step_N`` and ``latest`` is replaced
atomically. A checkpoint counts only with its marker and only if every file matches it: ``latest()``
reports and skips one that does not (renaming it ``step_N.bad``, never deleting it) and falls back to the
previous. A crash or a write error mid-save leaves the previous checkpoint as the newest complete one.

Saves are asynchronous by default: a background thread copies the state to host memory (pinned buffers
on GPUs, reused between saves) while the next step's forward and backward run, and the trainer calls
``wait_staged`` before the optimizer step, so no snapshot is torn; the same thread then writes the shards
over a process group of its own while training goes on. The stall (planning plus any wait for staging)
is recorded and logged. How tensors reach storage (this rank's share of them, the staging buffers, device
tensors copied to the host in bounded pieces, the streaming safetensors writer) is ``checkpoint_write``.
Nothing is loaded with pickle (DCP's default metadata file is a pickle; its safetensors reader
rebuilds the metadata from the safetensors headers).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from difftrain.errors import UserError
from difftrain.parallel.dist import agree
from difftrain.train import faults, phases
from difftrain.train.checkpoint_write import StreamingSafetensorsWriter, _ReusedStager, save_share, tensor_bytes
from difftrain.parallel.reader import PlainReader
from difftrain.train.verification import (MARKER, file_digest, marker_files as _marker_files, read_sidecar, share_bytes,
                                          verify, verify_shares)

log = logging.getLogger("difftrain.checkpoint")

FORMAT = "difftrain-checkpoint/2"
STEP_DIR = re.compile(r"^step_(\d{8})$")
PARTIAL_DIR = re.compile(r"^step_(\d{8})\.partial$")


def _quiet(fn, *args, **kwargs):
    # DCP warns that it "assumes a single process" when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _split(prefix: str, sd: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors = {f"{prefix}.{k}": v for k, v in sd.items() if isinstance(v, Tensor)}
    other = {k: v for k, v in sd.items() if not isinstance(v, Tensor)}
    return tensors, other


_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SaveFailed(UserError):
    """A blocking save failed on some rank (every rank raises it): the previous checkpoint is intact."""


@dataclass
class SaveResult:
    """What one save cost and where it went. ``stall_s``: training time lost to it (staging and planning for
    an async save, everything for a blocking one)."""
    step: int
    path: Path
    stall_s: float
    started: float
    write_s: float = 0.0
    bytes: int = 0
    error: str | None = None
    rank_bytes: int = 0         # the state bytes this rank writes (and an async save stages): its save plan's share


@dataclass
class _Pending:
    step: int
    future: concurrent.futures.Future
    result: SaveResult
    staged: threading.Event


class Checkpointer:
    """Saves (async by default), verifies, finds and prunes the checkpoints of one run directory.

    ``keep``: the newest complete checkpoints kept; ``keep_every``: also keep every checkpoint whose step is
    a multiple of it (0 = none); the newest complete one is never deleted. ``on_event(kind, step, **info)``
    hears about saves, failures and checkpoints skipped as damaged."""

    def __init__(self, run_dir: str | Path, keep: int = 2, keep_every: int = 0, async_save: bool = False,
                 on_event: Callable[..., None] | None = None, timeout_minutes: float = 60.0):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep, self.keep_every, self.async_save = keep, keep_every, async_save
        self.on_event = on_event or (lambda kind, step, **info: None)
        self._pending: _Pending | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stager_obj = None
        # Async writes synchronise over a gloo group of their own, so that they never interleave with the
        # training collectives of the default group (created collectively, by every rank, here).
        # Its own timeout (train.checkpoint_timeout), not the training collectives': the write-results gather waits for
        # the slowest of hundreds of writers on a shared file system, which can take longer than a step may.
        self.group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
                      if async_save and _distributed() else None)
        self.completed: list[SaveResult] = []
        self.failed_in_row = 0            # this rank's saves that failed since the last that succeeded
        self.last_error: str | None = None
        self.last_verify: dict | None = None

    # --- finding ---------------------------------------------------------------------------------
    def _step_dirs(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=lambda p: p.name)

    def complete_steps(self) -> list[Path]:
        """Step directories with a completion marker (not checksummed: see ``latest``)."""
        return [p for p in self._step_dirs() if (p / MARKER).is_file()]

    def latest(self, checksums: bool = True) -> Path | None:
        """The newest checkpoint that is complete and verifies. One that fails is reported, renamed
        ``step_N.bad`` by rank 0 (kept for inspection, never deleted) and skipped.

        Under torch.distributed every rank takes part: rank 0's list of step directories is everyone's (a stale
        directory listing on one node must not choose another checkpoint), each rank checks every file's size and
        checksums its share of the files' pieces (``verify_shares``: at most 1/N of the bytes plus one piece), and
        the verdicts are gathered, so the choice is the same on every rank. ``last_verify`` holds the bytes each
        rank checksummed, the total and the seconds."""
        candidates = _broadcast_object([p.name for p in self._step_dirs()] if _is_rank0() else None)
        rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        for p in reversed([self.dir / name for name in candidates]):
            t0 = time.perf_counter()
            mine, files = None, _marker_files(p)
            if files is not None:
                mine = set(verify_shares(files, world)[rank])
            own = verify(p, checksums, mine)
            verdicts = _gather_objects((own, share_bytes(files, mine) if mine else 0))
            problems = [problem for problem, _ in verdicts]
            done = {"seconds": round(time.perf_counter() - t0, 3), "bytes_by_rank": [n for _, n in verdicts],
                    "total_bytes": sum(int(f["bytes"]) for f in files.values()) if files else 0}
            if all(x is None for x in problems):
                self.last_verify = done
                return p
            problem = "; ".join(f"rank {r}: {x}" if world > 1 else x for r, x in enumerate(problems) if x)
            log.warning("checkpoint %s skipped: %s", p, problem)
            self.on_event("checkpoint_skipped", int(STEP_DIR.match(p.name).group(1)), path=str(p), reason=problem)
            if _is_rank0() and (p / MARKER).is_file():   # a damaged complete one: out of the way of a new save
                bad = p.with_name(f"{p.name}.bad")
                shutil.rmtree(bad, ignore_errors=True)
                try:
                    os.replace(p, bad)
                except OSError:
                    pass
        return None

    # --- saving ----------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, ema: Any,
             extra: dict[str, Any], blocking: bool | None = None, keep=None) -> SaveResult:
        """Checkpoint the state at ``step``. Returns once the state is staged (async) or written (blocking);
        an async save's outcome is known at the next ``save``/``wait``. Errors of a blocking save raise.
        ``keep(name)``: the model tensors saved (a frozen base's are not: it is read from where it came from)."""
        blocking = (not self.async_save) if blocking is None else blocking
        self.wait()                              # one save in flight at a time
        t0 = time.perf_counter()
        started = time.time()
        final = self.dir / f"step_{step:08d}"
        partial = self.dir / f"step_{step:08d}.partial"
        error = None
        if _is_rank0():
            try:
                self._clean_partials(keep=partial)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            except OSError as e:
                error = f"{partial}: cannot create the checkpoint directory ({e})"
        said = agree(error)                 # the directory exists before any rank writes into it
        if said is not None:
            self._count(SaveResult(step, final, 0.0, started, error=said))
            raise SaveFailed(said)
        tensors, info = self._gather(model, optimizer, ema, keep)
        tensors = save_share(tensors)            # what this rank's save plan writes, and all it stages
        doc = {"format": FORMAT, "step": step, "optimizer": info, **extra}
        writer = faults.storage_writer(StreamingSafetensorsWriter, str(partial), step, save_distributed=_distributed())
        result = SaveResult(step, final, 0.0, started, rank_bytes=tensor_bytes(tensors))
        if blocking:
            try:
                with phases.phase("write"):
                    _quiet(dcp.save, tensors, storage_writer=writer)
            except (Exception, CheckpointException) as e:
                result.error = _describe(e)
            said = agree(result.error)           # every rank's shards are written before rank 0 seals it
            if said is not None:
                result.error = said
                self._abandon(partial, result)
                self._count(result)
                raise SaveFailed(f"checkpoint at step {step} failed, the previous one is intact: {said}")
            sealed = None
            try:
                self._finish(partial, final, doc, result, t0, getattr(writer, "written", None))
            except (OSError, UserError) as e:
                sealed = f"{partial}: sealing the checkpoint failed ({e})"
            # the verdict every rank sees (rank 0 sealed alone): no rank moves on, or exits, before the rename is
            # done, and a failed seal is an error on every rank at once, not a wait in a barrier
            verdict = agree(sealed)
            if verdict is not None:
                result.error = verdict
                self._abandon(partial, result)
                self._count(result)
                raise SaveFailed(f"checkpoint at step {step} failed, the previous one is intact: {verdict}")
            result.stall_s = time.perf_counter() - t0
            self._count(result)
            return result
        # Staging (the copy to host memory) runs in the background too, overlapping the next step's forward
        # and backward, which read the parameters but do not change them; ``wait_staged`` is called before
        # anything writes them (the optimizer step, the EMA swap for sampling).
        staged = threading.Event()
        result.stall_s = time.perf_counter() - t0
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="difftrain-ckpt")
        self._pending = _Pending(step, self._pool.submit(self._write, tensors, writer, partial, final, doc, result,
                                                         t0, staged), result, staged)
        return result

    def wait_staged(self) -> float:
        """Block until the save in flight has copied the state (no-op otherwise); returns the seconds waited,
        which count as checkpoint stall."""
        pending = self._pending
        if pending is None or pending.staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        pending.staged.wait()
        waited = time.perf_counter() - t0
        pending.result.stall_s += waited
        return waited

    def _stager(self):
        if self._stager_obj is None:
            self._stager_obj = _ReusedStager()
        return self._stager_obj

    def _write(self, tensors: dict[str, Tensor], writer, partial: Path, final: Path, doc: dict, result: SaveResult,
               t0: float, staged: threading.Event) -> SaveResult:
        """Background thread: stage, write this rank's shards (DCP's finish step gathers every rank's write
        results, so on rank 0 it returns after all ranks wrote), then seal and rename on rank 0."""
        try:
            try:
                with phases.phase("staging"):
                    copy = self._stager().stage(tensors)
            finally:
                staged.set()
            del tensors
            with phases.phase("write"):
                _quiet(dcp.save, copy, storage_writer=writer, process_group=self.group, no_dist=not _distributed())
        except (Exception, CheckpointException) as e:
            staged.set()
            result.error = _describe(e)
            self._abandon(partial, result)
            return result
        try:
            self._finish(partial, final, doc, result, t0, getattr(writer, "written", None))
        except OSError as e:
            result.error = f"{partial}: sealing the checkpoint failed ({e})"
            self._abandon(partial, result)
        return result

    def _finish(self, partial: Path, final: Path, doc: dict, result: SaveResult, t0: float,
                written: list[str] | None = None) -> None:
        """Rank 0: trainer.json, checksums of every file (from the writers' sidecars, or read back), the marker, the
        rename, ``latest``, retention. Other ranks: nothing. ``written``: every rank's files, from their write
        results; one the directory listing lacks (a stale listing on a shared file system) stops the seal."""
        if not _is_rank0():
            result.write_s = time.perf_counter() - t0
            return
        faults.seal_fails(result.step)
        with phases.phase("seal"):
            self._seal(partial, final, doc, result, t0, written)

    def _seal(self, partial: Path, final: Path, doc: dict, result: SaveResult, t0: float,
              written: list[str] | None) -> None:
        (partial / "trainer.json").write_text(json.dumps(doc, indent=1, default=_json_default))
        files = {}
        for f in sorted(partial.iterdir()):
            if not f.is_file() or f.name == MARKER or f.name.endswith(".digest"):
                continue
            # checksummed (and fsynced) by the rank that wrote it, or read back here (trainer.json)
            files[f.name] = read_sidecar(f) or file_digest(f, sync=True)
        missing = sorted(set(written or ()) - set(files))
        if missing:
            raise OSError(f"{', '.join(missing)} written by a rank but not in the directory listing of {partial} "
                          "(a stale listing of a shared file system?); not sealed")
        for side in partial.glob("*.digest"):
            side.unlink()
        faults.before_marker(doc["step"])
        tmp = partial / f"{MARKER}.tmp"
        with tmp.open("w") as fh:
            json.dump({"format": FORMAT, "step": doc["step"], "time": time.time(), "files": files}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, partial / MARKER)
        _fsync_dir(partial)
        if final.exists():                       # a replay reached a step saved before: replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        latest_tmp = self.dir / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.dir / "latest")
        _fsync_dir(self.dir)
        result.bytes = sum(v["bytes"] for v in files.values())
        result.write_s = time.perf_counter() - t0
        self._prune()
        self.on_event("checkpoint", doc["step"], path=str(final), bytes=result.bytes, rank0_bytes=result.rank_bytes,
                      stall_s=round(result.stall_s, 4), write_s=round(result.write_s, 3))

    def _abandon(self, partial: Path, result: SaveResult) -> None:
        log.error("checkpoint at step %d failed (the previous checkpoint is intact): %s", result.step, result.error)
        if _is_rank0():
            shutil.rmtree(partial, ignore_errors=True)
            self.on_event("checkpoint_failed", result.step, reason=result.error)

    def wait(self) -> SaveResult | None:
        """Finish the save in flight (if any) and return its result; a failed async save is logged and
        returned with ``error`` set, not raised: training goes on and the next save tries again."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        result = pending.future.result()
        self._count(result)
        return result

    def poll(self) -> None:
        """Take the outcome of an async save that has finished (without waiting for one that has not), so that
        ``failed_in_row`` is current."""
        pending = self._pending
        if pending is not None and pending.future.done():
            self.wait()

    def _count(self, result: SaveResult) -> None:
        if result.error is None:
            self.completed.append(result)
            self.failed_in_row, self.last_error = 0, None
        else:
            self.failed_in_row += 1
            self.last_error = result.error

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _clean_partials(self, keep: Path) -> None:
        """Leftovers of saves killed mid-write (never a complete checkpoint)."""
        if not self.dir.is_dir():
            return
        for p in self.dir.iterdir():
            if PARTIAL_DIR.match(p.name) and p != keep:
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        steps = self.complete_steps()
        if not steps:
            return
        keep = set(steps[-self.keep:]) | {steps[-1]}
        if self.keep_every:
            keep |= {p for p in steps if int(STEP_DIR.match(p.name).group(1)) % self.keep_every == 0}
        for old in steps:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def _gather(self, model: nn.Module, optimizer, ema, keep=None) -> tuple[dict[str, Tensor], dict[str, Any]]:
        msd, osd = _state_dicts(model, optimizer, keep)
        tensors, _ = _split("model", msd)
        opt_tensors, opt_other = _split("optim", osd)
        tensors.update(opt_tensors)
        if ema is not None:
            tensors.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
        return tensors, opt_other

    # --- loading ---------------------------------------------------------------------------------
    @staticmethod
    def read_info(path: str | Path, checksums: bool = False) -> dict[str, Any]:
        """trainer.json of a checkpoint directory; a clear error if ``path`` is not a complete one of ours.
        A run directory or its ``latest`` pointer resolve to the newest checkpoint that verifies."""
        p = Path(path)
        if not p.exists():
            raise UserError(f"{p}: no such checkpoint")
        if p.is_file() and p.name == "latest":               # RUN/checkpoints/latest names the newest
            p = p.parent.parent
        if p.is_dir() and (p / "checkpoints").is_dir():     # a run directory: take its newest checkpoint
            newest = Checkpointer(p).latest()
            if newest is None:
                raise UserError(f"{p}: run directory has no complete checkpoint yet")
            p = newest
        info_path = p / "trainer.json"
        if not p.is_dir() or not info_path.is_file():
            raise UserError(f"{p}: not a difftrain checkpoint (expected a directory with trainer.json, "
                            "written by 'difftrain train')")
        try:
            info = json.loads(info_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{info_path}: unreadable checkpoint metadata ({e})") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise UserError(f"{info_path}: not a difftrain checkpoint (format {info.get('format') if isinstance(info, dict) else None!r}, "
                            f"expected {FORMAT!r})")
        problem = verify(p, checksums)
        if problem is not None:
            raise UserError(f"{p}: not a complete checkpoint: {problem}")
        info["path"] = str(p)
        return info

    @staticmethod
    def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             ema: Any = None, keep=None) -> dict[str, Any]:
        """Load what is asked for (model; optimizer, EMA if given) in place, resharding as needed; returns
        trainer.json. ``keep(name)``: the model tensors read (as ``save``'s); the others are left as they are."""
        info = Checkpointer.read_info(path)
        p = Path(info["path"])
        msd, osd = _state_dicts(model, optimizer, keep)
        want = {f"model.{k}": v for k, v in msd.items() if isinstance(v, Tensor)}
        want.update({f"optim.{k}": v for k, v in osd.items() if isinstance(v, Tensor)})
        if ema is not None:
            want.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
        stateless = _stateless_params(model, optimizer, want, p)
        _load_or_explain(want, p)
        model_sd = {k[len("model."):]: v for k, v in want.items() if k.startswith("model.")}
        if optimizer is not None:
            opt_sd = {k[len("optim."):]: v for k, v in want.items() if k.startswith("optim.")}
            opt_sd.update(info.get("optimizer", {}))
            for param in stateless:          # as in the run that saved it: no state until its first gradient
                optimizer.state.pop(param, None)
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=opt_sd,
                           options=_OPTS if keep is None else _PARTIAL)
            for param in stateless:
                if optimizer.state.get(param):
                    raise RuntimeError("checkpoint load: a parameter with no saved optimizer state was given some")
                optimizer.state.pop(param, None)
        else:
            model.load_state_dict(model_sd, strict=keep is None)
        if ema is not None:
            ema.load_state_dict({k[len("ema."):]: v for k, v in want.items() if k.startswith("ema.")})
            ema.updates = int(info.get("ema_updates", 0))
        return info

    @staticmethod
    def load_tensors(path: str | Path, prefix: str, into: dict[str, Tensor]) -> dict[str, Tensor]:
        """Read ``prefix.*`` tensors (e.g. the EMA weights, for sampling) **into** the tensors of ``into``, in
        place and cast to their dtype: loading a model's own parameters this way costs no second copy of it.
        Returns ``into``."""
        info = Checkpointer.read_info(path)
        want = {f"{prefix}.{k}": v for k, v in into.items()}
        _load_or_explain(want, Path(info["path"]))
        return into


_PARTIAL = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def _state_dicts(model: nn.Module, optimizer, keep) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts (DCP's, for sharded models), the model's cut to ``keep``."""
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=_OPTS)
    else:
        msd, osd = model.state_dict(), {}
    if keep is not None:
        msd = {k: v for k, v in msd.items() if keep(k)}
    return msd, osd


def _stateless_params(model: nn.Module, optimizer, want: dict[str, Tensor], path: Path) -> list[nn.Parameter]:
    """Trainable parameters the checkpoint holds no optimizer state for at all: they had no gradient yet when it was
    saved (a LoKr module dropped on every step so far, a layer whose output nothing read), so the optimizer made no
    state for them. A fresh optimizer is given state for every parameter to load into; those keys are taken out of
    ``want`` and the parameters' state removed after the load, as in the run that saved it. A parameter with part of
    its state missing is left in ``want``: that is a mismatch, reported as one."""
    if optimizer is None:
        return []
    try:
        saved = set(PlainReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 -- an unreadable checkpoint is reported by the load itself
        return []
    def by_param(keys) -> dict[str, list[str]]:      # optim.state.<fqn>.<state name>: one pass, not one a parameter
        out: dict[str, list[str]] = {}
        for k in keys:
            if k.startswith("optim.state."):
                out.setdefault(k[len("optim.state."):].rsplit(".", 1)[0], []).append(k)
        return out

    wanted, held = by_param(want), by_param(saved)
    out = []
    for name, param in model.named_parameters():
        keys = wanted.get(name)
        if keys and param.requires_grad and name not in held:
            for k in keys:
                del want[k]
            out.append(param)
    return out


def _describe(e: BaseException) -> str:
    failures = getattr(e, "failures", None) or {}
    cause = next(iter(failures.values()), e)
    if isinstance(cause, tuple):                  # (exception, traceback summary) per rank
        cause = cause[0]
    text = str(cause).strip()
    return (text.splitlines()[-1] if text else type(cause).__name__)[:300]


def _load_or_explain(want: dict[str, Tensor], path: Path) -> None:
    """dcp.load, with a mismatch (missing key, other shape) reported as one line naming the tensor."""
    try:
        _quiet(dcp.load, want, storage_reader=PlainReader(str(path)))
    except (Exception, CheckpointException) as e:   # CheckpointException is a BaseException
        raise UserError(f"{path}: checkpoint does not match this model/config ({_describe(e)})") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable in checkpoint metadata: {type(o).__name__}")
