"""Preference pairs for Diffusion-DPO: the pairs file, its images encoded once, and the loader.

The pairs file (Parquet, written by ``difftrain pairs``) has one row per (winner, loser) pair of candidates of
one prompt: ``PAIR_COLUMNS``. Image paths are relative to the file's folder (or absolute). Before the first
step the images are encoded once with the run's autoencoder into ``PAIRS.encoded/`` (a safetensors file of
latents per group of pairs with one task and one image size, and ``index.json``), under a cache key of the
pairs file's content and the autoencoder's settings: a changed file or autoencoder re-encodes, never mixes.

The loader serves, per optimizer step, ``global_pairs`` pairs of one group (drawn per step from (seed, step),
weighted by the groups' sizes), each group read in a fresh permutation every epoch (seeded by (seed, group,
epoch)); data rank r of N takes pairs [r P/N, (r+1) P/N) of the step, so a pair never splits across ranks, in
micro-batches of ``micro_pairs``. A batch holds the winners then their losers (``Batch.pairs``), both with the
pair's id as sample id: the objective draws one t and one noise for both. Its state (step and the groups'
cursors) is in the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from difftrain.data.batch import Batch, assemble
from difftrain.errors import UserError
from difftrain.models.text import pad_tokens

PAIR_COLUMNS = {"pair_id": "int64", "prompt_id": "string", "prompt": "string", "task": "string", "winner": "string",
                "loser": "string", "winner_image": "string", "loser_image": "string", "source_image": "string",
                "winner_seed": "int64", "loser_seed": "int64", "agreement": "double", "raters": "int64",
                "split": "string"}
PAIR_TASKS = ("t2i", "edit")
ENCODED_FORMAT = "difftrain-pairs-encoded-1"

Tokenize = Callable[[list[str]], dict[str, Tensor]]


def read_table(p: Path, columns: list[str], what: str):
    """A Parquet file as an Arrow table with ``columns`` present; a clear error naming the file otherwise."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
        raise UserError(f"{p}: not a Parquet file ({e.__class__.__name__}: {e})") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise UserError(f"{p}: missing column(s) {missing}; {what} has {columns}")
    return table


def read_pairs(path: str | Path) -> list[dict]:
    """The rows of a pairs file, checked: every column, known tasks and splits, distinct pair ids, a source
    image for every edit, winner and loser different. Errors name the file, the row and the column."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"dpo.pairs = {str(path)!r}: no such file (write one with 'difftrain pairs')")
    table = read_table(p, list(PAIR_COLUMNS), "a pairs file")
    rows = table.to_pylist()                       # extra columns (a source's model names) are kept
    seen: set[int] = set()
    for i, r in enumerate(rows):
        where = f"{p}: row {i} (pair_id {r['pair_id']})"
        if r["task"] not in PAIR_TASKS:
            raise UserError(f"{where}: task {r['task']!r}, expected one of {PAIR_TASKS}")
        if r["split"] not in ("train", "validation"):
            raise UserError(f"{where}: split {r['split']!r}, expected 'train' or 'validation'")
        if r["pair_id"] in seen:
            raise UserError(f"{where}: pair_id repeated (pair ids are unique)")
        seen.add(r["pair_id"])
        if r["winner"] == r["loser"]:
            raise UserError(f"{where}: winner and loser are the same candidate {r['winner']!r}")
        if r["task"] == "edit" and not r["source_image"]:
            raise UserError(f"{where}: an edit pair needs source_image")
        for col in ("winner_image", "loser_image") + (("source_image",) if r["task"] == "edit" else ()):
            if not r[col]:
                raise UserError(f"{where}: {col} is empty")
    return rows


def _resolve(base: Path, rel: str) -> Path:
    return Path(rel) if os.path.isabs(rel) else base / rel


def _load_rgb(path: Path, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise UserError(f"{where}: image {path} not found")
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{where}: cannot read {path} as an image ({e.__class__.__name__}: {e})") from None


def cache_key(pairs_path: Path, autoencoder_settings: dict) -> str:
    h = hashlib.sha256(pairs_path.read_bytes())
    h.update(json.dumps(autoencoder_settings, sort_keys=True).encode())
    return h.hexdigest()


@dataclass
class Group:
    task: str
    size: tuple[int, int]          # image (h, w) in pixels
    latents: Tensor                # (images, F, C, H, W): winners' and losers' frames ([target] or [target, source])
    train: list[int]               # indices into ``EncodedPairs.rows`` of the group's training pairs
    validation: list[int]


class EncodedPairs:
    """The pairs file with its images encoded (``encode`` or the cached ``PAIRS.encoded/``)."""

    def __init__(self, rows: list[dict], groups: list[Group], image_row: dict[int, tuple[int, int, int]], key: str):
        self.rows, self.groups, self.key = rows, groups, key
        self.image_row = image_row          # row index -> (group, winner's latent row, loser's latent row)

    @property
    def train_pairs(self) -> int:
        return sum(len(g.train) for g in self.groups)

    @classmethod
    def load_or_encode(cls, path: str | Path, autoencoder, settings: dict, batch: int = 32) -> "EncodedPairs":
        """The cached encoding when its key matches (the pairs file's content and ``settings``), else encode
        now and cache it (written to a temporary folder, then renamed: a killed encode leaves no cache)."""
        from safetensors.torch import load_file, save_file

        p = Path(path)
        rows = read_pairs(p)
        key = cache_key(p, settings)
        out = Path(f"{p}.encoded")
        index_path = out / "index.json"
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                index = {}
            if index.get("format") == ENCODED_FORMAT and index.get("key") == key:
                tensors = load_file(str(out / "latents.safetensors"))
                return cls._from_index(rows, index, tensors, key)
        enc = cls.encode(rows, p.parent, autoencoder, batch, str(p), key)
        tmp = Path(f"{out}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({f"g{i}": g.latents.contiguous() for i, g in enumerate(enc.groups)}, str(tmp / "latents.safetensors"))
        index = {"format": ENCODED_FORMAT, "key": key, "settings": settings,
                 "groups": [{"task": g.task, "size": list(g.size), "train": g.train, "validation": g.validation}
                            for g in enc.groups],
                 "image_row": {str(k): list(v) for k, v in enc.image_row.items()}}
        (tmp / "index.json").write_text(json.dumps(index))
        if out.exists():
            import shutil
            shutil.rmtree(out)
        tmp.rename(out)
        return enc

    @classmethod
    def _from_index(cls, rows, index, tensors, key) -> "EncodedPairs":
        groups = [Group(g["task"], tuple(g["size"]), tensors[f"g{i}"], g["train"], g["validation"])
                  for i, g in enumerate(index["groups"])]
        return cls(rows, groups, {int(k): tuple(v) for k, v in index["image_row"].items()}, key)

    @classmethod
    def encode(cls, rows: list[dict], base: Path, autoencoder, batch: int, name: str, key: str) -> "EncodedPairs":
        """Read every pair's images (winner, loser, and the edit's source) and encode them, grouped by task and
        image size; a pair whose winner and loser differ in size is refused."""
        frames_by_group: dict[tuple, list[np.ndarray]] = {}
        members: dict[tuple, tuple[list[int], list[int]]] = {}
        image_row: dict[int, tuple[tuple, int, int]] = {}
        for i, r in enumerate(rows):
            where = f"{name}: row {i} (pair_id {r['pair_id']})"
            w = _load_rgb(_resolve(base, r["winner_image"]), where)
            lo = _load_rgb(_resolve(base, r["loser_image"]), where)
            if w.shape != lo.shape:
                raise UserError(f"{where}: winner is {w.shape[1]}x{w.shape[0]}, loser {lo.shape[1]}x{lo.shape[0]}; "
                                "the two images of a pair have one size")
            seqs = [w[None], lo[None]]
            if r["task"] == "edit":
                src = _load_rgb(_resolve(base, r["source_image"]), where)
                if src.shape != w.shape:
                    raise UserError(f"{where}: source image is {src.shape[1]}x{src.shape[0]}, the candidates "
                                    f"{w.shape[1]}x{w.shape[0]}")
                seqs = [np.stack([w, src]), np.stack([lo, src])]        # target at index 0, reference at 1
            gk = (r["task"], w.shape[0], w.shape[1])
            frames = frames_by_group.setdefault(gk, [])
            image_row[i] = (gk, len(frames), len(frames) + 1)
            frames.extend(seqs)
            members.setdefault(gk, ([], []))[0 if r["split"] == "train" else 1].append(i)
        keys = sorted(frames_by_group)
        groups, weight = [], next(autoencoder.parameters(), None)
        device = weight.device if weight is not None else "cpu"
        for gk in keys:
            arr = np.stack(frames_by_group[gk])                              # (N, F, H, W, 3)
            px = torch.from_numpy(arr).float().div(127.5).sub(1.0).movedim(-1, -3)
            N, F = px.shape[:2]
            flat, lat = px.flatten(0, 1), []
            with torch.no_grad():
                for s in range(0, len(flat), batch):
                    lat.append(autoencoder.encode(flat[s:s + batch].to(device)).float().cpu())
            lat_t = torch.cat(lat)
            groups.append(Group(gk[0], (gk[1], gk[2]), lat_t.reshape(N, F, *lat_t.shape[1:]), *members[gk]))
        gid = {gk: k for k, gk in enumerate(keys)}
        return cls(rows, groups, {i: (gid[gk], a, b) for i, (gk, a, b) in image_row.items()}, key)

    def batch(self, rows: list[int], tokenize: Tokenize, text_length: dict[str, int] | None = None) -> Batch:
        """Pairs ``rows`` (indices into ``self.rows``, all of one group) as one batch: winners, then losers."""
        g = {self.image_row[i][0] for i in rows}
        if len(g) != 1:
            raise ValueError(f"a pair batch is one group, got groups {sorted(g)}")
        group = self.groups[g.pop()]
        idx = [self.image_row[i][1] for i in rows] + [self.image_row[i][2] for i in rows]
        lat = group.latents[idx]
        F = lat.shape[1]
        prompts = [self.rows[i]["prompt"] for i in rows] * 2
        tokens = tokenize(prompts)
        if text_length:
            tokens = {k: pad_tokens({k: v}, text_length[k])[k] for k, v in tokens.items()}
        targets = torch.tensor([[True] + [False] * (F - 1)] * len(idx))
        meta = [{"pair_id": self.rows[i]["pair_id"], "side": side} for side in ("winner", "loser") for i in rows]
        b = assemble(lat, list(range(F)), targets, tokens, prompts, group.task, meta)
        b.sample_ids = [int(self.rows[i]["pair_id"]) for i in rows] * 2
        b.pairs = len(rows)
        return b


class PairsLoader:
    """The training pairs, per optimizer step (see the module docstring)."""

    def __init__(self, pairs: EncodedPairs, tokenize: Tokenize, global_pairs: int, micro_pairs: int, rank: int,
                 ranks: int, seed: int):
        if global_pairs % ranks:
            raise UserError(f"train.global_batch = {global_pairs} pairs do not split over {ranks} data-parallel "
                            "ranks (a pair never splits: the global batch must be a multiple of the rank count)")
        share = global_pairs // ranks
        micro = micro_pairs or share
        if share % micro:
            raise UserError(f"train.micro_batch = {micro_pairs} pairs must divide each rank's {share} pairs")
        for g in pairs.groups:
            if 0 < len(g.train) < global_pairs:
                raise UserError(f"the pairs file has {len(g.train)} training pairs of task {g.task!r} at "
                                f"{g.size[1]}x{g.size[0]}, fewer than train.global_batch = {global_pairs} pairs a "
                                "step: rank more candidates, or lower train.global_batch")
        if pairs.train_pairs == 0:
            raise UserError("the pairs file has no training pairs (split = 'train')")
        self.pairs, self.tokenize = pairs, tokenize
        self.global_pairs, self.micro, self.rank, self.share, self.seed = global_pairs, micro, rank, share, seed
        self.sizes = np.array([len(g.train) for g in pairs.groups], dtype=np.float64)
        self.step = 0
        self.cursor = [0] * len(pairs.groups)       # pairs of each group served so far (over epochs)
        self._perm: dict[tuple[int, int], np.ndarray] = {}

    def __iter__(self) -> "PairsLoader":
        return self

    def _group_at(self, step: int) -> int:
        rng = np.random.default_rng([self.seed, 505, step])
        return int(rng.choice(len(self.sizes), p=self.sizes / self.sizes.sum()))

    def _permutation(self, g: int, epoch: int) -> np.ndarray:
        if (g, epoch) not in self._perm:
            self._perm = {k: v for k, v in self._perm.items() if k[1] >= epoch - 1}
            self._perm[(g, epoch)] = np.random.default_rng([self.seed, 606, g, epoch]).permutation(
                len(self.pairs.groups[g].train))
        return self._perm[(g, epoch)]

    def _take(self, g: int, n: int) -> list[int]:
        train, out = self.pairs.groups[g].train, []
        while len(out) < n:
            epoch, pos = divmod(self.cursor[g], len(train))
            k = min(n - len(out), len(train) - pos)
            out.extend(train[j] for j in self._permutation(g, epoch)[pos:pos + k])
            self.cursor[g] += k
        return out

    def __next__(self) -> list[Batch]:
        g = self._group_at(self.step)
        rows = self._take(g, self.global_pairs)
        self.step += 1
        lengths = _lengths(self.tokenize, [self.pairs.rows[i]["prompt"] for i in rows])
        mine = rows[self.rank * self.share:(self.rank + 1) * self.share]
        return [self.pairs.batch(mine[m:m + self.micro], self.tokenize, lengths)
                for m in range(0, self.share, self.micro)]

    def validation_batches(self, ranks: int) -> list[tuple[Batch, bool]]:
        """This rank's validation batches, round-robin over ranks, each with whether it counts: every rank gets
        the same number (a rank with none left reruns the first batch, not counted), so the forwards of a
        sharded model stay in step."""
        chunks = [g.validation[s:s + self.micro] for g in self.pairs.groups for s in range(0, len(g.validation),
                                                                                            self.micro)]
        if not chunks:
            return []
        per_rank = -(-len(chunks) // ranks)
        mine = [(c, True) for c in chunks[self.rank::ranks]]
        mine += [(chunks[0], False)] * (per_rank - len(mine))
        return [(self.pairs.batch(c, self.tokenize, _lengths(self.tokenize, [self.pairs.rows[i]["prompt"]
                                                                           for i in c])), counts)
                for c, counts in mine]

    def state_dict(self) -> dict:
        return {"kind": "pairs", "step": self.step, "cursor": list(self.cursor), "global_pairs": self.global_pairs,
                "key": self.pairs.key}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "pairs":
            raise ValueError("the checkpoint's loader state is not a pairs loader's: resume a DPO run with "
                             "'difftrain dpo'")
        if state["key"] != self.pairs.key:
            raise ValueError("the checkpoint was trained on another pairs file (or another encoding of it): the "
                             "data order would differ")
        if int(state["global_pairs"]) != self.global_pairs:
            raise ValueError(f"loader state was saved with {state['global_pairs']} pairs a step, this run has "
                             f"{self.global_pairs}")
        self.step, self.cursor = int(state["step"]), [int(c) for c in state["cursor"]]


def _lengths(tokenize: Tokenize, prompts: list[str]) -> dict[str, int]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: v.shape[1] for k, v in tokenize(prompts).items()}
