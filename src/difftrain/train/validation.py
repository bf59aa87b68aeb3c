"""The flow-matching validation loss (``[validation]``): the training objective's error on a held-out split,
with the noise and the timesteps fixed, so that two evaluations differ only by the weights (the method SD3-class
trainers use: a loss at random t and noise moves by more from draw to draw than from step to step).

- **The split.** Shapes: ``validation.n`` examples per task of the evaluation world (``eval.seed``: scenes never
  trained on), each keyframe clip with its first frame given as ``eval.keyframe_given`` says. Store: the rows of
  the source ``validation.source`` names, which the loader leaves out of training; up to ``n`` per table of the
  stage in force (a curriculum's stage change starts a new series: ``val_stage`` is logged beside it).
- **The grid.** Every sample is judged at each t_k = (k + 0.5) / K (``validation.timesteps``), with noise drawn
  from ``flow.sample_generator(seed, k, sample id)``; no caption dropout, no shift.
- **The value.** Per t_k, the objective's (t-weighted, for x-loss) squared error summed over the counted target
  tokens (a loss mask holds) over the count: ``val_loss_t<k>``; ``val_loss`` is their mean (each t weighs the
  same). With ``validation.ema`` the EMA weights' too (``val_loss_ema``).

Every rank computes the whole set on full sequences (context parallelism off, as previews are), so FSDP's
collectives line up and every rank holds the same figures; no reduction is needed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from difftrain.data.batch import Batch
from difftrain.diffusion.flow import FlowSpec, flow_loss, loss_weight, noisy_input, sample_generator, to_velocity
from difftrain.errors import UserError

TASK_ID_SPAN = 1 << 40        # shapes validation: sample id = task index * span + example index


def grid(k: int) -> list[float]:
    return [(i + 0.5) / k for i in range(k)]


def shapes_batches(cfg, autoencoder, tokenize, micro: int) -> list[Batch]:
    """``validation.n`` examples of each trained task from the evaluation world, in micro-batches."""
    from difftrain.models.text import pad_tokens
    from difftrain.shapes import world_from_config
    from difftrain.shapes.loader import TASKS, make_batch

    d, v = cfg.data, cfg.validation
    world = world_from_config(d, cfg.eval.seed)
    weights = {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight}
    out = []
    for ti, task in enumerate(TASKS):
        if weights[task] <= 0:
            continue
        for lo in range(0, v.n, micro):
            idx = list(range(lo, min(v.n, lo + micro)))
            targets = None
            if task == "keyframes":
                first = cfg.eval.keyframe_given == "first"
                targets = [[not (first and f == 0) for f in range(world.frames)] for _ in idx]
            out.append(make_batch(world, autoencoder, tokenize, task, idx, targets, None,
                                  [ti * TASK_ID_SPAN + i for i in idx]))
    # every batch padded to the set's longest, per key: the same padding at every evaluation
    longest = {k: max(b.tokens[k].shape[1] for b in out) for k in out[0].tokens} if out else {}
    for b in out:
        b.tokens = {k: pad_tokens({k: t}, longest[k])[k] for k, t in b.tokens.items()}
    return out


def store_batches(cfg, loader, step: int) -> tuple[str, list[Batch]]:
    """Up to ``validation.n`` rows of the held-out source from each table of the stage in force at ``step``."""
    from difftrain.data.curriculum import stage_at

    stage = stage_at(loader.stages, step)
    name = cfg.validation.source
    out = []
    for tname, table in sorted(loader.tables.items()):
        if table.info.stage != stage.name or name not in table.spans:
            continue
        lo, hi = table.spans[name]
        at = np.arange(lo, min(hi, lo + cfg.validation.n))
        if not len(at):
            continue
        ids = table.ids[at].tolist()
        bucket = stage.bucket(table.info.bucket)
        F = table.info.frames
        micro = bucket.micro_for(F, len(at))
        for s in range(0, len(at), micro):
            part, part_ids = at[s:s + micro], ids[s:s + micro]
            rows = loader._read_rows(table, part_ids, part)
            keep = [j for j, i in enumerate(part_ids) if i in rows]
            if not keep:
                continue
            drop = np.zeros(len(keep), dtype=bool)
            targets = np.ones((len(keep), F), dtype=bool)
            if table.info.task == "keyframes" and cfg.eval.keyframe_given == "first":
                targets[:, 0] = False
            plan = {"at": part[keep], "drop": drop}
            b = loader._collate(table, table.info.task, [rows[part_ids[j]] for j in keep], drop, targets,
                                [part_ids[j] for j in keep], loader._text_lengths(table, plan))
            out.append(b)
    if not out:
        raise UserError(f"validation.source = {name!r}: no rows of that source in the tables of stage "
                        f"{stage.name!r} (is it one of data.sources, and did 'difftrain prepare' write it?)")
    return stage.name, out


@torch.no_grad()
def validation_loss(denoiser, batches: list[Batch], spec: FlowSpec, k: int, seed: int) -> tuple[float, list[float]]:
    """(mean over the grid, per grid point) of the objective's error on ``batches`` at fixed t and noise."""
    ts = grid(k)
    err = torch.zeros(k, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64)
    for batch in batches:
        b = denoiser.on_device(batch)
        emb = denoiser.embed_text(b)
        counted = b.counted_BL
        shape = tuple(b.x0_BLC.shape[1:])
        for j, t in enumerate(ts):
            eps = torch.stack([torch.randn(shape, generator=sample_generator(seed, j, sid, denoiser.device),
                                           device=denoiser.device) for sid in b.sample_ids])
            t_B = torch.full((len(b),), t, device=denoiser.device)
            xt = noisy_input(b.x0_BLC, eps, t_B, b.loss_mask_BL)
            out, xt = denoiser(b, xt, t_B, emb)
            v = to_velocity(out.float(), xt, t_B, spec.prediction)
            total: Tensor = flow_loss(v, b.x0_BLC, eps, counted, loss_weight(t_B, spec.loss), normalizer=1.0)
            err[j] += float(total)
            count[j] += float(counted.sum())
    per_t = (err / count.clamp(min=1.0)).tolist()
    return float(np.mean(per_t)), per_t
