"""The training loop, the same on one CPU process, on gloo processes and on GPUs under torchrun.

A step takes this rank's micro-batches of the global batch (the loader decides their task), draws each
sample's timestep and noise from (seed, step, global sample index), noises the target tokens, predicts,
and adds the MSE against v = eps - x0 over the target tokens divided by the *global* target-token count
of the step. Gradients are summed over ranks (FSDP's own division is off), reduced once per step (not
per micro-batch), clipped by the global norm; then AdamW and the EMA. So N ranks compute what 1 rank
computes, up to reduction order. Everything the loop depends on is in the checkpoint (model, EMA,
optimizer, schedule, loader position, step), so rerunning on the same run directory continues the same
sample stream, on any world size that divides the global batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config, to_dict, to_toml
from difftrain.errors import UserError
from difftrain.data import build_source, vocabulary_for, world_from_config
from difftrain.data.batch import Batch
from difftrain.diffusion.flow import FlowSpec, draw_t_and_noise, flow_loss, loss_weight, noisy_input, to_velocity
from difftrain.diffusion.pipeline import Pipeline, autocast
from difftrain.models import build_autoencoder, build_dit, build_text_encoder, dit_params, num_params
from difftrain.parallel import parallelize
from difftrain.parallel.compile import compile_count, use_compile_cache
from difftrain.parallel.cp import cp_disabled, shard_sequence
from difftrain.parallel.dist import ParallelEnv, all_reduce_sum, batch_split, init_distributed, set_collective_timeout
from difftrain.parallel.flops import mfu, peak_flops, step_flops
from difftrain.parallel.fsdp import all_reduce_grads, clip_grad_norm, set_gradient_sync, write_param
from difftrain.train import faults
from difftrain.train.checkpoint import Checkpointer
from difftrain.train.ema import EMA
from difftrain.train.health import JsonLogHandler, Preemption, SpikeDetector, Watchdog, run_id, stragglers, \
    write_requeue_marker, REQUEUE_MARKER
from difftrain.train.metrics import MetricsLogger
from difftrain.train.schedule import lr_at

log = logging.getLogger("difftrain.train")


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on devices with fast bf16 (CUDA); 'auto' stays fp32 on CPUs, where bf16 is emulated."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int = 0          # real (unpadded) tokens of the global batch
    samples: int = 0
    flops: float = 0.0       # DiT training FLOPs of the global batch
    skipped: bool = False    # non-finite loss or gradient: no update
    stop: bool = False       # some rank was asked to stop (preemption): every rank stops after this step
    fwd_bwd_s: float = 0.0
    optim_s: float = 0.0
    wait_s: float = 0.0      # time in the step's explicit collectives (a straggler waits least)


class StepClock:
    """Training speed for ``train.minutes``: every ``every`` steps, the (steps, seconds) of the last
    ``window`` intervals, skipping the first ``skip`` steps (allocator warm-up, compilation). Intervals are
    long enough to average the task mixture (keyframe batches cost several times a t2i batch); only the
    recent ones count, so a slow start (another process, a cold page cache) does not shorten the run."""

    def __init__(self, every: int = 60, window: int = 6, skip: int = 5):
        self.every, self.skip = every, skip
        self.marks: deque[tuple[int, float]] = deque(maxlen=window + 1)   # (step, seconds) at each interval's end

    def observe(self, step: int, seconds: float) -> tuple[int, float] | None:
        if not self.marks:
            if step >= self.skip:
                self.marks.append((step, seconds))
            return None
        if step - self.marks[-1][0] < self.every:
            return None
        self.marks.append((step, seconds))
        return step - self.marks[0][0], seconds - self.marks[0][1]


# Config keys a resumed run may change without --allow-config-change: how the job runs, not what it computes.
ALWAYS_CHANGEABLE = ("run.out_dir", "parallel.", "train.steps", "train.minutes", "train.log_every",
                     "train.sample_every", "train.checkpoint_every", "train.keep_checkpoints", "train.keep_every",
                     "train.async_checkpoint", "train.metrics_port", "train.threads", "train.compile",
                     "train.compile_cache", "train.micro_batch", "data.read_threads", "data.prefetch",
                     "data.cache_dir", "data.cache_gb", "data.max_error_rate", "sample.", "eval.", "health.")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "sources":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """Keys whose value differs between a checkpoint's config and this run's, other than those that may
    change; each as 'key: saved -> now'."""
    a, b = _flat(saved), _flat(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key.startswith(ALWAYS_CHANGEABLE):
            continue
        if any(key == x or key.startswith(x.rstrip(".") + ".") for x in allowed):
            continue
        out.append(f"{key}: {a.get(key, '(absent)')!r} -> {b.get(key, '(absent)')!r}")
    return out


def _broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's value on every rank."""
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.broadcast(t, 0)
    return int(t.item())


def _mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20    # peak RSS (kB on Linux)


class Trainer:
    """``resume``: continue from the newest complete checkpoint of the run directory (False: refuse a run
    directory that has one). ``allow_config_change``: config keys that may differ from the checkpoint's."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, env: ParallelEnv | None = None,
                 resume: bool = True, allow_config_change: tuple[str, ...] = ()):
        self.cfg, tc = cfg, cfg.train
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        self.env = env or init_distributed(cfg)
        faults.configure(self.run_dir, self.env.rank)
        self.run_id = run_id()
        self.log_handler = JsonLogHandler(self.run_dir / "logs" / f"rank_{self.env.rank}.jsonl", self.run_id,
                                          self.env.rank)
        root_logger = logging.getLogger("difftrain")
        root_logger.addHandler(self.log_handler)
        if root_logger.getEffectiveLevel() > logging.INFO:   # the JSON log keeps INFO whatever the console shows
            root_logger.setLevel(logging.INFO)
        self.metrics = MetricsLogger(self.run_dir, port=(tc.metrics_port + self.env.rank) if tc.metrics_port else 0)
        self.device = self.env.device
        self.amp = amp_dtype(tc.precision, self.device)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if cfg.data.source == "store":   # global and micro-batches per bucket: the store loader checks them
            self.micro_batch, self.accum = 0, 1
        else:
            self.micro_batch, self.accum = batch_split(tc.global_batch, tc.micro_batch, self.env.dp_size)
        self.checkpointer = Checkpointer(self.run_dir, tc.keep_checkpoints, tc.keep_every, tc.async_checkpoint,
                                         on_event=self.metrics.event)
        found = self._find_checkpoint()
        if found is not None and not resume:
            raise UserError(f"{self.run_dir}: holds a checkpoint ({found.name}) and resuming was refused "
                            "(--no-resume): use another run directory or drop --no-resume")
        info = Checkpointer.read_info(found) if found else None
        if info is not None:
            changed = config_changes(info.get("config", {}), to_dict(cfg), tuple(allow_config_change))
            if changed:
                raise UserError(f"{self.run_dir}: this run directory was trained with another config "
                                f"(checkpoint -> now): {'; '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. "
                                "Pass --allow-config-change " + " ".join(c.split(":")[0] for c in changed[:8]) +
                                " to continue with the change, or use another run directory")
        torch.manual_seed(cfg.run.seed)

        ae_cfg = cfg.autoencoder
        self.autoencoder = build_autoencoder(ae_cfg.kind, ae_cfg.factor, ae_cfg.path, ae_cfg.scaling,
                                             ae_cfg.shift).to(self.device)
        vocab = info.get("text_encoder", {}).get("vocabulary") if info else None
        if vocab is None and cfg.text.kind == "words":
            vocab = vocabulary_for(cfg)
        self.text_encoder = build_text_encoder(cfg, vocab, self.device)
        self.model = self._build_model(found is None)
        self.dit = self.model["dit"]
        self.flow = FlowSpec.from_config(cfg.diffusion)
        # Groups by weight decay, and sharded (DTensor) apart from replicated parameters: a foreach step
        # over a mix of the two is not supported by every torch release.
        groups: dict[tuple[bool, bool], list] = {}
        for name, p in self.model.named_parameters():
            decays = p.ndim >= 2 and "embed" not in name
            groups.setdefault((decays, any(p is q for q in self.replicated)), []).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": ps, "weight_decay": tc.weight_decay if decays else 0.0} for (decays, _), ps in groups.items()],
            lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)
        self.ema = EMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None

        self.loader = build_source(cfg, self.autoencoder, self.text_encoder, self.env.dp_rank, self.env.dp_size,
                                   self.device, self.micro_batch)
        self.step = 0
        self.samples_seen = 0
        self.restarts = self.rollbacks = self.skipped_steps = 0
        self.consecutive_bad = 0
        self.lr_scale = 1.0
        self.skip_steps: set[int] = set(self._read_skip_file())
        hc = cfg.health
        # one detector per task: the tasks' loss levels differ more than a spike within one task
        self.spikes: dict[str, SpikeDetector] | None = {} if hc.spike_z > 0 else None
        self.preemption = Preemption()
        self.watchdog: Watchdog | None = None
        self.last_save = None
        self.stall_s = 0.0
        self.straggler_info: dict = {}
        self.total_steps = tc.steps
        self.budget_fixed = tc.minutes == 0
        self.train_seconds = 0.0
        self.peak, self.peak_source = self._peak()
        self.compiled_graphs = compile_count()
        self.timeout_tightened = False
        if found is not None:
            self._resume(found)
            self.restarts += 1
            self.metrics.event("resume", self.step, path=str(found), restarts=self.restarts,
                               restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
            (self.run_dir / REQUEUE_MARKER).unlink(missing_ok=True)   # this (re)start answers a requeue

    # --- construction -----------------------------------------------------------------------------
    def _build_model(self, fresh: bool) -> nn.ModuleDict:
        """The DiT is built on the meta device, wrapped (CP, AC, compile, FSDP), then materialised and
        initialised shard by shard, so no rank ever holds the unsharded model. The initial weights depend
        only on the seed (per-parameter generators), not on the world size or mesh."""
        cfg = self.cfg
        params = dit_params(cfg, self.autoencoder.latent_channels * 4, self.text_encoder.dim,
                            self.text_encoder.pooled_dim)
        modules = {"dit": build_dit(params, device="meta")}
        if getattr(self.text_encoder, "trainable", False):
            modules["text"] = self.text_encoder
        model = nn.ModuleDict(modules)
        if cfg.train.compile and cfg.train.compile_cache != "off":
            use_compile_cache(cfg.train.compile_cache or self.run_dir / "compile_cache")
        self.fsdp_units, self.replicated = parallelize(model, cfg, self.env, self.amp)
        dit = model["dit"]
        dit.to_empty(device="cpu" if cfg.parallel.cpu_offload and self.fsdp_units else self.device)
        if cfg.model.init_from and fresh:        # every DiT parameter is read from there (checked)
            from difftrain.parallel.pretrained import load_pretrained
            report = load_pretrained(dit, cfg.model.init_from)
            log.info("initialised from %s (%s)", cfg.model.init_from, report)
        else:
            with torch.no_grad():
                dit.init_weights(cfg.model.init, cfg.run.seed, write_param)
        return model

    def _peak(self) -> tuple[float | None, str]:
        try:
            return peak_flops(self.device, self.amp or torch.float32)
        except ValueError as e:          # an accelerator missing from the peak table: no MFU, say why once
            log.warning("MFU not reported: %s", e)
            return None, str(e)

    # --- state ------------------------------------------------------------------------------------
    def _find_checkpoint(self) -> Path | None:
        """The newest complete, verified checkpoint, chosen by rank 0 (which also sets damaged ones aside)
        and broadcast, so that every rank resumes from the same one."""
        step = -1
        if self.env.is_main:
            newest = self.checkpointer.latest()
            step = int(newest.name.split("_")[1]) if newest is not None else -1
        step = _broadcast_int(step, self.device)
        return None if step < 0 else self.checkpointer.dir / f"step_{step:08d}"

    def _skip_file(self) -> Path:
        return self.run_dir / "skip_steps.json"

    def _read_skip_file(self) -> list[int]:
        try:
            return [int(x) for x in json.loads(self._skip_file().read_text())]
        except (OSError, ValueError, TypeError):
            return []

    def _record_skip(self, step: int) -> None:
        """Steps (numbered from 1, as in the metrics) whose batch is never trained on, kept in the run directory
        (not only in checkpoints), so that a replay from an older checkpoint skips them too."""
        self.skip_steps.add(step)
        if self.env.is_main:
            tmp = self._skip_file().with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self.skip_steps)))
            os.replace(tmp, self._skip_file())

    def _resume(self, path: Path) -> None:
        info = Checkpointer.load(path, self.model, self.optimizer, self.ema)
        self.step = int(info["step"])
        self.loader.load_state_dict(info["loader"])
        self.total_steps = int(info["total_steps"])
        saved = info.get("config", {}).get("train", {})
        if saved.get("steps", self.cfg.train.steps) != self.cfg.train.steps or \
                saved.get("minutes", self.cfg.train.minutes) != self.cfg.train.minutes:
            # the run was extended (or shortened): the new length holds, and a time budget is re-measured
            self.total_steps = self.cfg.train.steps
            info["budget_fixed"] = self.cfg.train.minutes == 0
        self.budget_fixed = bool(info.get("budget_fixed", True))
        self.train_seconds = float(info.get("train_seconds", 0.0))
        self.samples_seen = int(info.get("samples_seen", 0))
        self.restarts = int(info.get("restarts", 0))
        self.rollbacks = int(info.get("rollbacks", 0))
        self.skipped_steps = int(info.get("skipped_steps", 0))
        self.lr_scale = float(info.get("lr_scale", 1.0))
        self.skip_steps |= {int(x) for x in info.get("skip_steps", [])}
        log.info("resumed from %s at step %d", path, self.step)

    def save(self, blocking: bool | None = None):
        """Checkpoint the whole training state (async unless ``blocking``); returns the save's result."""
        extra = {"loader": self.loader.state_dict(), "total_steps": self.total_steps,
                 "budget_fixed": self.budget_fixed, "train_seconds": self.train_seconds,
                 "samples_seen": self.samples_seen, "restarts": self.restarts, "rollbacks": self.rollbacks,
                 "skipped_steps": self.skipped_steps, "lr_scale": self.lr_scale,
                 "skip_steps": sorted(self.skip_steps),
                 "ema_updates": self.ema.updates if self.ema else 0, "config": to_dict(self.cfg),
                 "world_size": self.env.world,
                 "text_encoder": getattr(self.text_encoder, "extra_state", lambda: {"kind": "hf"})(),
                 "num_params": {"dit": num_params(self.dit), "total": num_params(self.model)}}
        if self.watchdog is not None:
            self.watchdog.beat(self.step, "checkpoint")
        self.last_save = self.checkpointer.save(self.step, self.model, self.optimizer, self.ema, extra, blocking)
        self.stall_s += self.last_save.stall_s
        return self.last_save

    # --- one optimizer step -----------------------------------------------------------------------
    def _forward_loss(self, batch: Batch, normalizer: float) -> tuple[torch.Tensor, int, float]:
        """One micro-batch: (loss contribution, real tokens, training FLOPs) of this rank's part."""
        b = batch.to(self.device, non_blocking=True)
        b.x0_BLC = b.x0_BLC.float()      # the store serves bf16 latents as stored; widened on the device
        B = len(b)
        _, H, W = b.grid
        cp, r = self.env.cp, self.env.cp_rank
        t, eps = draw_t_and_noise(self.flow, self.cfg.run.seed, self.step, b.sample_ids, tuple(b.x0_BLC.shape[1:]),
                                  (H // 2) * (W // 2), self.device)
        xt = noisy_input(b.x0_BLC, eps, t, b.loss_mask_BL)
        # Guidance-distilled models (FLUX.1-dev) are fine-tuned with the embedded guidance at 1.
        g = torch.ones(B, device=self.device) if self.dit.params.guidance_embed else None
        if b.text is not None:      # embeddings of frozen encoders, read from the latent store
            emb = b.text
        else:
            with autocast(self.device, self.amp):
                emb = self.text_encoder(b.tokens)
        txt, txt_mask, img_mask = emb.txt_BTD, None, None
        x0, mask, ids = b.x0_BLC, b.loss_mask_BL, b.ids_BL3
        if cp > 1:   # this rank's 1/cp of every sequence tensor; padding is masked out of attention and loss
            ones_t = torch.ones(txt.shape[:2], dtype=torch.bool, device=self.device)
            ones_i = torch.ones(xt.shape[:2], dtype=torch.bool, device=self.device)
            txt, txt_mask = shard_sequence(txt, cp, r), shard_sequence(ones_t, cp, r, False)
            xt, x0, eps = (shard_sequence(x, cp, r) for x in (xt, x0, eps))
            ids, mask, img_mask = shard_sequence(ids, cp, r), shard_sequence(mask, cp, r, False), \
                shard_sequence(ones_i, cp, r, False)
        with autocast(self.device, self.amp):
            out = self.dit(xt, ids, txt, t, emb.pooled_BP, g, txt_mask_BT=txt_mask, img_mask_BL=img_mask)
        v = to_velocity(out.float(), xt, t, self.flow.prediction)
        loss = flow_loss(v, x0, eps, mask, loss_weight(t, self.flow.loss), normalizer=normalizer)
        L = b.x0_BLC.shape[1]
        txt_real = emb.mask_BT.sum(1).tolist()
        flops = step_flops(self.dit.params, [(L, int(n)) for n in txt_real])
        return loss, B * L + int(sum(txt_real)), float(flops)

    def train_step(self, batches: list[Batch]) -> StepStats:
        """One optimizer step on this rank's micro-batches. A non-finite loss or gradient norm (the same
        verdict on every rank: both are reduced over ranks) skips the update: no optimizer or EMA step."""
        tc = self.cfg.train
        lr = lr_at(self.step, tc.lr, self.total_steps, tc.warmup_steps, tc.schedule, tc.min_lr_ratio) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        t0 = time.perf_counter()
        # The loss is a sum over target tokens divided by the step's global count (over ranks and
        # micro-batches; context-parallel peers hold the same samples, hence / cp).
        local_targets = float(sum(int(b.loss_mask_BL.sum()) for b in batches))
        n_targets, n_samples = all_reduce_sum([local_targets, float(sum(len(b) for b in batches))], self.device)
        wait = time.perf_counter() - t0
        n_targets = max(1.0, n_targets / self.env.cp)
        total = torch.zeros((), device=self.device)
        tokens = flops = 0.0
        poison = faults.nan_at(self.step + 1)
        for i, batch in enumerate(batches):
            set_gradient_sync(self.fsdp_units, i == len(batches) - 1, self.cfg.parallel.grad_sync)
            loss, n_tok, n_flops = self._forward_loss(batch, n_targets)
            if poison:
                loss = loss * float("nan")
            loss.backward()
            total += loss.detach()
            tokens, flops = tokens + n_tok, flops + n_flops
        all_reduce_grads(self.replicated)
        # The optimizer's parameters are the sharded ones; a unit left gathered would name other tensors.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        gnorm = clip_grad_norm(params, tc.grad_clip or float("inf"))
        t1 = time.perf_counter()
        stop_flag = 1.0 if self.preemption.requested else 0.0
        loss_sum, tokens, flops, stop = all_reduce_sum([float(total), tokens, flops, stop_flag], self.device)
        t2 = time.perf_counter()
        wait += t2 - t1
        skipped = not math.isfinite(loss_sum) or not math.isfinite(gnorm)
        self.stall_s += self.checkpointer.wait_staged()     # a save's copy of the state is complete
        if not skipped:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        cp = self.env.cp
        return StepStats(loss_sum, gnorm, lr, int(tokens / cp), int(n_samples / cp), flops / cp, skipped, stop > 0,
                         fwd_bwd_s=t1 - t0 - (wait - (t2 - t1)), optim_s=time.perf_counter() - t2, wait_s=wait)

    # --- the loop ---------------------------------------------------------------------------------
    def pipeline(self) -> Pipeline:
        return Pipeline(self.model, self.text_encoder, self.autoencoder, self.flow, self.device, self.amp,
                        sample_shift=(self.cfg.sample.shift, self.cfg.sample.shift_value))

    def _fix_budget(self, steps_done: int, seconds: float) -> None:
        """With ``train.minutes``, set the step count (and with it the LR schedule) from the measured speed.
        Called every 60 steps with the time of the recent steps (``StepClock``) until half of the steps
        are done; later the schedule stays put. Each correction moves the cosine LR by a few %. Every rank
        uses the mean of the ranks' timings, so all agree on the step count."""
        budget = self.cfg.train.minutes * 60
        seconds, elapsed = (x / self.env.world for x in all_reduce_sum([seconds, self.train_seconds], self.device))
        per_step = seconds / max(1, steps_done)
        self.total_steps = min(self.cfg.train.steps, self.step + max(0, int((budget - elapsed) / per_step)))
        self.budget_fixed = self.step >= self.total_steps // 2
        log.info("time budget %.1f min: %.3f s/step -> %d steps", budget / 60, per_step, self.total_steps)

    def _log(self, stats: StepStats, batch: Batch, data_s: float, step_s: float) -> None:
        total_s = data_s + step_s
        graphs = compile_count()
        values = {"time": round(time.time(), 3), "loss": stats.loss, f"loss_{batch.task}": stats.loss,
                  "grad_norm": round(stats.grad_norm, 4), "lr": stats.lr,
                  "task": batch.task, "seq": [batch.x0_BLC.shape[1], batch.text.txt_BTD.shape[1] if batch.text is not None
                          else max((v.shape[1] for v in batch.tokens.values()), default=0)],
                  "data_s": round(data_s, 4), "step_s": round(step_s, 4), "fwd_bwd_s": round(stats.fwd_bwd_s, 4),
                  "optim_s": round(stats.optim_s, 4),
                  "samples_per_s": round(stats.samples / total_s, 2), "tokens_per_s": round(stats.tokens / total_s, 1),
                  "train_seconds": round(self.train_seconds, 2), "samples_seen": self.samples_seen,
                  "mem_gb": round(_mem_gb(self.device), 3), "skipped_steps": self.skipped_steps,
                  "restarts": self.restarts, "rollbacks": self.rollbacks}
        values.update(self.straggler_info)
        if self.stall_s:             # training time lost to checkpoints since the previous row
            values["checkpoint_stall_s"] = round(self.stall_s, 4)
            self.stall_s = 0.0
        errors = getattr(self.loader, "errors", None)
        if errors is not None:       # per-sample data faults skipped so far (damaged store rows)
            values["data_errors"] = errors
        if self.peak:
            values["mfu"] = round(mfu(stats.flops, total_s, self.env.world, self.peak), 5)
        if graphs != self.compiled_graphs:
            values["recompiles"] = graphs - self.compiled_graphs
            log.info("step %d: %d new compiled graph(s), %d in all", self.step, graphs - self.compiled_graphs, graphs)
            self.compiled_graphs = graphs
        self.metrics.log(self.step, values)

    def _on_bad_step(self, stats: StepStats, step: int) -> bool:
        """A skipped (non-finite) step: count it, remember its batch; after ``health.rollback_after`` in a row,
        roll back. Returns True if the state was rolled back (the loop then continues from there)."""
        hc = self.cfg.health
        self.skipped_steps += 1
        self.consecutive_bad += 1
        self._record_skip(step)
        log.warning("step %d skipped: loss %s, grad norm %s (%d in a row, %d in all)", step, stats.loss,
                    stats.grad_norm, self.consecutive_bad, self.skipped_steps)
        self.metrics.event("skip", step, loss=str(stats.loss), grad_norm=str(stats.grad_norm),
                           consecutive=self.consecutive_bad)
        if hc.rollback_after == 0:
            raise FloatingPointError(f"step {step}: loss {stats.loss} / grad norm {stats.grad_norm} is not finite "
                                     "(health.rollback_after = 0; lower train.lr or raise train.warmup_steps)")
        if self.consecutive_bad < hc.rollback_after:
            return False
        if self.rollbacks >= hc.max_rollbacks:
            raise FloatingPointError(f"step {step}: {self.consecutive_bad} non-finite steps in a row after "
                                     f"{self.rollbacks} rollbacks (health.max_rollbacks): lower train.lr")
        self.checkpointer.wait()
        target = self._find_checkpoint()
        if target is None:
            raise FloatingPointError(f"step {step}: {self.consecutive_bad} non-finite steps in a row and no "
                                     "checkpoint to roll back to: lower train.lr or raise train.warmup_steps")
        skips, rollbacks, skipped = set(self.skip_steps), self.rollbacks + 1, self.skipped_steps
        self._resume(target)
        self.skip_steps |= skips
        self.rollbacks, self.skipped_steps = rollbacks, skipped
        self.lr_scale *= hc.rollback_lr_factor
        self.consecutive_bad = 0
        log.warning("rolled back to %s (step %d); batches of steps %s will be skipped; LR x %.3g",
                    target.name, self.step, sorted(x for x in self.skip_steps if x >= self.step), self.lr_scale)
        self.metrics.event("rollback", self.step, path=str(target), skip_steps=sorted(self.skip_steps),
                           lr_scale=self.lr_scale)
        return True

    def _spike(self, stats: StepStats, batches: list[Batch], step: int) -> None:
        """Every rank runs the same detector on the same (reduced) loss, so all agree; the batch's sample ids
        are gathered from every rank."""
        if self.spikes is None or stats.skipped:
            return
        hc = self.cfg.health
        z = self.spikes.setdefault(batches[0].task, SpikeDetector(hc.spike_window, hc.spike_z)).update(stats.loss)
        if z is None:
            return
        ids = torch.cat([torch.as_tensor(b.sample_ids, dtype=torch.int64).flatten() for b in batches]).to(self.device)
        if torch.distributed.is_initialized():
            n = torch.tensor([ids.numel()], device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
            padded = torch.full((int(n),), -1, dtype=torch.int64, device=self.device)
            padded[: ids.numel()] = ids
            out = [torch.empty_like(padded) for _ in range(self.env.world)]
            torch.distributed.all_gather(out, padded)
            ids = torch.cat(out)
        sample_ids = sorted({int(x) for x in ids.tolist() if x >= 0})
        log.warning("step %d: loss spike %.4g (robust z %.1f), task %s, %d samples (ids in events.jsonl)", step,
                    stats.loss, z, batches[0].task, len(sample_ids))
        self.metrics.event("spike", step, loss=stats.loss, z=round(z, 2), task=batches[0].task, sample_ids=sample_ids)

    def _check_stragglers(self, busy: float) -> None:
        """Every rank's busy time over the window (step time less the time spent waiting in the step's
        collectives: the slowest rank waits least), gathered; ranks above factor x the median are reported."""
        hc = self.cfg.health
        t = torch.zeros(self.env.world, dtype=torch.float64, device=self.device)
        t[self.env.rank] = busy
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        times = t.tolist()
        slow = stragglers(times, hc.straggler_factor)
        if slow:
            log.warning("step %d: straggler rank(s) %s: busy %s s vs median %.3f s over the last %d steps", self.step,
                        slow, [round(times[r], 3) for r in slow], sorted(times)[len(times) // 2], hc.straggler_every)
            self.metrics.event("straggler", self.step, ranks=slow, busy_s=[round(x, 4) for x in times])
        self.straggler_info = {"stragglers": len(slow),
                               "busy_max_over_median": round(max(times) / max(1e-9, sorted(times)[len(times) // 2]), 3)}

    def fit(self, on_step=None) -> dict:
        tc, par, hc = self.cfg.train, self.cfg.parallel, self.cfg.health
        params = num_params(self.model)
        tokens_seen = 0
        t_start = time.perf_counter()
        clock = StepClock()
        busy = 0.0
        preempted = None
        self.preemption.install()
        self.watchdog = Watchdog(self.run_dir, self.env.rank, hc.hang_seconds, hc.hang_startup_seconds,
                                 on_fire=lambda idle: self.metrics.event("hang", self.step, rank=self.env.rank,
                                                                         idle_s=round(idle, 1), force=True)).start()
        self.metrics.event("start", self.step, world=self.env.world, restarts=self.restarts, run_id=self.run_id)
        while self.step < self.total_steps:
            self.watchdog.beat(self.step)
            self.log_handler.step = self.step
            t0 = time.perf_counter()                   # (an injected 'slow' fault counts as this rank's time)
            faults.at_step(self.step + 1, wait=self.checkpointer.wait)
            batches = next(self.loader)
            t1 = time.perf_counter()
            if os.environ.get("DIFFTRAIN_SAMPLE_LOG"):
                faults.record_samples(self.step + 1, [int(i) for b in batches for i in torch.as_tensor(b.sample_ids).flatten()])
            if self.step + 1 in self.skip_steps:      # a batch that broke training before: not trained on again
                log.info("step %d: batch skipped on replay (it gave a non-finite step before)", self.step + 1)
                self.step += 1
                continue
            step_number = self.step + 1                # as metrics and events count steps: 1, 2, ...
            stats = self.train_step(batches)
            t2 = time.perf_counter()
            if stats.skipped:
                self.step += 1
                if self._on_bad_step(stats, step_number):
                    continue
            else:
                self.consecutive_bad = 0
                self.step += 1
                self.samples_seen += stats.samples
            if self.step >= par.startup_steps and not self.timeout_tightened:
                set_collective_timeout(self.env, par.timeout_minutes)
                self.timeout_tightened = True
            self.train_seconds += t2 - t0
            tokens_seen += stats.tokens
            busy += (t2 - t0) - stats.wait_s
            self._spike(stats, batches, step_number)
            if not self.budget_fixed:
                measured = clock.observe(self.step, self.train_seconds)
                if measured is not None:
                    self._fix_budget(*measured)
            if hc.straggler_every and self.step % hc.straggler_every == 0:
                self._check_stragglers(busy)
                busy = 0.0
            if on_step is not None:
                on_step(self.step, self.total_steps, stats)
            if tc.sample_every and self.step % tc.sample_every == 0:
                self.watchdog.beat(self.step, "sampling")
                self.sample_grid(self.run_dir / "samples" / f"step_{self.step:08d}.png")
            if stats.stop:                            # every rank saw the same flag in the same collective
                preempted = self.preemption.requested or "a signal on another rank"
                break
            if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < self.total_steps:
                self.save()
            saved_now = self.last_save is not None and self.last_save.step == self.step
            if self.step % tc.log_every == 0 or self.step == self.total_steps or saved_now:
                self._log(stats, batches[0], t1 - t0, t2 - t1)
        self.log_handler.step = self.step
        if preempted is not None:
            self.save(blocking=True)
            self._log(stats, batches[0], t1 - t0, t2 - t1)
            if self.env.is_main:
                write_requeue_marker(self.run_dir, self.step, preempted)
            self.metrics.event("preempt", self.step, signal=preempted)
            log.warning("preempted (%s): checkpoint at step %d written; %s left for the launcher to requeue",
                        preempted, self.step, REQUEUE_MARKER)
        elif self.step > 0:
            self.save(blocking=True)
            self.watchdog.beat(self.step, "export")
            self.export()
            log.info("finished: %d steps, %d skipped, %d rollbacks, %.1f s of training", self.step,
                     self.skipped_steps, self.rollbacks, self.train_seconds)
        self.checkpointer.wait()
        self.watchdog.stop()
        return {"steps": self.step, "train_seconds": round(self.train_seconds, 2), "num_params": params,
                "wall_seconds": round(time.perf_counter() - t_start, 2), "tokens": tokens_seen,
                "world_size": self.env.world, "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks,
                "restarts": self.restarts, "preempted": preempted is not None}

    def close(self) -> None:
        """Finish a checkpoint in flight; stop the data source's readers, the watchdog and the signal handlers;
        flush and close the metrics files (TensorBoard's writer included) and the per-rank log."""
        try:
            self.checkpointer.close()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.preemption.uninstall()
            if hasattr(self.loader, "close"):
                self.loader.close()
            self.metrics.close()
            logging.getLogger("difftrain").removeHandler(self.log_handler)
            self.log_handler.close()

    # --- outputs ----------------------------------------------------------------------------------
    def export(self) -> Path:
        """Inference weights (EMA if kept) as safetensors, with the config beside them. Sharded tensors are
        gathered one at a time (every rank takes part); rank 0 writes."""
        from safetensors.torch import save_file

        self.checkpointer.wait_staged()
        out = self.run_dir / "export"
        source = self.ema.state_dict() if self.ema is not None else dict(self.model.named_parameters())
        sd = {}
        for k, v in source.items():
            full = _full(v.detach())
            if self.env.is_main:
                sd[k] = full.float().cpu().contiguous()
        if self.env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_file(sd, str(out / "model.safetensors"), metadata={"format": "difftrain-weights/1"})
            (out / "config.toml").write_text(to_toml(self.cfg))
        return out / "model.safetensors"

    def sample_grid(self, path: Path, n: int = 4) -> Path:
        """A grid of samples per task. Runs on every rank (FSDP all-gathers need all of them), each on the
        full sequences (context parallelism off); rank 0 writes the PNG."""
        from difftrain.evaluate import generate_task
        from difftrain.images import caption_grid

        s, world = self.cfg.sample, world_from_config(self.cfg.data, self.cfg.eval.seed)
        self.checkpointer.wait_staged()          # the EMA swap below writes the parameters
        pipe = self.pipeline()
        rows = []
        with self.ema.applied(self.model) if self.ema else contextlib.nullcontext(), cp_disabled(self.model):
            self.model.eval()
            for task in ("t2i", "edit", "keyframes"):
                for g in generate_task(pipe, world, task, list(range(n)), s.steps, s.cfg_scale, s.seed,
                                       self.cfg.eval.keyframe_given):
                    rows.append((g.images, g.prompt))
        return caption_grid(rows, path) if self.env.is_main else path
