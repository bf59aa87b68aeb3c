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

- **Over ranks.** The set's micro-batches are dealt round robin over the data-parallel ranks (``shard``); a rank short
  of one forwards a repeat that it does not count, so every rank runs the same number of forwards and FSDP's
  collectives line up. Each rank reads only its share of a store's rows; the sums are added over ranks (context-
  parallel peers, which run full sequences here, count theirs alike: the ratio is the same). A row that cannot be read
  is a verdict every rank hears before any forward: the validation of that step is skipped on every rank and logged
  (a loss over part of the set would not compare with the others), and training goes on.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from difftrain.data.batch import Batch
from difftrain.diffusion.flow import FlowSpec, flow_loss, loss_weight, noisy_input, sample_generator, to_velocity
from difftrain.errors import UserError

log = logging.getLogger("difftrain.train")

TASK_ID_SPAN = 1 << 40        # shapes validation: sample id = task index * span + example index


def grid(k: int) -> list[float]:
    return [(i + 0.5) / k for i in range(k)]


def shard(items: list, rank: int, world: int) -> list[tuple[object, bool]]:
    """This rank's share of ``items`` dealt round robin, each with whether it counts: every rank gets
    ceil(len / world) items, the short ones a repeat of an item that does not count (its forward keeps the ranks'
    collectives in step). Empty for no items on every rank alike."""
    if not items:
        return []
    per = -(-len(items) // world)
    return [(items[(rank + j * world) % len(items)], rank + j * world < len(items)) for j in range(per)]


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


def store_batches(cfg, loader, step: int, rank: int = 0, world: int = 1) -> tuple[str, list[tuple[Batch, bool]], int]:
    """This rank's share (``shard``) of up to ``validation.n`` rows of the held-out source from each table of the
    stage in force at ``step``: (the stage, [(micro-batch, counts)], the rows of its share it could not read). Only the
    share's rows are read."""
    from difftrain.data.curriculum import stage_at
    from difftrain.train import faults

    stage = stage_at(loader.stages, step)
    name = cfg.validation.source
    parts = []                          # (table, row positions, sample ids) of every micro-batch of the set
    for tname, table in sorted(loader.tables.items()):
        if table.info.stage != stage.name or name not in table.spans:
            continue
        lo, hi = table.spans[name]
        at = np.arange(lo, min(hi, lo + cfg.validation.n))
        if not len(at):
            continue
        ids = table.ids[at].tolist()
        micro = stage.bucket(table.info.bucket).micro_for(table.info.frames, len(at))
        parts += [(table, at[s:s + micro], ids[s:s + micro]) for s in range(0, len(at), micro)]
    if not parts:
        raise UserError(f"validation.source = {name!r}: no rows of that source in the tables of stage "
                        f"{stage.name!r} (is it one of data.sources, and did 'difftrain prepare' write it?)")
    out, lost = [], 0
    damaged = faults.validation_unreadable_at(step + 1)     # the fault harness: this rank's share reads as damaged
    for (table, part, part_ids), counts in shard(parts, rank, world):
        rows = {} if damaged else loader._read_rows(table, part_ids, part)
        keep = [j for j, i in enumerate(part_ids) if i in rows]
        lost += len(part_ids) - len(keep)
        if len(keep) < len(part_ids):
            log.warning("validation at step %d: %d of %d rows of table %s unreadable (sample ids %s)", step + 1,
                        len(part_ids) - len(keep), len(part_ids), table.info.name,
                        [i for i in part_ids if i not in rows][:5])
        if not keep:
            continue
        F = table.info.frames
        drop = np.zeros(len(keep), dtype=bool)
        targets = np.ones((len(keep), F), dtype=bool)
        if table.info.task == "keyframes" and cfg.eval.keyframe_given == "first":
            targets[:, 0] = False
        plan = {"at": part[keep], "drop": drop}
        b = loader._collate(table, table.info.task, [rows[part_ids[j]] for j in keep], drop, targets,
                            [part_ids[j] for j in keep], loader._text_lengths(table, plan))
        out.append((b, counts))
    return stage.name, out, lost


@torch.no_grad()
def validation_sums(denoiser, batches: list[tuple[Batch, bool]], spec: FlowSpec, k: int,
                    seed: int) -> tuple[Tensor, Tensor]:
    """Per grid point, the objective's summed error and the counted tokens of the micro-batches that count (float64,
    on the host); a micro-batch that does not count is forwarded all the same (its rank's collectives stay in step)."""
    ts = grid(k)
    err = torch.zeros(k, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64)
    for batch, counts in batches:
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
            if counts:
                err[j] += float(total)
                count[j] += float(counted.sum())
    return err, count


def per_grid_point(err: Tensor, count: Tensor) -> tuple[float, list[float]]:
    """(mean over the grid, per grid point) of summed errors over counts."""
    per_t = (err / count.clamp(min=1.0)).tolist()
    return float(np.mean(per_t)), per_t


def validation_loss(denoiser, batches: list[Batch], spec: FlowSpec, k: int, seed: int) -> tuple[float, list[float]]:
    """(mean over the grid, per grid point) of the objective's error on ``batches`` at fixed t and noise (one
    process, every batch counted)."""
    return per_grid_point(*validation_sums(denoiser, [(b, True) for b in batches], spec, k, seed))
