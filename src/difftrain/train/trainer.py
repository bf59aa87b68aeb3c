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
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config, to_dict, to_toml
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
from difftrain.train.checkpoint import Checkpointer
from difftrain.train.ema import EMA
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


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, env: ParallelEnv | None = None):
        self.cfg, tc = cfg, cfg.train
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        self.env = env or init_distributed(cfg)
        self.device = self.env.device
        self.amp = amp_dtype(tc.precision, self.device)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if cfg.data.source == "store":   # global and micro-batches per bucket: the store loader checks them
            self.micro_batch, self.accum = 0, 1
        else:
            self.micro_batch, self.accum = batch_split(tc.global_batch, tc.micro_batch, self.env.dp_size)
        self.checkpointer = Checkpointer(self.run_dir, tc.keep_checkpoints)
        resume = self.checkpointer.latest()
        info = Checkpointer.read_info(resume) if resume else None
        torch.manual_seed(cfg.run.seed)

        ae_cfg = cfg.autoencoder
        self.autoencoder = build_autoencoder(ae_cfg.kind, ae_cfg.factor, ae_cfg.path, ae_cfg.scaling,
                                             ae_cfg.shift).to(self.device)
        vocab = info.get("text_encoder", {}).get("vocabulary") if info else None
        if vocab is None and cfg.text.kind == "words":
            vocab = vocabulary_for(cfg)
        self.text_encoder = build_text_encoder(cfg, vocab, self.device)
        self.model = self._build_model(resume is None)
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
        self.metrics = MetricsLogger(self.run_dir)
        self.step = 0
        self.total_steps = tc.steps
        self.budget_fixed = tc.minutes == 0
        self.train_seconds = 0.0
        self.peak, self.peak_source = self._peak()
        self.compiled_graphs = compile_count()
        self.timeout_tightened = False
        if resume is not None:
            self._resume(resume)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))

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
    def _resume(self, path: Path) -> None:
        info = Checkpointer.load(path, self.model, self.optimizer, self.ema)
        self.step = int(info["step"])
        self.loader.load_state_dict(info["loader"])
        self.total_steps = int(info["total_steps"])
        self.budget_fixed = bool(info.get("budget_fixed", True))
        self.train_seconds = float(info.get("train_seconds", 0.0))
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        extra = {"loader": self.loader.state_dict(), "total_steps": self.total_steps,
                 "budget_fixed": self.budget_fixed, "train_seconds": self.train_seconds,
                 "ema_updates": self.ema.updates if self.ema else 0, "config": to_dict(self.cfg),
                 "world_size": self.env.world,
                 "text_encoder": getattr(self.text_encoder, "extra_state", lambda: {"kind": "hf"})(),
                 "num_params": {"dit": num_params(self.dit), "total": num_params(self.model)}}
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.ema, extra)

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
        tc = self.cfg.train
        lr = lr_at(self.step, tc.lr, self.total_steps, tc.warmup_steps, tc.schedule, tc.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        # The loss is a sum over target tokens divided by the step's global count (over ranks and
        # micro-batches; context-parallel peers hold the same samples, hence / cp).
        local_targets = float(sum(int(b.loss_mask_BL.sum()) for b in batches))
        n_targets, n_samples = all_reduce_sum([local_targets, float(sum(len(b) for b in batches))], self.device)
        n_targets = max(1.0, n_targets / self.env.cp)
        total = torch.zeros((), device=self.device)
        tokens = flops = 0.0
        for i, batch in enumerate(batches):
            set_gradient_sync(self.fsdp_units, i == len(batches) - 1, self.cfg.parallel.grad_sync)
            loss, n_tok, n_flops = self._forward_loss(batch, n_targets)
            loss.backward()
            total += loss.detach()
            tokens, flops = tokens + n_tok, flops + n_flops
        all_reduce_grads(self.replicated)
        # The optimizer's parameters are the sharded ones; a unit left gathered would name other tensors.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        gnorm = clip_grad_norm(params, tc.grad_clip or float("inf"))
        loss_sum, tokens, flops = all_reduce_sum([float(total), tokens, flops], self.device)
        if not math.isfinite(loss_sum) or not math.isfinite(gnorm):
            raise FloatingPointError(f"step {self.step}: loss {loss_sum} / grad norm {gnorm} is not finite "
                                     "(lower train.lr or raise train.warmup_steps)")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        cp = self.env.cp
        return StepStats(loss_sum, gnorm, lr, int(tokens / cp), int(n_samples / cp), flops / cp)

    # --- the loop ---------------------------------------------------------------------------------
    def pipeline(self) -> Pipeline:
        return Pipeline(self.model, self.text_encoder, self.autoencoder, self.flow, self.device, self.amp,
                        sample_shift=(self.cfg.sample.shift, self.cfg.sample.shift_value))

    def _fix_budget(self, steps_done: int, seconds: float) -> None:
        """With ``train.minutes``, set the step count (and with it the LR schedule) from the measured speed.
        Called every 60 steps (the first steps are often slower than the rest) until half of the steps are
        done; later the schedule stays put. Each correction moves the cosine LR by a few %. Every rank
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
        values = {"loss": stats.loss, "grad_norm": round(stats.grad_norm, 4), "lr": stats.lr,
                  "task": batch.task, "seq": [batch.x0_BLC.shape[1], batch.text.txt_BTD.shape[1] if batch.text is not None
                          else max((v.shape[1] for v in batch.tokens.values()), default=0)],
                  "data_s": round(data_s, 4), "step_s": round(step_s, 4),
                  "samples_per_s": round(stats.samples / total_s, 2), "tokens_per_s": round(stats.tokens / total_s, 1),
                  "train_seconds": round(self.train_seconds, 2)}
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

    def fit(self, on_step=None) -> dict:
        tc, par = self.cfg.train, self.cfg.parallel
        params = num_params(self.model)
        tokens_seen = 0
        t_start = time.perf_counter()
        calib_from, calib_at = None, None
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batches = next(self.loader)
            t1 = time.perf_counter()
            stats = self.train_step(batches)
            t2 = time.perf_counter()
            self.step += 1
            if self.step >= par.startup_steps and not self.timeout_tightened:
                set_collective_timeout(self.env, par.timeout_minutes)
                self.timeout_tightened = True
            self.train_seconds += t2 - t0
            tokens_seen += stats.tokens
            if not self.budget_fixed:
                # Measure speed over enough steps to average the task mixture (keyframe batches cost
                # several times a t2i batch), skipping the first steps (allocator warm-up, compilation).
                if calib_from is None and self.step >= 5:
                    calib_from, calib_at = self.step, self.train_seconds
                elif calib_from is not None and (self.step - calib_from) % 60 == 0:
                    self._fix_budget(self.step - calib_from, self.train_seconds - calib_at)
            if self.step % tc.log_every == 0 or self.step == self.total_steps:
                self._log(stats, batches[0], t1 - t0, t2 - t1)
            if on_step is not None:
                on_step(self.step, self.total_steps, stats)
            if tc.sample_every and self.step % tc.sample_every == 0:
                self.sample_grid(self.run_dir / "samples" / f"step_{self.step:08d}.png")
            if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < self.total_steps:
                self.save()
        if self.step > 0:
            self.save()
            self.export()
        return {"steps": self.step, "train_seconds": round(self.train_seconds, 2), "num_params": params,
                "wall_seconds": round(time.perf_counter() - t_start, 2), "tokens": tokens_seen,
                "world_size": self.env.world}

    def close(self) -> None:
        """Stop the data source's readers; flush and close the metrics files (TensorBoard's writer included)."""
        if hasattr(self.loader, "close"):
            self.loader.close()
        self.metrics.close()

    # --- outputs ----------------------------------------------------------------------------------
    def export(self) -> Path:
        """Inference weights (EMA if kept) as safetensors, with the config beside them. Sharded tensors are
        gathered one at a time (every rank takes part); rank 0 writes."""
        from safetensors.torch import save_file

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
        pipe = self.pipeline()
        rows = []
        with self.ema.applied(self.model) if self.ema else contextlib.nullcontext(), cp_disabled(self.model):
            self.model.eval()
            for task in ("t2i", "edit", "keyframes"):
                for g in generate_task(pipe, world, task, list(range(n)), s.steps, s.cfg_scale, s.seed,
                                       self.cfg.eval.keyframe_given):
                    rows.append((g.images, g.prompt))
        return caption_grid(rows, path) if self.env.is_main else path
