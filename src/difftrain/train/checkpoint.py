"""Full training-state checkpoints with torch.distributed.checkpoint (DCP), stored as safetensors.

Layout of ``RUN/checkpoints/step_00000123/``:
- ``*.safetensors``: every tensor: ``model.*``, ``ema.*``, ``optim.*`` (flattened AdamW state). Written
  through DCP's safetensors storage: one process writes full tensors; under FSDP each rank writes only
  its own shards (with their offsets in the file header; a replicated tensor is written once), and a
  load reshards onto any other world size. No RNG state is kept: every random draw of training is a
  function of (seed, step, sample index), so nothing per-rank needs restoring.
- ``trainer.json``: everything that is not a tensor: step, loader and schedule state, optimizer
  hyper-parameters, the resolved config and the text encoder's vocabulary, and a format marker.

Nothing is loaded with pickle (DCP's default metadata file is a pickle; its safetensors reader
rebuilds the metadata from safetensors headers). A checkpoint is written to ``step_N.partial`` and
renamed when complete, then ``latest`` is updated atomically: a crash mid-save leaves the previous
checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from difftrain.errors import UserError

FORMAT = "difftrain-checkpoint/1"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def _quiet(fn, *args, **kwargs):
    # DCP warns that it "assumes a single process" when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _distributed() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _all_ok(ok: bool) -> bool:
    """True on every rank if it is true on every rank (a barrier that carries a verdict, so that a failure on
    one rank is an error on all of them, not a wait until the collective timeout)."""
    if not torch.distributed.is_initialized():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    if torch.distributed.get_backend() == "nccl":
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _split(prefix: str, sd: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors = {f"{prefix}.{k}": v for k, v in sd.items() if isinstance(v, Tensor)}
    other = {k: v for k, v in sd.items() if not isinstance(v, Tensor)}
    return tensors, other


_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    # --- finding ---------------------------------------------------------------------------------
    def complete_steps(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and (p / "trainer.json").is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        pointer = self.dir / "latest"
        if pointer.is_file():
            target = self.dir / pointer.read_text().strip()
            if (target / "trainer.json").is_file():
                return target
        steps = self.complete_steps()
        return steps[-1] if steps else None

    # --- saving ----------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, ema: Any,
             extra: dict[str, Any]) -> Path:
        final = self.dir / f"step_{step:08d}"
        partial = self.dir / f"step_{step:08d}.partial"
        error = None
        if _is_rank0():
            try:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            except OSError as e:
                error = f"{partial}: cannot create the checkpoint directory ({e})"
        if not _all_ok(error is None):   # the directory exists before any rank writes into it
            raise UserError(error or f"{partial}: rank 0 could not create the checkpoint directory")
        tensors, info = self._gather(model, optimizer, ema)
        writer = HuggingFaceStorageWriter(str(partial), save_distributed=_distributed())
        _quiet(dcp.save, tensors, storage_writer=writer)
        _barrier()                       # every rank's shards are written before rank 0 seals the checkpoint
        if _is_rank0():
            doc = {"format": FORMAT, "step": step, "optimizer": info, **extra}
            (partial / "trainer.json").write_text(json.dumps(doc, indent=1, default=_json_default))
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            tmp = self.dir / "latest.tmp"
            tmp.write_text(final.name)
            os.replace(tmp, self.dir / "latest")
            for old in self.complete_steps()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()                       # no rank moves on (or exits) before the rename is done
        return final

    def _gather(self, model: nn.Module, optimizer, ema) -> tuple[dict[str, Tensor], dict[str, Any]]:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer, options=_OPTS)
        else:
            msd, osd = model.state_dict(), {}
        tensors, _ = _split("model", msd)
        opt_tensors, opt_other = _split("optim", osd)
        tensors.update(opt_tensors)
        if ema is not None:
            tensors.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
        return tensors, opt_other

    # --- loading ---------------------------------------------------------------------------------
    @staticmethod
    def read_info(path: str | Path) -> dict[str, Any]:
        """trainer.json of a checkpoint directory; a clear error if ``path`` is not one of ours."""
        p = Path(path)
        if not p.exists():
            raise UserError(f"{p}: no such checkpoint")
        if p.is_file() and p.name == "latest":               # RUN/checkpoints/latest names the newest
            p = p.parent / p.read_text().strip()
        elif p.is_dir() and (p / "checkpoints").is_dir():    # a run directory: take its newest checkpoint
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
        info["path"] = str(p)
        return info

    @staticmethod
    def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             ema: Any = None) -> dict[str, Any]:
        """Load what is asked for (model; optimizer, EMA if given) in place, resharding as needed; returns
        trainer.json."""
        info = Checkpointer.read_info(path)
        p = Path(info["path"])
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer, options=_OPTS)
        else:
            msd, osd = model.state_dict(), {}
        want = {f"model.{k}": v for k, v in msd.items() if isinstance(v, Tensor)}
        want.update({f"optim.{k}": v for k, v in osd.items() if isinstance(v, Tensor)})
        if ema is not None:
            want.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
        _load_or_explain(want, p)
        model_sd = {k[len("model."):]: v for k, v in want.items() if k.startswith("model.")}
        if optimizer is not None:
            opt_sd = {k[len("optim."):]: v for k, v in want.items() if k.startswith("optim.")}
            opt_sd.update(info.get("optimizer", {}))
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=opt_sd, options=_OPTS)
        else:
            model.load_state_dict(model_sd)
        if ema is not None:
            ema.load_state_dict({k[len("ema."):]: v for k, v in want.items() if k.startswith("ema.")})
            ema.updates = int(info.get("ema_updates", 0))
        return info

    @staticmethod
    def load_tensors(path: str | Path, prefix: str, like: dict[str, Tensor]) -> dict[str, Tensor]:
        """Read ``prefix.*`` tensors shaped as ``like`` (e.g. EMA weights for sampling)."""
        info = Checkpointer.read_info(path)
        want = {f"{prefix}.{k}": v.clone() for k, v in like.items()}
        _load_or_explain(want, Path(info["path"]))
        return {k[len(prefix) + 1:]: v for k, v in want.items()}


def _load_or_explain(want: dict[str, Tensor], path: Path) -> None:
    """dcp.load, with a mismatch (missing key, other shape) reported as one line naming the tensor."""
    try:
        _quiet(dcp.load, want, storage_reader=HuggingFaceStorageReader(str(path)))
    except (Exception, CheckpointException) as e:   # CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        cause = next(iter(failures.values()), e)
        if isinstance(cause, tuple):                  # (exception, traceback summary) per rank
            cause = cause[0]
        detail = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        raise UserError(f"{path}: checkpoint does not match this model/config ({detail[:300]})") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable in checkpoint metadata: {type(o).__name__}")
