"""What a run reports and produces beside its steps: the metrics row of a step (with the attention dispatch
counts), the frozen encoders' first build, the LR schedule's re-plan when a resumed run's length changed, the
preview grids, the sampling pipeline and the end-of-run export. A part of ``Trainer`` (a base class it
inherits), apart from the loop so that each reads on its own."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from difftrain.data.batch import Batch
from difftrain.diffusion.pipeline import Pipeline
from difftrain.parallel.compile import compile_count
from difftrain.parallel.dist import agree, all_reduce_sum
from difftrain.parallel.cp import cp_disabled
from difftrain.parallel.flops import mfu
from difftrain.train.metrics import peak_memory_gb
from difftrain.train.schedule import lr_at

if TYPE_CHECKING:
    from difftrain.train.records import Fetched, StepStats

log = logging.getLogger("difftrain.train")


class PreviewStopped(Exception):
    """A stop was asked for while a preview sampled: the preview is abandoned on every rank."""


class TrainerOutputs:
    """The reporting and output methods of ``Trainer`` (they use its model, loader, metrics and config)."""

    def _encoders_built(self, encoder) -> None:
        from difftrain.models.hf_text import resident_bytes

        size = resident_bytes(encoder)
        log.info("frozen text encoders built on %s for their first use: %.2f GiB", self.device, size / 2**30)
        self.metrics.event("encoders_built", getattr(self, "step", 0), rank=self.env.rank, bytes=size,
                           device=str(self.device))

    def _replan_lr(self, saved_total: int) -> None:
        """The run's length changed since its checkpoint: the LR schedule goes on as ``train.schedule_change`` says
        (the cosine is a function of the total, so taken as is the LR would jump here), and says so."""
        tc = self.cfg.train
        shape = (tc.warmup_steps, tc.schedule, tc.min_lr_ratio)
        before = lr_at(self.step, tc.lr, saved_total, *shape, self.budget.lr_anchor)
        follow = lr_at(self.step, tc.lr, self.total_steps, *shape)
        keep = tc.schedule_change == "keep_lr" and tc.schedule == "cosine" and self.step >= tc.warmup_steps
        self.budget.lr_anchor = (self.step, before) if keep else None
        log.warning("the run's length changed from %d to %d steps at step %d: the LR there is %.4g on the old "
                    "schedule and %.4g on the new one; it goes on %s (train.schedule_change = %r)", saved_total,
                    self.total_steps, self.step, before, follow,
                    f"from {before:.4g}, decaying to the new end" if keep else f"at {follow:.4g}", tc.schedule_change)
        self.metrics.event("schedule_change", self.step, old_total=saved_total, new_total=self.total_steps,
                           lr_old_schedule=before, lr_new_schedule=follow, lr=before if keep else follow,
                           mode=tc.schedule_change)

    def _count_attention(self, batches: list[Batch]) -> None:
        """The step's forward attention calls (one a block and micro-batch) on a tuned kernel and on the fallback,
        from the micro-batches' shapes as the hybrid dispatches them; a shape the tuner missed is logged once."""
        from difftrain.models.kernels import Shape
        from difftrain.parallel.tune import dispatch_counts, dtype_name

        m, p = self.cfg.model, self.dit.params
        shapes = [Shape(len(b), m.heads // self.env.cp, sum(_seq(b)), m.hidden // m.heads, dtype_name(self.amp),
                        self.cfg.text.padding == "masked") for b in batches]
        tuned, fallback, missing = dispatch_counts(self.attention_kernel.table, shapes,
                                                   p.double_blocks + p.single_blocks)
        self.attention_calls["tuned"] += tuned
        self.attention_calls["fallback"] += fallback
        for key in sorted(missing - self.attention_missing):
            log.warning("attention: shape %s was not tuned; %s runs it (%d shapes tuned)", key,
                        self.attention_kernel.fallback, len(self.attention_kernel.table))
        self.attention_missing |= missing

    def _sample(self) -> None:
        """The step's preview grid (``train.sample_every``), after its checkpoint. A preview never ends a run: a failure
        is a verdict every rank hears and logs, then training goes on; a stop asked for while it samples (a
        preemption, Ctrl-C) abandons it at the next sampler step on every rank, and the stop follows the next step."""
        every = self.cfg.train.sample_every
        if not (every and self.step % every == 0) or self.previewed == self.step:
            return
        self.previewed = self.step
        self.watchdog.beat(self.step, "sampling")
        self._guarded_preview(self.sample_grid, self.run_dir / "samples" / f"step_{self.step:08d}.png")

    def _guarded_preview(self, render, *args) -> None:
        """``render(*args)``, a preview, which never ends a run: a stop asked for while it samples abandons it, and a
        failure (rank 0 writes the grid alone) is a verdict every rank hears and logs before training goes on."""
        error = None
        try:
            render(*args)
        except PreviewStopped:
            log.warning("preview at step %d abandoned: a stop was asked for while it sampled", self.step)
            return
        except Exception as e:  # noqa: BLE001 -- a preview is an output, never a reason to end the run
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        verdict = agree(error)
        if verdict is not None:
            log.error("preview at step %d failed, training goes on: %s", self.step, verdict)
            self.metrics.event("preview_failed", self.step, reason=verdict)

    def _preview_step(self, i: int) -> None:
        """Before each sampler step of a preview: a watchdog beat, and the stop flag over every rank (one small
        all-reduce: all ranks abandon the preview together, so FSDP's gathers stay in step)."""
        self.watchdog.beat(self.step, "sampling")
        (stop,) = all_reduce_sum([1.0 if self.preemption.requested else 0.0], self.device)
        if stop:
            raise PreviewStopped(self.step)

    def _validate(self) -> None:
        """The flow-matching validation loss (``train.validation``) every ``validation.every`` steps and at the end,
        of the weights and of their EMA; kept for the step's metrics row (``_log_step`` writes it). The set is shared
        out over the data-parallel ranks and the sums added; a row any rank cannot read skips it on every rank."""
        from difftrain.train.contract import Denoiser
        from difftrain.train.validation import per_grid_point, shapes_batches, shard, store_batches, validation_sums

        v = self.cfg.validation
        if not v.every or self.objective.batch_kind != "samples" or not (
                self.step % v.every == 0 or self.step == self.total_steps):
            return
        self.watchdog.beat(self.step, "validation")
        t0 = time.perf_counter()
        rank, world = self.env.dp_rank, self.env.dp_size
        if self.cfg.data.source == "store":
            stage, batches, lost = store_batches(self.cfg, self.loader, self.step - 1, rank, world)
        else:
            if self.val_batches is None:
                micro = self.cfg.train.micro_batch or min(16, v.n)
                self.val_batches = shapes_batches(self.cfg, self.autoencoder, self.text_encoder.tokenize, micro)
            stage, batches, lost = None, shard(self.val_batches, rank, world), 0
        # the verdict on reads, heard by every rank before any forward (a rank that lost rows would otherwise run
        # fewer forwards, or raise alone, and leave the others in a collective until the timeout)
        (lost,) = all_reduce_sum([float(lost)], self.device)
        if lost:
            log.warning("validation at step %d skipped on every rank: %d rows of the set unreadable over the ranks",
                        self.step, round(lost / self.env.cp))
            self.metrics.event("validation_skipped", self.step, unreadable=round(lost / self.env.cp))
            self.val_values = {"val_skipped": 1}
            return
        denoiser = Denoiser(self.model, self.text_encoder, self.device, self.amp, 1, 0, self.cfg.text.padding)
        self.checkpointer.wait_staged()          # the EMA swap below writes the parameters
        was = self.model.training
        self.val_forwards = len(batches)         # this rank's micro-batches (its share, and a repeat if short)

        def loss_over_ranks() -> tuple[float, list[float]]:
            err, count = validation_sums(denoiser, batches, self.flow, v.timesteps, v.seed)
            summed = torch.tensor(all_reduce_sum(err.tolist() + count.tolist(), self.device), dtype=torch.float64)
            return per_grid_point(summed[:v.timesteps], summed[v.timesteps:])

        with cp_disabled(self.model):
            self.model.eval()
            loss, per_t = loss_over_ranks()
            values = {"val_loss": round(loss, 6), **{f"val_loss_t{j}": round(x, 6) for j, x in enumerate(per_t)}}
            if v.ema and self.ema is not None:
                with self.ema.applied(self.model):
                    values["val_loss_ema"] = round(loss_over_ranks()[0], 6)
        self.model.train(was)
        if stage is not None:
            values["val_stage"] = stage
        values["val_s"] = round(time.perf_counter() - t0, 3)
        self.val_values = values

    def _log_step(self, stats: StepStats, fetched: Fetched, force: bool = False) -> None:
        saved_now = self.last_save is not None and self.last_save.step == self.step
        val, self.val_values = self.val_values, None
        if not (force or saved_now or val or self.step % self.cfg.train.log_every == 0
                or self.step == self.total_steps):
            return
        batch, total_s = fetched.batches[0], fetched.data_s + fetched.step_s
        # an objective whose micro-batches carry no statistics is asked as before: metrics(loss, task)
        extra = () if stats.rows is None else (stats.rows,)
        values = {"time": round(time.time(), 3), **self.objective.metrics(stats.loss, batch.task, *extra),
                  "grad_norm": round(stats.grad_norm, 4), "lr": stats.lr, "task": batch.task,
                  "seq": _seq(batch), "shapes": sorted({(b.task, *_seq(b)) for b in fetched.batches}),
                  "data_s": round(fetched.data_s, 4), "step_s": round(fetched.step_s, 4),
                  "fwd_bwd_s": round(stats.fwd_bwd_s, 4), "optim_s": round(stats.optim_s, 4),
                  "samples_per_s": round(stats.samples / total_s, 2), "tokens_per_s": round(stats.tokens / total_s, 1),
                  "train_seconds": round(self.train_seconds, 2), "samples_seen": self.samples_seen,
                  "mem_gb": round(peak_memory_gb(self.device), 3), "skipped_steps": self.health.skipped_steps,
                  "restarts": self.restarts, "rollbacks": self.health.rollbacks, **self.health.straggler_info}
        if val:                      # this step's validation loss
            values.update(val)
        if self.stall_s:             # training time lost to checkpoints since the previous row
            values["checkpoint_stall_s"] = round(self.stall_s, 4)
            self.stall_s = 0.0
        errors = getattr(self.loader, "errors", None)
        if errors is not None:       # per-sample data faults skipped so far (damaged store rows)
            values["data_errors"] = errors
        if self.peak:
            values["mfu"] = round(mfu(stats.flops, total_s, self.env.world, self.peak), 5)
        if self.attention_kernel is not None:      # attention calls since the previous row: tuned, fallen back
            for k in ("tuned", "fallback"):
                values[f"attention_{k}_calls"] = self.attention_calls[k] - self.attention_logged[k]
            self.attention_logged = dict(self.attention_calls)
        graphs = compile_count()
        if graphs != self.compiled_graphs:
            values["recompiles"] = graphs - self.compiled_graphs
            log.info("step %d: %d new compiled graph(s), %d in all", self.step, graphs - self.compiled_graphs, graphs)
            self.compiled_graphs = graphs
        self.metrics.log(self.step, values)

    def pipeline(self) -> Pipeline:
        text = self.preview_text if self.preview_text is not None else self.text_encoder
        return Pipeline(self.model, text, self.autoencoder, self.flow, self.device, self.amp,
                        guidance=self.cfg.sample.guidance,
                        sample_shift=(self.cfg.sample.shift, self.cfg.sample.shift_value))

    def export(self) -> Path:
        """Inference weights (EMA if kept) as ``RUN/export/model.safetensors`` with the config beside them. With an
        adapter: 'merge' writes a plain model (each adapter folded into its layer's weight); 'adapter' writes the
        adapter under ``export/adapter/`` (its tensors by peft's names, ``adapter_config.json``) and the base as
        ``model.safetensors`` unless the base is ``model.init_from`` (a file the user has)."""
        from difftrain.parallel.pretrained import export_dtype, write_weights

        self.checkpointer.wait_staged()
        named = dict(self.model.named_parameters())
        if self.ema is not None:                 # the EMA of what was trained (with an adapter: of the adapters)
            named.update(self.ema.state_dict())
        new_words = named.pop("text.new_words", None)
        if new_words is not None:                # a plain words encoder again: the new words' rows after the base's
            named["text.embed.weight"] = torch.cat([_full(named["text.embed.weight"]), _full(new_words)])
        out, dtype = self.run_dir / "export", export_dtype(self.cfg, self.amp)
        if self.env.is_main:           # a words encoder's vocabulary: what model.init_from needs to carry it on
            from difftrain.parallel.words_init import write_vocabulary
            out.mkdir(parents=True, exist_ok=True)
            write_vocabulary(self.text_encoder, out)
        spec = self.adapter
        if spec is None:
            return write_weights(named, self.cfg, out, self.env.is_main, dtype=dtype)
        from difftrain.models.lora import base_name, delta, is_adapter, split_name

        base = {base_name(k): v for k, v in named.items() if not is_adapter(k)}
        factors: dict[str, dict[str, str]] = {}          # layer (plain name) -> {factor: parameter name}
        for k in named:
            if (split := split_name(k)) is not None:
                factors.setdefault(base_name(split[0]), {})[split[1]] = k

        def fold(name: str, weight):
            layer = name[: -len(".weight")] if name.endswith(".weight") else None
            if layer not in factors:
                return weight
            parts = {f: _full(named[k]) for f, k in sorted(factors[layer].items())}     # every rank: collectives
            return None if weight is None else weight.float() + delta(spec.kind, parts, spec.scale,
                                                                      tuple(weight.shape))

        if spec.export == "merge":
            return write_weights(base, self.cfg, out, self.env.is_main, transform=fold, dtype=dtype)
        path = write_weights({k: v for k, v in named.items() if is_adapter(k)}, self.cfg, out / "adapter",
                             self.env.is_main, dtype=dtype)
        if new_words is not None:                # the words the adapter learnt travel with it
            write_weights({"text.embed.weight": named["text.embed.weight"]}, self.cfg, out / "adapter" / "words",
                          self.env.is_main, dtype=dtype)
            if self.env.is_main:
                from difftrain.parallel.words_init import write_vocabulary
                write_vocabulary(self.text_encoder, out / "adapter" / "words")
        if not self.cfg.model.init_from and not self.quantized:     # the base, unless the user has it (or only
            path = write_weights(base, self.cfg, out, self.env.is_main, dtype=dtype)   # its quantized form is here)
        if self.env.is_main:
            import json
            (out / "adapter" / "adapter_config.json").write_text(json.dumps(
                {**spec.describe(), "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": self.adapter_layers,
                 "base": self.adapter_base}, indent=1))
        return path

    def sample_grid(self, path: Path) -> Path:
        """A preview grid of the run's own prompts (``ConfiguredSource.preview_prompts``) at fixed seeds, each row the
        **base** model's images (a fine-tune's: the adapters disabled, or the weights as ``model.init_from`` gave them
        at step 0), the **current** weights' and their **EMA**'s side by side; on every rank (FSDP all-gathers need all
        of them), on full sequences (context parallelism off); rank 0 writes the PNG and TensorBoard's image."""
        from difftrain.evaluate import preview_rows
        from difftrain.images import caption_grid

        n = self.cfg.preview.count
        if self.preview_prompts is None:
            self.preview_prompts = self.source.preview_prompts(n) or []
        self.checkpointer.wait_staged()          # the EMA swap below writes the parameters
        sets: list[tuple[str, list]] = []
        base = self._base_rows(n)
        if base is not None:
            sets.append(("base", base))
        was = self.model.training
        try:
            with cp_disabled(self.model):
                self.model.eval()
                sets.append(("now", preview_rows(self.pipeline(), self.cfg, n, self.preview_prompts,
                                                 self._preview_step)))
                if self.ema is not None:
                    with self.ema.applied(self.model):
                        sets.append(("EMA", preview_rows(self.pipeline(), self.cfg, n, self.preview_prompts,
                                                         self._preview_step)))
        finally:
            self.model.train(was)
        if not self.env.is_main:
            return path
        legend = " | ".join(name for name, _ in sets)
        rows = [([img for _, r in sets for img in r[i][0]], f"{sets[-1][1][i][1]}\n[{legend}]")
                for i in range(len(sets[-1][1]))]
        out = caption_grid(rows, path)
        self.metrics.image("previews", out, self.step)
        return out

    def _base_rows(self, n: int) -> list | None:
        """The base model's preview rows, rendered once: an adapter run's base is its model with the adapters
        disabled; a full fine-tune's (``model.init_from``) is its weights at step 0, rendered then and kept in
        ``RUN/samples/base_preview.npz`` for later steps and restarts. None for a run from scratch."""
        from difftrain.evaluate import preview_rows

        if self.base_preview is not None:
            return self.base_preview
        keep = self.run_dir / "samples" / "base_preview.npz"
        if self.adapter is not None:
            from difftrain.models.lora import adapters_disabled
            with cp_disabled(self.model), adapters_disabled(self.model["dit"]):
                self.model.eval()
                self.base_preview = preview_rows(self.pipeline(), self.cfg, n, self.preview_prompts,
                                                 self._preview_step)
        elif self.cfg.model.init_from and self.step == 0:
            with cp_disabled(self.model):
                self.model.eval()
                self.base_preview = preview_rows(self.pipeline(), self.cfg, n, self.preview_prompts,
                                                 self._preview_step)
            if self.env.is_main:
                _save_rows(self.base_preview, keep)
        elif self.cfg.model.init_from and keep.is_file():
            self.base_preview = _load_rows(keep)
        return self.base_preview

    def _preview_text_at_start(self) -> None:
        """A store-fed run's previews read their prompts' states from the store (``preview.text``): found before the
        first step, so a prompt the store does not hold stops the run now, not at its first preview."""
        if not self.cfg.train.sample_every or self.preview_text is not None:
            return
        find = getattr(self.source, "preview_text", None)
        if find is None:
            return
        from difftrain.evaluate import preview_specs

        if self.preview_prompts is None:
            self.preview_prompts = self.source.preview_prompts(self.cfg.preview.count) or []
        prompts = [s.prompt for s in preview_specs(self.cfg, self.preview_prompts)]
        self.preview_text = find(prompts, self.device) if prompts else None
        if self.preview_text is not None:
            log.info("previews read their %d prompts' text states from the store: the text encoders are not built",
                     len(prompts))

    def _base_preview_at_start(self) -> None:
        """A full fine-tune's base preview, before its first step (its weights are the base only then)."""
        if (self.cfg.train.sample_every and self.cfg.model.init_from and self.adapter is None and self.step == 0
                and self.objective.batch_kind == "samples"):
            if self.preview_prompts is None:
                self.preview_prompts = self.source.preview_prompts(self.cfg.preview.count) or []
            self._guarded_preview(self._base_rows, self.cfg.preview.count)


def _save_rows(rows: list, path: Path) -> None:
    """Preview rows as an .npz of uint8 images and a JSON of prompts and image counts (no pickle)."""
    import json

    import numpy as np
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"r{i}_{j}": np.asarray(im, dtype=np.uint8) for i, (imgs, _) in enumerate(rows) for j, im in enumerate(imgs)}
    meta = json.dumps([[len(imgs), p] for imgs, p in rows])
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, meta=np.frombuffer(meta.encode(), dtype=np.uint8), **arrays)
    tmp.replace(path)


def _load_rows(path: Path) -> list | None:
    """``_save_rows``'s rows; None (logged) for a file that is not one, so a damaged file costs only the column."""
    import json
    import zipfile

    import numpy as np
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            return [([z[f"r{i}_{j}"] for j in range(int(n))], str(p)) for i, (n, p) in enumerate(meta)]
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        log.warning("%s: not a preview file (%s); the base column is left out", path, e)
        return None


def _full(t):
    """A parameter's full tensor (a DTensor's gathered: a collective every rank calls)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _seq(batch: Batch) -> list[int]:
    """(image tokens, text tokens) of a micro-batch: the shape a compiled block sees."""
    text = (batch.text.txt_BTD.shape[1] if batch.text is not None
            else max((v.shape[1] for v in batch.tokens.values()), default=0))
    return [batch.x0_BLC.shape[1], text]
