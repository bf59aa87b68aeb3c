"""The training loop, the same on one CPU process, on gloo processes and on GPUs under torchrun.

The trainer is given its data source (``ConfiguredSource``: what ``data.source`` names) and its objective
(``objectives.py``); it builds the model, optimizer and EMA, and keeps the loop, the reductions, health and
checkpoints. A step takes this rank's micro-batches of the global batch, asks the objective for each one's
loss contribution (divided by the step's *global* count: over ranks and micro-batches), sums gradients over
ranks (FSDP's own division is off) once per step, clips by the global norm; then AdamW and the EMA. So N
ranks compute what 1 rank computes, up to reduction order. Everything the loop depends on is in the
checkpoint (model, EMA, optimizer, schedule, loader position, step), so rerunning on the same run directory
continues the same sample stream, on any world size that divides the global batch. What a run reports and
produces beside its steps (metrics rows, previews, the pipeline, the export) is ``outputs.TrainerOutputs``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config, to_dict, to_toml
from difftrain.config.changes import config_changes
from difftrain.data.batch import Batch
from difftrain.diffusion.flow import FlowSpec
from difftrain.diffusion.pipeline import amp_dtype
from difftrain.errors import UserError
from difftrain.models import build_autoencoder, build_text_encoder, num_params
from difftrain.parallel.compile import compile_count
from difftrain.parallel.dist import ParallelEnv, all_gather_rows, all_reduce_sum, all_reduce_sum_on_device, \
    batch_split, init_distributed, set_collective_timeout
from difftrain.parallel.flops import peak_flops
from difftrain.parallel.fsdp import all_reduce_grads, clip_grad_norm, set_gradient_sync
from difftrain.train import faults, phases
from difftrain.train.budget import TimeBudget
from difftrain.train.adapters import check_same_base, keep_in_checkpoint
from difftrain.train.build import build_model
from difftrain.train.checkpoint import Checkpointer, SaveFailed
from difftrain.train.contract import Denoiser, Objective, RunView
from difftrain.train.ema import EMA
from difftrain.train.health import JsonLogHandler, PreemptLead, Preemption, StepHealth, Watchdog, run_id, \
    write_requeue_marker, REQUEUE_MARKER
from difftrain.train.metrics import MetricsLogger
from difftrain.train.outputs import TrainerOutputs
from difftrain.train.records import Fetched, StepStats
from difftrain.train.schedule import lr_at

log = logging.getLogger("difftrain.train")


def dropout_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The seed of a rank's dropout draws in one micro-batch of one step: a hash of the four (never the same stream on
    two ranks, and the same after a resume)."""
    digest = hashlib.sha256(f"dropout/{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _reads_counted_once(state: dict, config: dict) -> dict:
    """A store loader's state saved before the read-error budget counted context-parallel peers' shared rows once: its
    counters were cp times the rows read; brought to rows, so a resume at any cp continues the same budget."""
    cp = int((config.get("parallel") or {}).get("cp", 1) or 1)
    if state.get("kind") != "store" or state.get("reads_counted") == "once" or cp <= 1:
        return state
    return {**state, "read_errors": int(state.get("read_errors", 0)) // cp,
            "samples_read": int(state.get("samples_read", 0)) // cp}


class Trainer(TrainerOutputs):
    """``source``: a ``ConfiguredSource`` (the vocabulary and the per-rank source). ``resume``: continue from
    the newest complete checkpoint of the run directory (False: refuse a run directory that has one).
    ``allow_config_change``: config keys that may differ from the checkpoint's."""

    def __init__(self, cfg: Config, source, objective: Objective, run_dir: str | Path | None = None,
                 env: ParallelEnv | None = None, resume: bool = True, allow_config_change: tuple[str, ...] = ()):
        if objective.batch_kind not in source.batch_kinds:
            raise UserError(f"data.source = {cfg.data.source!r} serves batches of "
                            f"{' or '.join(source.batch_kinds)}; the objective {objective.name!r} needs "
                            f"{objective.batch_kind!r}")
        self.cfg, self.objective = cfg, objective
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        self.env = env or init_distributed(cfg)
        self.device = self.env.device
        self._start_logs()
        hc = cfg.health
        # Watched from here: building, loading or resuming, compiling and the first step run under the start-up
        # allowance (hang_startup_seconds); steps after the first under hang_seconds.
        self.watchdog = Watchdog(self.run_dir, self.env.rank, hc.hang_seconds, hc.hang_startup_seconds,
                                 on_fire=lambda idle: self.metrics.event("hang", getattr(self, "step", 0),
                                                                         rank=self.env.rank, idle_s=round(idle, 1),
                                                                         force=True)).start()
        try:
            self._build(source, resume, allow_config_change)
        except BaseException:
            self.watchdog.stop()
            raise

    def _build(self, source, resume: bool, allow_config_change: tuple[str, ...]) -> None:
        cfg, tc = self.cfg, self.cfg.train
        self.amp = amp_dtype(tc.precision, self.device)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if source.per_bucket_batches:    # global and micro-batches per bucket: the store loader checks them
            self.micro_batch, self.accum = 0, 1
        else:
            self.micro_batch, self.accum = batch_split(tc.global_batch, tc.micro_batch, self.env.dp_size)
        self.lead = PreemptLead(self.run_dir, cfg.health.preempt_lead_s, self.metrics.event)
        self.checkpointer = Checkpointer(self.run_dir, tc.keep_checkpoints, tc.keep_every, tc.async_checkpoint,
                                         on_event=self._checkpoint_event, timeout_minutes=tc.checkpoint_timeout)
        found = self._find_checkpoint()
        info = self._check_resumable(found, resume, allow_config_change)
        torch.manual_seed(cfg.run.seed)

        ae = cfg.autoencoder
        self.autoencoder = build_autoencoder(ae.kind, ae.factor, ae.path, ae.scaling, ae.shift).to(self.device)
        vocab = info.get("text_encoder", {}).get("vocabulary") if info else None
        split = int(info.get("text_encoder", {}).get("base_words", 0)) if info else 0
        self.base_words = None       # a words encoder carried from model.init_from: the base's words
        if vocab is None and cfg.text.kind == "words":
            vocab = source.vocabulary()
            split = int(getattr(source, "base_words", 0))      # a DPO run's start: its checkpoint's split
            if cfg.model.init_from and not self.objective.starts_from_checkpoint:
                from difftrain.parallel.words_init import base_vocabulary, extended
                self.base_words = base_vocabulary(cfg.model.init_from)
                if self.base_words is not None:          # its words keep their ids; the data's new ones follow
                    vocab = extended(self.base_words, vocab)
                    split = len(self.base_words)
        # Frozen encoders are built where something first encodes with them: never while a store that holds
        # their states feeds training (previews, eval and candidates build them when they run).
        self.text_encoder = build_text_encoder(cfg, vocab, self.device, lazy=True, on_build=self._encoders_built,
                                               base_words=split)
        self.adapter = self.objective.adapter_spec(cfg)
        self.model = self._build_model(found is None)
        self.dit = self.model["dit"]
        self.adapter_base = (self.objective.adapter_base(cfg, self.run_dir, self.env.is_main)
                             if self.adapter is not None else None)
        self.checkpoint_keys = keep_in_checkpoint(self.model)      # a frozen base: the adapters alone
        self.dropout_seeded = self.adapter is not None and self.adapter.dropout > 0
        from difftrain.parallel.tune import install as install_attention
        self.attention = install_attention(cfg, self.model, self.device, self.amp, True, self.micro_batch,
                                           self.env.cp, self.run_dir,
                                           2 if self.objective.batch_kind == "pairs" else 1, self.env.dp_size)
        self.attention_kernel = self.attention.pop("kernel", None)     # the tuned hybrid ('auto')
        self.attention_calls = {"tuned": 0, "fallback": 0}             # forward calls since the run started
        self.attention_logged = dict(self.attention_calls)
        self.attention_missing: set[str] = set()
        if self.attention["backend"] != "sdpa":
            log.info("attention: %s", self.attention)
        self.denoiser = Denoiser(self.model, self.text_encoder, self.device, self.amp, self.env.cp, self.env.cp_rank,
                                 cfg.text.padding)
        self.flow = FlowSpec.from_config(cfg.diffusion)     # sampling (previews, eval) follows the training flow
        self.optimizer = self._build_optimizer()
        self.ema = EMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None
        self.source, self.preview_prompts = source, None
        self.preview_text = None                             # previews' prompt states (a store-fed run's: the store's)
        self.val_batches, self.val_values = None, None       # the validation set (shapes), the step's figures
        self.val_forwards = 0                                # this rank's micro-batches at the last validation
        self.previewed = -1                                  # the step of the last preview grid
        self.base_preview = None                             # the base model's preview rows (a fine-tune's)
        self.loader = source.build(self.autoencoder, self.text_encoder, self.env.dp_rank, self.env.dp_size,
                                   self.device, self.micro_batch)
        self.view = RunView(cfg, self.env, self.device, self.amp, self.run_dir, self.model, self.text_encoder,
                            self.autoencoder, self.denoiser, self.loader, self.metrics, self.adapter, self.quantized)
        self.objective.attach(self.view)          # what the objective builds beside the policy (DPO: its reference)
        if hasattr(self.loader, "fault_hook"):       # DIFFTRAIN_FAULTS=unreadable@STEP: a row read as damaged
            self.loader.fault_hook = faults.unreadable_at
        # A loader that builds steps on the host (the shapes world) builds the next one during the backward pass
        # where the host is otherwise waiting for an accelerator; on a CPU the backward's threads already use every
        # core, and building beside them made a demo step 5% slower (bench/demo_step.py), so it is not done there.
        self.prefetch = getattr(self.loader, "prefetch", None) if self.device.type != "cpu" else None
        self.step = self.samples_seen = self.restarts = 0
        self.train_seconds = self.stall_s = 0.0
        self.budget = TimeBudget(tc.steps, tc.minutes, self._mean_over_ranks)
        self.health = StepHealth(cfg.health, self.run_dir, self.env.is_main, self.env.world, self.device,
                                 self.metrics.event)
        self.preemption = Preemption()
        self.last_save = None
        self.peak = self._peak()
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

    @property
    def total_steps(self) -> int:
        return self.budget.total_steps

    # --- construction -----------------------------------------------------------------------------
    def _start_logs(self) -> None:
        faults.configure(self.run_dir, self.env.rank)
        phases.configure(self.env.rank)
        self.run_id = run_id()
        self.log_handler = JsonLogHandler(self.run_dir / "logs" / f"rank_{self.env.rank}.jsonl", self.run_id,
                                          self.env.rank)
        root_logger = logging.getLogger("difftrain")
        root_logger.addHandler(self.log_handler)
        if root_logger.getEffectiveLevel() > logging.INFO:   # the JSON log keeps INFO whatever the console shows
            root_logger.setLevel(logging.INFO)
        port = self.cfg.train.metrics_port
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))       # the same ports on every node
        self.metrics = MetricsLogger(self.run_dir, port=(port + local_rank) if port else 0)

    def _check_resumable(self, found: Path | None, resume: bool, allowed: tuple[str, ...]) -> dict | None:
        """The checkpoint's info, after refusing a resume that was not asked for or a silent config change."""
        if found is None:
            return None
        if not resume:
            raise UserError(f"{self.run_dir}: holds a checkpoint ({found.name}) and resuming was refused "
                            "(--no-resume): use another run directory or drop --no-resume")
        info = Checkpointer.read_info(found)
        changed = config_changes(info.get("config", {}), to_dict(self.cfg), tuple(allowed))
        if changed:
            raise UserError(f"{self.run_dir}: this run directory was trained with another config "
                            f"(checkpoint -> now): {'; '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. "
                            "Pass --allow-config-change " + " ".join(c.split(":")[0] for c in changed[:8]) +
                            " to continue with the change, or use another run directory")
        return info

    def _build_model(self, fresh: bool) -> nn.ModuleDict:
        """The policy from the factory (``build.build_model``): built on the meta device, adapters injected, wrapped
        (CP, AC, compile, FSDP), then materialised and initialised shard by shard, so no rank ever holds the
        unsharded model; its weights seeded (per-parameter generators: the same on any world size or mesh) or read
        from where the objective says (``model.init_from``; DPO's starting checkpoint)."""
        start = self.objective.start_weights(self.cfg)
        # with adapters the frozen base is read on every start (a checkpoint holds the adapters alone); a resume
        # reads every other tensor from the checkpoint
        weights = dataclasses.replace(start, read=fresh)
        built = build_model(self.cfg, "policy", device=self.device, text_encoder=self.text_encoder,
                            autoencoder=self.autoencoder, weights=weights, env=self.env, amp=self.amp,
                            adapter=self.adapter, run_dir=self.run_dir, base_words=self.base_words)
        self.adapter_layers, self.quantized, self.fp8_layers = built.adapter_layers, built.quantized, built.fp8_layers
        self.fsdp_units, self.replicated = built.units, built.replicated
        return built.model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW (or Muon for the blocks' matrices, ``train.optimizer``), with groups by weight decay, and sharded
        (DTensor) apart from replicated parameters: a foreach step over a mix of the two is not supported by every
        torch release."""
        from difftrain.train.muon import MuonAdamW, is_hidden_matrix

        tc = self.cfg.train
        muon = tc.optimizer == "muon"
        groups: dict[tuple[bool, bool, bool], list] = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:      # frozen (a LoRA run's base weights): no optimizer state
                continue
            decays = p.ndim >= 2 and "embed" not in name
            key = (decays, any(p is q for q in self.replicated), muon and is_hidden_matrix(name, p))
            groups.setdefault(key, []).append(p)
        params = [p for ps in groups.values() for p in ps]
        # fused AdamW (one vectorised kernel a tensor) where every parameter is a plain tensor: on a CPU the foreach
        # step runs tensor by tensor and costs 3.5x the fused one (4.4M parameters: a tenth of a demo step);
        # sharded (DTensor) parameters keep the foreach step, which every torch release supports for them
        plain = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                    for p in params)
        self.optimizer_kind = {"fused": True, "foreach": False} if plain else {"fused": None, "foreach": True}
        decay = {key: tc.weight_decay if key[0] else 0.0 for key in groups}
        if muon:                         # MuonAdamW chooses its AdamW step itself
            self.optimizer_kind = {}
            return MuonAdamW([{"params": ps, "weight_decay": decay[k], "muon": k[2]} for k, ps in groups.items()],
                             lr=tc.lr, betas=(tc.beta1, tc.beta2), momentum=tc.muon_momentum,
                             ns_steps=tc.muon_ns_steps)
        return torch.optim.AdamW([{"params": ps, "weight_decay": decay[k]} for k, ps in groups.items()],
                                 lr=tc.lr, betas=(tc.beta1, tc.beta2), **self.optimizer_kind)

    def _peak(self) -> float | None:
        try:
            override = self.cfg.train.peak_tflops * 1e12 or None
            return peak_flops(self.device, self.amp or torch.float32, override)[0]
        except ValueError as e:          # an accelerator missing from the peak table: no MFU, say why once
            log.warning("MFU not reported: %s (in a config: train.peak_tflops)", e)
            return None

    def _mean_over_ranks(self, values: list[float]) -> list[float]:
        return [x / self.env.world for x in all_reduce_sum(values, self.device)]

    # --- state ------------------------------------------------------------------------------------
    def _find_checkpoint(self) -> Path | None:
        """The newest complete, verified checkpoint, the same on every rank: rank 0's list of candidates, each
        rank checksumming its share of a candidate's files, the verdicts gathered (``Checkpointer.latest``)."""
        newest = self.checkpointer.latest()
        done = self.checkpointer.last_verify
        if newest is not None and done and self.env.is_main:
            biggest = max(done["bytes_by_rank"])
            self.metrics.event("verify", int(newest.name.split("_")[1]), seconds=done["seconds"],
                               total_bytes=done["total_bytes"], bytes_by_rank=done["bytes_by_rank"],
                               max_rank_over_total=round(biggest / max(1, done["total_bytes"]), 4))
        return newest

    def _resume(self, path: Path) -> None:
        self.objective.check_resume(Checkpointer.read_info(path), path)
        if self.adapter is not None:
            saved = Checkpointer.read_info(path).get("adapter_base")
            if not (saved is None and self.objective.starts_from_checkpoint):   # an older DPO checkpoint: its
                check_same_base(saved, self.adapter_base, path)                 # reference digest is the base's
        info = Checkpointer.load(path, self.model, self.optimizer, self.ema, keep=self.checkpoint_keys)
        for group in self.optimizer.param_groups:   # the saved groups carry the saver's step kind: this mesh's own
            group.update(self.optimizer_kind)
        self.step = int(info["step"])
        self.metrics.resumed_at(self.step)          # TensorBoard: the steps replayed from here show once
        self.loader.load_state_dict(_reads_counted_once(info["loader"], info.get("config", {})))
        saved_total = int(info["total_steps"])
        self.budget.load_state_dict(info, info.get("config", {}).get("train", {}))
        if self.total_steps != saved_total and self.step > 0:
            self._replan_lr(saved_total)
        self.health.load_state_dict(info)
        self.train_seconds = float(info.get("train_seconds", 0.0))
        self.samples_seen = int(info.get("samples_seen", 0))
        self.restarts = int(info.get("restarts", 0))
        self.objective.load_state(info)
        log.info("resumed from %s at step %d", path, self.step)

    def _checkpoint_event(self, kind: str, step: int, **info) -> None:
        """The checkpointer's events (rank 0), into events.jsonl; a written checkpoint also updates what a
        preemption needs (RUN/preemption.json)."""
        self.metrics.event(kind, step, **info)
        if kind == "checkpoint":
            self.lead.saved(step, info.get("write_s", 0.0))

    def save(self, blocking: bool | None = None):
        """Checkpoint the whole training state (async unless ``blocking``); returns the save's result."""
        extra = {"loader": self.loader.state_dict(), **self.budget.state_dict(), **self.health.state_dict(),
                 "train_seconds": self.train_seconds, "samples_seen": self.samples_seen, "restarts": self.restarts,
                 "ema_updates": self.ema.updates if self.ema else 0, "config": to_dict(self.cfg),
                 "world_size": self.env.world, "compute_dtype": "bf16" if self.amp == torch.bfloat16 else "fp32",
                 "text_encoder": getattr(self.text_encoder, "extra_state", lambda: {"kind": "hf"})(),
                 "num_params": {"dit": num_params(self.dit), "total": num_params(self.model)},
                 **({"adapter": self.adapter.describe(), "adapter_layers": self.adapter_layers,
                     "adapter_base": self.adapter_base} if self.adapter is not None else {}),
                 **self.objective.extra_state()}
        if self.watchdog is not None:
            self.watchdog.beat(self.step, "checkpoint")
        self.last_save = self.checkpointer.save(self.step, self.model, self.optimizer, self.ema, extra, blocking,
                                                 keep=self.checkpoint_keys)
        self.stall_s += self.last_save.stall_s
        return self.last_save

    # --- one optimizer step -----------------------------------------------------------------------
    def train_step(self, batches: list[Batch]) -> StepStats:
        """One optimizer step on this rank's micro-batches. A non-finite loss or gradient norm (the same
        verdict on every rank: both are reduced over ranks) skips the update: no optimizer or EMA step."""
        tc = self.cfg.train
        lr = lr_at(self.step, tc.lr, self.total_steps, tc.warmup_steps, tc.schedule, tc.min_lr_ratio,
                   self.budget.lr_anchor)
        lr *= self.health.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        t0 = time.perf_counter()
        # The objective's count (loss tokens for flow matching) over ranks and micro-batches, counted on the host
        # batches and summed on the device: the normalizer stays a device tensor (no host sync); context-parallel
        # peers hold the same samples, hence / cp.
        local = torch.tensor([sum(self.objective.count(b) for b in batches), float(sum(len(b) for b in batches))],
                             dtype=torch.float64).to(self.device, non_blocking=True)
        counts = all_reduce_sum_on_device(local)
        wait = time.perf_counter() - t0          # gloo's all-reduce blocks; NCCL's is queued on the stream
        normalizer = (counts[0] / self.env.cp).clamp(min=1.0).float()
        total = torch.zeros((), device=self.device)
        tokens = flops = 0.0
        rows = []                 # an objective's per-example statistics (DPO's per-pair figures)
        poison = faults.nan_at(self.step + 1)
        for i, batch in enumerate(batches):
            set_gradient_sync(self.fsdp_units, i == len(batches) - 1, self.cfg.parallel.grad_sync)
            if self.dropout_seeded:
                # peft's adapter dropout draws from the global generator: this rank's own stream for this step and
                # micro-batch, so ranks differ and a resume draws the same masks (a function of the saved step)
                torch.manual_seed(dropout_seed(self.cfg.run.seed, self.step, self.env.rank, i))
            with phases.phase("forward"):
                micro = self.objective.loss(self.denoiser, batch, self.cfg.run.seed, self.step, normalizer)
            loss = micro.loss * float("nan") if poison else micro.loss
            if i == len(batches) - 1 and self.prefetch is not None:
                self.prefetch()          # the next step's data is built while autograd runs without the GIL
            with phases.phase("backward"):
                loss.backward()
            total += loss.detach()
            tokens, flops = tokens + micro.tokens, flops + micro.flops
            if micro.stats is not None:
                rows.append(micro.stats)
        with phases.phase("backward"):
            all_reduce_grads(self.replicated)
            # The optimizer's parameters are the sharded ones; a unit left gathered would name other tensors.
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            gnorm_t = clip_grad_norm(params, tc.grad_clip or float("inf"))
        # The step's two host syncs. This one: the loss, the (global) gradient norm and the sample count come to
        # the host together once this rank's forward and backward are done (it times this rank's own work for
        # the straggler report, and the skip decision below needs the values before the optimizer step).
        loss_local, gnorm, n_samples = torch.stack([total.double(), gnorm_t.to(total.device).double(),
                                                    counts[1]]).tolist()
        t1 = time.perf_counter()
        stop_flag = 1.0 if self.preemption.requested else 0.0
        self.checkpointer.poll()                # a background save that has ended: its outcome counted
        saves_failing = 1.0 if self.checkpointer.failed_in_row >= tc.max_failed_saves else 0.0
        asked, unreadable = sum(b.rows_asked for b in batches), sum(b.rows_unreadable for b in batches)
        if self.env.cp_rank:         # context-parallel peers read the same rows: the budget counts them once
            asked = unreadable = 0
        # The other: one all-reduce of the loss, tokens, FLOPs, the stop flag (every rank stops after the same
        # step; the logged loss is global) and the store's reads (the read-error budget, decided on every rank).
        loss_sum, tokens, flops, stop, asked, unreadable, saves_failing = all_reduce_sum(
            [loss_local, tokens, flops, stop_flag, float(asked), float(unreadable), saves_failing], self.device)
        t2 = time.perf_counter()
        wait += t2 - t1
        if saves_failing:                       # the same verdict on every rank, before this step's update
            self._stop_for_failed_saves()
        account = getattr(self.loader, "account_reads", None)
        if account is not None and asked:
            account(round(unreadable), round(asked))
        skipped = not math.isfinite(loss_sum) or not math.isfinite(gnorm)
        self.stall_s += self.checkpointer.wait_staged()     # a save's copy of the state is complete
        if not skipped:
            with phases.phase("optimizer"):
                self.optimizer.step()
                if self.ema is not None:
                    self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        cp = self.env.cp
        # Every rank's rows, left on the device: they come to the host only on the steps that log them.
        gathered = all_gather_rows(torch.cat(rows)) if rows else None
        return StepStats(loss_sum, gnorm, lr, int(tokens / cp), int(n_samples / cp), flops / cp, skipped, stop > 0,
                         fwd_bwd_s=t1 - t0 - (wait - (t2 - t1)), optim_s=time.perf_counter() - t2, wait_s=wait,
                         rows=gathered)

    def _stop_for_failed_saves(self) -> None:
        """Some rank has seen ``train.max_failed_saves`` checkpoints in a row fail: every rank stops here (in the
        step's collective, so at the same step), naming the newest checkpoint a restart would resume from."""
        n, why = self.checkpointer.failed_in_row, self.checkpointer.last_error
        newest = self.checkpointer.complete_steps()
        self.metrics.event("checkpoints_failing", self.step, failed_in_row=n, reason=why or "on another rank")
        raise UserError(f"{self.run_dir}: the last {self.cfg.train.max_failed_saves} checkpoints failed in a row "
                        f"({'this rank: ' + why if why else 'on another rank'}); the run stops at step {self.step} "
                        "rather than train on with nothing to resume from (train.max_failed_saves). Newest complete "
                        f"checkpoint: {newest[-1].name if newest else 'none'}. Fix the storage, then rerun: it resumes "
                        "from there")

    # --- the loop: its phases -----------------------------------------------------------------------
    def fit(self, on_step=None) -> dict:
        """Train to the step count; returns a summary. Stops early (with a checkpoint and a requeue marker)
        when any rank is asked to stop."""
        t_start, stats, last, preempted = time.perf_counter(), None, None, None
        self._begin()
        try:
            while self.step < self.total_steps:
                fetched = self._fetch()
                if fetched is None:
                    continue
                stats = self.train_step(fetched.batches)
                fetched.step_s = time.perf_counter() - fetched.t0 - fetched.data_s
                if self._check_health(stats, fetched):
                    continue                              # rolled back: the loop goes on from the checkpoint
                self._account(stats, fetched)
                last = fetched
                if on_step is not None:
                    on_step(self.step, self.total_steps, stats)
                self._validate()
                preempted = self._stop_requested(stats)
                if preempted is not None:
                    break
                self._checkpoint()
                if self.step < self.total_steps:
                    self._sample()                        # after the step's checkpoint (the last step's: after the save)
                self._log_step(stats, fetched)
                if self.objective.stop_early(self.view, self.step):
                    break
            return self._finish(preempted, stats, last, t_start)
        except BaseException:
            # The exception ends this fit: a process that goes on (a notebook, a supervisor that catches it, a test)
            # must not be killed by the hang watchdog minutes later, nor keep the run's signal handlers.
            self.watchdog.stop()
            self.preemption.uninstall()
            raise

    def _begin(self) -> None:
        self.tokens_seen = 0
        self.preemption.install()
        self.watchdog.start().beat(self.step, "start-up")     # (again, after an earlier fit stopped it)
        self.metrics.event("start", self.step, world=self.env.world, restarts=self.restarts, run_id=self.run_id)
        self._preview_text_at_start()
        self._base_preview_at_start()

    def _fetch(self) -> Fetched | None:
        """The next step's batches (None when the step is skipped on replay: its batch broke training before)."""
        self.watchdog.beat(self.step)
        self.log_handler.step = self.step
        t0 = time.perf_counter()                   # (an injected 'slow' fault counts as this rank's time)
        faults.at_step(self.step + 1, wait=self.checkpointer.wait)
        batches = next(self.loader)
        fetched = Fetched(batches, t0, time.perf_counter() - t0)
        if os.environ.get("DIFFTRAIN_SAMPLE_LOG"):
            ids = [int(i) for b in batches for i in torch.as_tensor(b.sample_ids).flatten()]
            faults.record_samples(self.step + 1, ids)
        if self.step + 1 in self.health.skip_steps:
            log.info("step %d: batch skipped on replay (it gave a non-finite step before)", self.step + 1)
            self.step += 1
            return None
        return fetched

    def _check_health(self, stats: StepStats, fetched: Fetched) -> bool:
        """Count the step; True when it was rolled back to a checkpoint instead."""
        self.step += 1
        if not stats.skipped:
            self.health.good_step()
            self.samples_seen += stats.samples
            self.health.spike(self.step, stats.loss, fetched.batches[0].task,
                              [b.sample_ids for b in fetched.batches])
            return False
        if not self.health.bad_step(self.step, stats.loss, stats.grad_norm):
            return False
        self.checkpointer.wait()
        target = self._find_checkpoint()
        if target is None:
            raise self.health.no_checkpoint(self.step)
        before = self.health.state_dict()
        self._resume(target)
        self.health.rolled_back(before, self.step, target)
        return True

    def _account(self, stats: StepStats, fetched: Fetched) -> None:
        """Times and counters of a finished step: the time budget, stragglers, the collective timeout."""
        self.watchdog.mark_steady()          # a step has finished: from now on hang_seconds applies
        if self.step >= self.cfg.parallel.startup_steps and not self.timeout_tightened:
            set_collective_timeout(self.env, self.cfg.parallel.timeout_minutes)   # the checkpoint group keeps its own
            self.timeout_tightened = True
        self.train_seconds += fetched.data_s + fetched.step_s
        self.lead.step(fetched.data_s + fetched.step_s)
        self.tokens_seen += stats.tokens
        self.budget.observe(self.step, self.train_seconds)
        self.health.stragglers(self.step, fetched.data_s + fetched.step_s - stats.wait_s, self.env.rank)
        if self.attention_kernel is not None:
            self._count_attention(fetched.batches)

    def _stop_requested(self, stats: StepStats) -> str | None:
        """Why every rank stops after this step (a preemption signal on any rank), or None. All ranks saw the
        same flag in the step's collective, so they agree on the step."""
        if not stats.stop:
            return None
        return self.preemption.requested or "a signal on another rank"

    def _checkpoint(self) -> None:
        every = self.cfg.train.checkpoint_every
        if every and self.step % every == 0 and self.step < self.total_steps:
            try:
                self.save()
            except SaveFailed as e:     # a blocking periodic save: counted as a background one's failure is
                log.error("%s (%d in a row; the run stops at %d: train.max_failed_saves)", e,
                          self.checkpointer.failed_in_row, self.cfg.train.max_failed_saves)

    def _finish(self, preempted: str | None, stats: StepStats | None, fetched: Fetched | None, t_start: float) -> dict:
        """The last checkpoint; on preemption the requeue marker, else the exported weights."""
        self.log_handler.step = self.step
        if preempted is not None and self.preemption.interrupted:      # Ctrl-C here: no scheduler to requeue
            self.save(blocking=True)
            self._log_step(stats, fetched, force=True)
            self.metrics.event("interrupt", self.step, signal=preempted)
            log.warning("interrupted (Ctrl-C): checkpoint at step %d written; the same command resumes from it",
                        self.step)
        elif preempted is not None:
            self.save(blocking=True)
            self._log_step(stats, fetched, force=True)
            if self.env.is_main:
                write_requeue_marker(self.run_dir, self.step, preempted)
            self.metrics.event("preempt", self.step, signal=preempted)
            log.warning("preempted (%s): checkpoint at step %d written; %s left for the launcher to requeue",
                        preempted, self.step, REQUEUE_MARKER)
        elif self.step > 0:
            self.save(blocking=True)
            self._sample()
            self.watchdog.beat(self.step, "export")
            self.export()
            log.info("finished: %d steps, %d skipped, %d rollbacks, %.1f s of training", self.step,
                     self.health.skipped_steps, self.health.rollbacks, self.train_seconds)
        self.checkpointer.wait()
        self.watchdog.stop()
        return {"steps": self.step, "train_seconds": round(self.train_seconds, 2), "num_params": num_params(self.model),
                "wall_seconds": round(time.perf_counter() - t_start, 2), "tokens": self.tokens_seen,
                "world_size": self.env.world, "skipped_steps": self.health.skipped_steps,
                "rollbacks": self.health.rollbacks, "restarts": self.restarts, "preempted": preempted is not None,
                "interrupted": preempted is not None and self.preemption.interrupted,
                **({"attention_calls": dict(self.attention_calls)} if self.attention_kernel is not None else {})}

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
