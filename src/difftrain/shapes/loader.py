"""A deterministic, resumable loader over the shapes world: a mixture of text-to-image, editing and
keyframe batches by weight.

The batch plan is a pure function of (seed, step, world size, global batch, stages): which task a step
draws, which examples fill its global batch and how each example is perturbed (caption dropout,
which keyframes are given, each a function of (seed, step, slot in the global batch)). Given the run's
curriculum (``data.stages``), each step also draws one bucket of the stage in force, uniformly (a function of
(seed, step)): its scenes are rendered at the bucket's short side and centred on its canvas, as the exported
world lays them out for the store, so the on-the-fly source trains through the same resolutions and aspects. Data rank r of
D reads slice r of every global batch, split into micro-batches for gradient accumulation; each
sample carries its global index (step x global batch + slot). The state is a few integers counting
optimizer steps, so a run resumes exactly on any process count that divides the global batch.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from difftrain.data.batch import Batch, assemble, assemble_packed
from difftrain.models.text import pad_tokens
from difftrain.shapes.world import ShapesWorld
from difftrain.models.autoencoder import Autoencoder, PixelUnshuffleAE

TASKS = ("t2i", "edit", "keyframes")
Tokenize = Callable[[list[str]], dict[str, Tensor]]


def to_tensor(images_uint8: np.ndarray) -> Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images_uint8)).float() / 127.5 - 1.0
    return x.movedim(-1, -3)


def pack_pixels(images_uint8: np.ndarray, factor: int, p: int = 2) -> Tensor:
    """(B, F, H, W, 3) uint8 -> (B, F, H/(factor p) * W/(factor p), 3 factor² p²) float patch tokens in [-1, 1]:
    what ``to_tensor``, a ``factor``× pixel unshuffle and ``patchify`` give, bit for bit, in one transpose of the
    bytes (the float conversion is element-wise, so its order does not change a value)."""
    B, F, H, W, C = images_uint8.shape
    s = factor * p
    if H % s or W % s:
        raise ValueError(f"images {H}x{W} do not tile into {s}x{s} patch tokens")
    # pixel (ty*s + ph*factor + i, tx*s + pw*factor + j, c) -> token (ty, tx), channel ((c*factor + i)*factor + j)*p*p
    # + ph*p + pw: the unshuffle's channel (c, i, j), then patchify's (ph, pw)
    x = images_uint8.reshape(B, F, H // s, p, factor, W // s, p, factor, C)
    x = np.ascontiguousarray(x.transpose(0, 1, 2, 5, 8, 4, 7, 3, 6))
    t = torch.from_numpy(x).reshape(B, F, (H // s) * (W // s), C * s * s)
    return t.float() / 127.5 - 1.0


def changed_token_weights(edit_images: np.ndarray, token_pixels: int, weight: float) -> Tensor:
    """(B, 2 L) loss weights of edit examples ((B, 2, H, W, 3): target, reference): ``weight`` on the target's
    tokens with any pixel unlike the reference's (a token covers ``token_pixels`` squared pixels), 1 elsewhere."""
    B, _, H, W, _ = edit_images.shape
    s = token_pixels
    diff = (edit_images[:, 0] != edit_images[:, 1]).any(-1)                       # (B, H, W)
    changed = diff.reshape(B, H // s, s, W // s, s).any(axis=(2, 4)).reshape(B, -1)
    w = torch.ones(B, 2 * changed.shape[1])
    w[:, : changed.shape[1]] = torch.from_numpy(np.where(changed, np.float32(weight), np.float32(1.0)))
    return w


def make_batch(world: ShapesWorld, autoencoder: Autoencoder, tokenize: Tokenize, task: str, indices: list[int],
               keyframe_targets: list[list[bool]] | None = None, dropped: list[bool] | None = None,
               sample_ids: list[int] | None = None, canvas: tuple[int, int] | None = None,
               tokens: dict[str, Tensor] | None = None, changed_weight: float = 1.0) -> Batch:
    """Examples ``indices`` of ``task`` as one assembled batch. ``keyframe_targets[b][f]``: frame f of
    example b is predicted (default: all); ``dropped[b]``: example b gets the empty prompt; ``sample_ids``:
    the examples' global indices in the training stream (what noise and timesteps are drawn from);
    ``canvas``: (h, w) of a canvas the world's square scenes are centred on, as the exported world places
    them on aspect buckets (default: the scene itself); ``tokens``: these prompts already tokenized;
    ``changed_weight``: an edit's target tokens whose pixels differ from the reference's weigh this in the loss."""
    frames: list[np.ndarray] = []
    prompts: list[str] = []
    targets: list[list[bool]] = []
    meta: list[dict] = []
    for b, i in enumerate(indices):
        if task == "t2i":
            img, prompt, spec = world.t2i(i)
            frames.append(img[None])
            targets.append([True])
            meta.append({"index": i, "spec": spec})
        elif task == "edit":
            src, tgt, prompt, spec = world.edit(i)
            frames.append(np.stack([tgt, src]))          # target at index 0, reference at index 1
            targets.append([True, False])
            meta.append({"index": i, "spec": spec, "source": src})
        elif task == "keyframes":
            seq, prompt, spec = world.keyframes(i)
            frames.append(seq)
            targets.append(list(keyframe_targets[b]) if keyframe_targets else [True] * len(seq))
            meta.append({"index": i, "spec": spec, "frames": seq})
        else:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        prompts.append("" if dropped and dropped[b] else prompt)
    if canvas is not None:
        from difftrain.shapes.export import on_canvas
        frames = [np.stack([on_canvas(f, *canvas) for f in seq]) for seq in frames]
    images = np.stack(frames)                              # (B, F, H, W, 3) uint8
    B, F, H, W = images.shape[:4]
    frame_index = [0] if task == "t2i" else ([0, 1] if task == "edit" else list(range(F)))
    tokens = tokenize(prompts) if tokens is None else tokens
    if type(autoencoder) is PixelUnshuffleAE:              # weightless: the bytes packed straight into tokens
        f = autoencoder.factor
        batch = assemble_packed(pack_pixels(images, f), H // f, W // f, frame_index, torch.tensor(targets), tokens,
                                prompts, task, meta)
    else:
        pixels = to_tensor(images)                         # (B, F, 3, H, W)
        weight = next(autoencoder.parameters(), None)      # encode where the autoencoder lives (GPU or CPU)
        with torch.no_grad():
            lat = autoencoder.encode(pixels.flatten(0, 1).to(weight.device if weight is not None else "cpu"))
        lat = lat.reshape(B, F, *lat.shape[1:])
        batch = assemble(lat, frame_index, torch.tensor(targets), tokens, prompts, task, meta)
    if task == "edit" and changed_weight != 1.0:
        batch.weight_BL = changed_token_weights(images, autoencoder.factor * 2, changed_weight)
    batch.sample_ids = list(sample_ids) if sample_ids is not None else list(indices)
    return batch


class IndexStream:
    """Example indices of one task: a fresh permutation of range(n) each epoch, seeded by (seed, task, epoch)."""

    def __init__(self, n: int, seed: int, task_id: int):
        self.n, self.seed, self.task_id = n, seed, task_id
        self.epoch, self.pos = 0, 0
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.task_id, self.epoch]).permutation(self.n)
        return self._perm

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation()
            k = min(count - len(out), self.n - self.pos)
            out.extend(int(i) for i in perm[self.pos:self.pos + k])
            self.pos += k
            if self.pos == self.n:
                self.epoch, self.pos, self._perm = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self._perm = int(state["epoch"]), int(state["pos"]), None


class ShapesLoader:
    """Yields, per optimizer step, this data rank's micro-batches of the step's global batch."""

    def __init__(self, world: ShapesWorld, autoencoder: Autoencoder, tokenize: Tokenize, global_batch: int,
                 weights: dict[str, float], world_size: int, caption_dropout: float = 0.0,
                 keyframe_cond_prob: float = 0.5, seed: int = 0, micro_batch: int = 0, rank: int = 0,
                 num_ranks: int = 1, stages: list | None = None, edit_changed_weight: float = 1.0):
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
        if global_batch % num_ranks:
            raise ValueError(f"global batch {global_batch} is not divisible by {num_ranks} data-parallel ranks")
        self.share = global_batch // num_ranks
        self.micro_batch = micro_batch or self.share
        if self.share % self.micro_batch:
            raise ValueError(f"micro-batch {self.micro_batch} does not divide the per-rank share {self.share}")
        self.world, self.autoencoder, self.tokenize = world, autoencoder, tokenize
        self.global_batch, self.rank, self.num_ranks = global_batch, rank, num_ranks
        self.tasks = [t for t in TASKS if weights.get(t, 0.0) > 0]
        if not self.tasks:
            raise ValueError(f"no task has a positive weight: {weights}")
        w = np.array([weights[t] for t in self.tasks], dtype=np.float64)
        self.probs = w / w.sum()
        self.caption_dropout, self.keyframe_cond_prob, self.seed = caption_dropout, keyframe_cond_prob, seed
        self.edit_changed_weight = float(edit_changed_weight)
        self.streams = {t: IndexStream(world_size, seed, TASKS.index(t)) for t in self.tasks}
        self.stages = list(stages) if stages else None
        self._worlds = {world.size: world}
        self.step = 0
        self._pending: tuple[threading.Thread, dict] | None = None     # the next step, being built (``prefetch``)
        self._taken: dict | None = None                                 # the state of the steps taken meanwhile

    # --- the plan -------------------------------------------------------------------------------
    def _task_at(self, step: int) -> str:
        u = np.random.default_rng([self.seed, 101, step]).random()
        return self.tasks[int(np.searchsorted(np.cumsum(self.probs), u, side="right").clip(0, len(self.tasks) - 1))]

    def _bucket_at(self, step: int) -> tuple[ShapesWorld, tuple[int, int] | None]:
        """The world (scene size) and canvas (h, w) of the step: the world's own square without stages, else one
        bucket of the stage in force, drawn uniformly by (seed, step)."""
        if not self.stages:
            return self.world, None
        from difftrain.data.curriculum import stage_at
        buckets = stage_at(self.stages, step).buckets
        b = buckets[int(np.random.default_rng([self.seed, 303, step]).integers(len(buckets)))]
        side = min(b.h, b.w)
        if side not in self._worlds:
            self._worlds[side] = self.world.with_size(side)
        return self._worlds[side], (None if b.h == b.w == side else (b.h, b.w))

    def _example_rng(self, step: int, slot: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 202, step, slot])

    def __iter__(self) -> "ShapesLoader":
        return self

    def prefetch(self) -> None:
        """Start building the next step's micro-batches in a thread; ``__next__`` takes them. The trainer calls this
        as its backward pass starts: autograd runs without the GIL, so rendering overlaps it. The batches are those
        ``__next__`` would build; ``state_dict`` goes on describing the steps taken until they are taken."""
        if self._pending is not None:
            return
        self._taken = self.state_dict()
        box: dict = {}

        def build() -> None:
            try:
                box["batches"] = self._next_step()
            except BaseException as e:          # raised where the step is taken
                box["error"] = e

        thread = threading.Thread(target=build, name="difftrain-shapes-prefetch", daemon=True)
        self._pending = (thread, box)
        thread.start()

    def _take_pending(self) -> list[Batch] | None:
        if self._pending is None:
            return None
        thread, box = self._pending
        thread.join()
        self._pending, self._taken = None, None
        if "error" in box:
            raise box["error"]
        return box["batches"]

    def __next__(self) -> list[Batch]:
        batches = self._take_pending()
        return batches if batches is not None else self._next_step()

    def _next_step(self) -> list[Batch]:
        step, task = self.step, self._task_at(self.step)
        indices = self.streams[task].take(self.global_batch)   # every rank advances the same global plan
        self.step += 1
        whole = self.micro_batch == self.global_batch       # one micro-batch is the global batch: tokenized once
        tokens = self._global_tokens(step, task, indices, quiet=not whole)
        world, canvas = self._bucket_at(step)
        lo = self.rank * self.share
        out = []
        for m in range(lo, lo + self.share, self.micro_batch):
            slots = range(m, m + self.micro_batch)
            batch = self._build(task, [indices[s] for s in slots], [self._example_rng(step, s) for s in slots],
                                [step * self.global_batch + s for s in slots], world, canvas,
                                tokens if whole else None)
            if not whole:
                batch.tokens = {k: pad_tokens({k: v}, tokens[k].shape[1])[k] for k, v in batch.tokens.items()}
            out.append(batch)
        return out

    def _global_tokens(self, step: int, task: str, indices: list[int], quiet: bool) -> dict[str, Tensor]:
        """The whole global batch's prompts, tokenized. Every micro-batch is padded to their lengths, so a
        sample sees the same (attended) padding however the global batch is split over ranks and
        micro-batches; prompts only, nothing is rendered (``quiet``: the micro-batches' own tokenization warns)."""
        prompts = []
        for slot, index in enumerate(indices):
            _, dropped = self._draws(task, self._example_rng(step, slot))
            prompts.append("" if dropped else self.world.prompt(task, index))
        if not quiet:
            return self.tokenize(prompts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.tokenize(prompts)

    # --- materialising examples -----------------------------------------------------------------
    def _draws(self, task: str, rng: np.random.Generator) -> tuple[list[bool] | None, bool]:
        """One example's perturbations, in a fixed order: which keyframes are targets, then caption dropout."""
        targets = self._keyframe_targets(self.world.frames, rng) if task == "keyframes" else None
        return targets, bool(rng.random() < self.caption_dropout)

    def _build(self, task: str, indices: list[int], rngs: list[np.random.Generator], sample_ids: list[int],
               world: ShapesWorld | None = None, canvas: tuple[int, int] | None = None,
               tokens: dict[str, Tensor] | None = None) -> Batch:
        draws = [self._draws(task, rng) for rng in rngs]
        targets = [t for t, _ in draws] if task == "keyframes" else None
        dropped = [d for _, d in draws]
        return make_batch(world or self.world, self.autoencoder, self.tokenize, task, indices, targets, dropped,
                          sample_ids, canvas, tokens, self.edit_changed_weight)

    def _keyframe_targets(self, k: int, rng: np.random.Generator) -> list[bool]:
        """All frames are targets, or (with keyframe_cond_prob) a proper subset is given: the first g
        frames half of the time (continuing a sequence), otherwise g frames at random."""
        if rng.random() >= self.keyframe_cond_prob:
            return [True] * k
        g = int(rng.integers(1, k))
        given = set(range(g)) if rng.random() < 0.5 else set(rng.choice(k, size=g, replace=False).tolist())
        return [f not in given for f in range(k)]

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._taken is not None:           # a step is being built ahead: the state is the steps taken
            return {**self._taken, "streams": {t: dict(s) for t, s in self._taken["streams"].items()}}
        return {"kind": "shapes", "step": self.step, "global_batch": self.global_batch,
                "streams": {t: s.state_dict() for t, s in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None:         # a step built ahead of the state being loaded is dropped
            self._pending[0].join()
            self._pending, self._taken = None, None
        if state.get("kind", "shapes") != "shapes":
            raise ValueError("the checkpoint's loader state is a latent store's (data.source = 'store'); resume "
                             "with the same data.source")
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(f"loader state was saved with global batch {state['global_batch']}, "
                             f"this run has {self.global_batch}: the data order would differ")
        self.step = int(state["step"])
        for t, s in state["streams"].items():
            if t in self.streams:
                self.streams[t].load_state_dict(s)
