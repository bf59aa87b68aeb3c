"""The training loop: one process now, written so the distributed issue only adds wrapping.

A step: draw ``grad_accum`` micro-batches (the loader decides their task), noise the target tokens at
sampled timesteps, predict, MSE against v = eps - x0 on target tokens, clip, AdamW, EMA. Everything
the loop depends on is in the checkpoint (model, EMA, optimizer, schedule, loader position, RNG,
step), so rerunning on the same run directory continues the same sample stream.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from difftrain.config import Config, to_dict, to_toml
from difftrain.data import world_from_config
from difftrain.data.shapes_loader import ShapesLoader
from difftrain.diffusion.flow import FlowSpec, flow_loss, loss_weight, noisy_input, sample_t, to_velocity
from difftrain.diffusion.pipeline import Pipeline, autocast
from difftrain.models import build_autoencoder, build_model, build_text_encoder, num_params
from difftrain.parallel import compile_blocks
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


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, device: torch.device | None = None,
                 progress: bool = True):
        self.cfg, tc = cfg, cfg.train
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        self.device = device or pick_device()
        self.amp = amp_dtype(tc.precision, self.device)
        self.progress = progress
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.checkpointer = Checkpointer(self.run_dir, tc.keep_checkpoints)
        resume = self.checkpointer.latest()
        info = Checkpointer.read_info(resume) if resume else None
        torch.manual_seed(cfg.run.seed)

        self.autoencoder = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor, cfg.autoencoder.path,
                                             cfg.autoencoder.scaling, cfg.autoencoder.shift)
        vocab = info.get("text_encoder", {}).get("vocabulary") if info else None
        self.text_encoder = build_text_encoder(cfg, vocab, self.device)
        self.model = build_model(cfg, self.text_encoder, self.autoencoder, self.device)
        self.dit = self.model["dit"]
        self.flow = FlowSpec.from_config(cfg.diffusion)
        if tc.compile:
            compile_blocks(self.dit)
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)
        self.ema = EMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None

        d = cfg.data
        self.world = world_from_config(d, cfg.run.seed)
        self.loader = ShapesLoader(
            self.world, self.autoencoder, self.text_encoder.tokenize, tc.batch_size,
            {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight}, d.world_size,
            d.caption_dropout, d.keyframe_cond_prob, cfg.run.seed)
        self.metrics = MetricsLogger(self.run_dir)
        self.step = 0
        self.total_steps = tc.steps
        self.budget_fixed = tc.minutes == 0
        self.train_seconds = 0.0
        if resume is not None:
            self._resume(resume)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))

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
                 "text_encoder": getattr(self.text_encoder, "extra_state", lambda: {"kind": "hf"})(),
                 "num_params": {"dit": num_params(self.dit), "total": num_params(self.model)}}
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.ema, extra)

    # --- one optimizer step -----------------------------------------------------------------------
    def train_step(self, batches: list) -> StepStats:
        tc = self.cfg.train
        lr = lr_at(self.step, tc.lr, self.total_steps, tc.warmup_steps, tc.schedule, tc.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.run.seed * 1_000_003 + self.step)
        self.model.train()
        total = 0.0
        for batch in batches:
            batch = batch.to(self.device)
            B = len(batch)
            _, H, W = batch.grid
            t = sample_t(B, self.flow, (H // 2) * (W // 2), gen, self.device)
            eps = torch.randn(batch.x0_BLC.shape, generator=gen, device=self.device)
            xt = noisy_input(batch.x0_BLC, eps, t, batch.loss_mask_BL)
            # Guidance-distilled models (FLUX.1-dev) are fine-tuned with the embedded guidance at 1.
            g = torch.ones(B, device=self.device) if self.dit.params.guidance_embed else None
            with autocast(self.device, self.amp):
                emb = self.text_encoder(batch.tokens)
                out = self.dit(xt, batch.ids_BL3, emb.txt_BTD, t, emb.pooled_BP, g)
            v = to_velocity(out.float(), xt, t, self.flow.prediction)
            loss = flow_loss(v, batch.x0_BLC, eps, batch.loss_mask_BL, loss_weight(t, self.flow.loss)) / len(batches)
            loss.backward()
            total += float(loss.detach())
        if tc.grad_clip > 0:
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip))
        else:
            gnorm = float(torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in self.model.parameters() if p.grad is not None])))
        if not math.isfinite(total) or not math.isfinite(gnorm):
            raise FloatingPointError(f"step {self.step}: loss {total} / grad norm {gnorm} is not finite "
                                     "(lower train.lr or raise train.warmup_steps)")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        return StepStats(total, gnorm, lr)

    # --- the loop ---------------------------------------------------------------------------------
    def pipeline(self) -> Pipeline:
        return Pipeline(self.model, self.text_encoder, self.autoencoder, self.flow, self.device, self.amp)

    def _fix_budget(self, steps_done: int, seconds: float) -> None:
        """With ``train.minutes``, set the step count (and with it the LR schedule) from the measured speed.
        Called every 60 steps (the first steps are often slower than the rest) until half of the steps are
        done; later the schedule stays put. Each correction moves the cosine LR by a few %."""
        budget = self.cfg.train.minutes * 60
        per_step = seconds / max(1, steps_done)
        self.total_steps = min(self.cfg.train.steps,
                               self.step + max(0, int((budget - self.train_seconds) / per_step)))
        self.budget_fixed = self.step >= self.total_steps // 2
        log.info("time budget %.1f min: %.3f s/step -> %d steps", budget / 60, per_step, self.total_steps)

    def fit(self, on_step=None) -> dict:
        tc = self.cfg.train
        params = num_params(self.model)
        tokens_seen = 0
        t_start = time.perf_counter()
        calib_from, calib_at = None, None
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batches = [next(self.loader) for _ in range(tc.grad_accum)]
            t1 = time.perf_counter()
            stats = self.train_step(batches)
            t2 = time.perf_counter()
            self.step += 1
            self.train_seconds += t2 - t0
            n_tokens = sum(int(b.x0_BLC.shape[0] * b.x0_BLC.shape[1]) for b in batches)
            tokens_seen += n_tokens
            if not self.budget_fixed:
                # Measure speed over enough steps to average the task mixture (keyframe batches cost
                # several times a t2i batch), skipping the first steps (allocator warm-up, compilation).
                if calib_from is None and self.step >= 5:
                    calib_from, calib_at = self.step, self.train_seconds
                elif calib_from is not None and (self.step - calib_from) % 60 == 0:
                    self._fix_budget(self.step - calib_from, self.train_seconds - calib_at)
            if self.step % tc.log_every == 0 or self.step == self.total_steps:
                self.metrics.log(self.step, {
                    "loss": round(stats.loss, 6), "grad_norm": round(stats.grad_norm, 4), "lr": stats.lr,
                    "task": batches[0].task, "data_s": round(t1 - t0, 4), "step_s": round(t2 - t1, 4),
                    "samples_per_s": round(sum(len(b) for b in batches) / (t2 - t0), 2),
                    "tokens_per_s": round(n_tokens / (t2 - t0), 1), "train_seconds": round(self.train_seconds, 2)})
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
                "wall_seconds": round(time.perf_counter() - t_start, 2), "tokens": tokens_seen}

    # --- outputs ----------------------------------------------------------------------------------
    def export(self) -> Path:
        """Inference weights (EMA if kept) as safetensors, with the config beside them."""
        from safetensors.torch import save_file

        out = self.run_dir / "export"
        out.mkdir(parents=True, exist_ok=True)
        if self.ema is not None:
            sd = {k: v.contiguous() for k, v in self.ema.state_dict().items()}
        else:
            sd = {k: v.detach().float().contiguous() for k, v in self.model.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "difftrain-weights/1"})
        (out / "config.toml").write_text(to_toml(self.cfg))
        return out / "model.safetensors"

    def sample_grid(self, path: Path, n: int = 4) -> Path:
        from difftrain.evaluate import generate_task
        from difftrain.images import caption_grid

        s, world = self.cfg.sample, world_from_config(self.cfg.data, self.cfg.eval.seed)
        pipe = self.pipeline()
        rows = []
        with self.ema.applied(self.model) if self.ema else contextlib.nullcontext():
            self.model.eval()
            for task in ("t2i", "edit", "keyframes"):
                for g in generate_task(pipe, world, task, list(range(n)), s.steps, s.cfg_scale, s.seed,
                                       self.cfg.eval.keyframe_given):
                    rows.append((g.images, g.prompt))
        return caption_grid(rows, path)

