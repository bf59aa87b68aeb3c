"""Preference pairs for Diffusion-DPO: the pairs file, its images and prompts encoded once, and the loader.

The pairs file (Parquet, written by ``difftrain pairs``) has one row per (winner, loser) pair of candidates of
one prompt: ``PAIR_COLUMNS``. Image paths are relative to the file's folder (or absolute). Before the first
step everything the frozen encoders compute is computed once, into ``PAIRS.encoded/``, under a cache key of the
pairs file's content and the store's encoder identity (``data.store.encoder_identity``: the autoencoder, the
frozen text encoders and the text rule) and ``data.latent_dtype``: a changed file, encoder or rule re-encodes,
never mixes. It holds
- ``g<k>.npy``: the latents of group k (one task and one image size), one row per distinct candidate image (a
  candidate is in several pairs; an edit's row is [target, source]), packed in 2x2 patches in token order as
  the latent store keeps them, bf16 as its raw 16-bit pattern or fp32;
- with frozen text encoders (``text.kind = 'hf'``), the states of every distinct prompt at their true length
  under the text rule (``txt.bin`` with ``txt_offsets.npy``, ``pooled.npy``): T5 and CLIP never run while
  training; encoders trained with the model (``'words'``) tokenize the prompt each step, as they must;
- ``pairs.npz``: per pair, its id, split, group, winner's and loser's latent rows and prompt; ``index.json``.
It is written to a temporary folder and renamed (a killed encode leaves no cache), and read memory-mapped: a
step reads its own pairs' rows, so a rank's memory does not grow with the file (``bench/pairs_scale.py``).

The loader is ``data/store/pairs_loader.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from difftrain.data.store import tables as st
from difftrain.data.batch import Batch, assemble_packed
from difftrain.errors import UserError
from difftrain.models.text import TextEmbedding, pad_tokens, text_length
from difftrain.tokens import patchify

PAIR_COLUMNS = {"pair_id": "int64", "prompt_id": "string", "prompt": "string", "task": "string", "winner": "string",
                "loser": "string", "winner_image": "string", "loser_image": "string", "source_image": "string",
                "winner_seed": "int64", "loser_seed": "int64", "agreement": "double", "raters": "int64",
                "split": "string"}
PAIR_TASKS = ("t2i", "edit")
SPLITS = ("train", "validation")
ENCODED_FORMAT = "difftrain-pairs-encoded-2"

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


def _strings(table, col: str) -> np.ndarray:
    """A string column as an object array, nulls as '' (the encoding pass, on rank 0 only, walks the rows)."""
    a = table[col].to_numpy(zero_copy_only=False)
    return np.where(a == None, "", a).astype(object)  # noqa: E711 - elementwise test for nulls


def _is(values) -> np.ndarray:
    """An Arrow boolean result as a numpy mask, null as False."""
    import pyarrow.compute as pc

    return pc.fill_null(values, False).to_numpy(zero_copy_only=False)


def read_pairs(path: str | Path):
    """The pairs file as an Arrow table, checked column-wise with Arrow compute (no Python object a row, so 10^6
    rows take about a second on every rank): every column, known tasks and splits, distinct pair ids, winner
    and loser different, a source image for every edit, no empty image path. The error names the file, the
    first bad row and the column. Extra columns (a source's model names) are kept."""
    import pyarrow as pa
    import pyarrow.compute as pc

    p = Path(path)
    if not p.is_file():
        raise UserError(f"dpo.pairs = {str(path)!r}: no such file (write one with 'difftrain pairs')")
    table = read_table(p, list(PAIR_COLUMNS), "a pairs file")
    if table["pair_id"].null_count:
        bad = int(np.flatnonzero(_is(pc.is_null(table["pair_id"])))[0])
        raise UserError(f"{p}: row {bad}: pair_id is empty")
    ids = table["pair_id"].to_numpy().astype(np.int64)
    order = np.argsort(ids, kind="stable")
    repeated = np.zeros(len(ids), bool)
    repeated[order[1:][ids[order][1:] == ids[order][:-1]]] = True

    def empty(col):
        return _is(pc.equal(pc.fill_null(table[col], ""), ""))

    def at(col, i):
        return table[col][i].as_py()

    checks = [
        (~_is(pc.is_in(table["task"], value_set=pa.array(PAIR_TASKS))),
         lambda i: f"task {at('task', i)!r}, expected one of {PAIR_TASKS}"),
        (~_is(pc.is_in(table["split"], value_set=pa.array(SPLITS))),
         lambda i: f"split {at('split', i)!r}, expected 'train' or 'validation'"),
        (repeated, lambda i: "pair_id repeated (pair ids are unique)"),
        (_is(pc.equal(table["winner"], table["loser"])),
         lambda i: f"winner and loser are the same candidate {at('winner', i)!r}"),
        (_is(pc.equal(table["task"], "edit")) & empty("source_image"), lambda i: "an edit pair needs source_image"),
        (empty("winner_image"), lambda i: "winner_image is empty"),
        (empty("loser_image"), lambda i: "loser_image is empty"),
    ]
    first = min((int(np.argmax(m)) for m, _ in checks if m.any()), default=None)
    if first is not None:
        message = next(say for m, say in checks if m[first])
        raise UserError(f"{p}: row {first} (pair_id {ids[first]}): {message(first)}")
    return table


def _resolve(base: Path, rel: str) -> str:
    return rel if os.path.isabs(rel) else str(base / rel)


def _image_size(path: str, where: str, sizes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(h, w) of an image from its header (the pixels are read when encoding), cached per path."""
    from PIL import Image, UnidentifiedImageError

    if path not in sizes:
        if not os.path.isfile(path):
            raise UserError(f"{where}: image {path} not found")
        try:
            with Image.open(path) as im:
                sizes[path] = (im.height, im.width)
        except (UnidentifiedImageError, OSError) as e:
            raise UserError(f"{where}: cannot read {path} as an image ({e.__class__.__name__}: {e})") from None
    return sizes[path]


def _load_rgb(path: str, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{where}: cannot read {path} as an image ({e.__class__.__name__}: {e})") from None


def cache_key(pairs_path: Path, settings: dict) -> str:
    h = hashlib.sha256()
    with open(pairs_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


@dataclass
class Group:
    task: str
    size: tuple[int, int]          # image (h, w) in pixels
    latents: np.ndarray            # (images, F, L, C*4) bits, memory-mapped: [target] or [target, source] packed
    latent_hw: tuple[int, int]     # the latent's (h, w)
    train: np.ndarray              # indices of the group's training pairs
    validation: np.ndarray


@dataclass
class PromptStates:
    """Frozen encoders' states of every distinct prompt at its true length (memory-mapped)."""
    txt: np.ndarray                # (total positions, D) bits
    offsets: np.ndarray            # (prompts + 1,) int64: prompt p's positions are txt[offsets[p]:offsets[p+1]]
    pooled: np.ndarray             # (prompts, P) bits
    max_tokens: int
    padding: str


class _NpyWriter:
    """An ``.npy`` file of a known shape written front to back in chunks (plain writes: the encoded latents
    stay out of the encoding process's memory, unlike a memory-mapped file's dirty pages)."""

    def __init__(self, path: Path, dtype, shape: tuple[int, ...]):
        self.f, self.dtype, self.shape, self.rows = open(path, "wb"), np.dtype(dtype), shape, 0
        np.lib.format.write_array_header_1_0(self.f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": shape})

    def write(self, a: np.ndarray) -> None:
        if a.dtype != self.dtype or a.shape[1:] != self.shape[1:]:
            raise ValueError(f"chunk {a.dtype}{a.shape} does not fit {self.dtype}{self.shape}")
        self.f.write(np.ascontiguousarray(a).tobytes())
        self.rows += a.shape[0]

    def close(self) -> None:
        self.f.close()
        if self.rows != self.shape[0]:
            raise ValueError(f"{self.f.name}: wrote {self.rows} rows of {self.shape[0]}")


def _bits_dtype(dtype: str):
    if dtype not in ("bf16", "fp32"):
        raise UserError(f"data.latent_dtype = {dtype!r}: expected 'bf16' or 'fp32'")
    return np.uint16 if dtype == "bf16" else np.uint32


class EncodedPairs:
    """The pairs file with its images (and, for frozen text encoders, its prompts) encoded: ``load_or_encode``."""

    def __init__(self, folder: Path, key: str):
        index = json.loads((folder / "index.json").read_text())
        self.folder, self.key, self.dtype = folder, key, index["dtype"]
        arrays = np.load(folder / "pairs.npz")
        self.pair_id, self.group, self.winner, self.loser, self.prompt, train = (
            arrays[k] for k in ("pair_id", "group", "winner", "loser", "prompt", "train"))
        self.prompts: list[str] = json.loads((folder / "prompts.json").read_text())
        self.groups = []
        for k, g in enumerate(index["groups"]):
            members = np.flatnonzero(self.group == k)
            self.groups.append(Group(g["task"], tuple(g["size"]), np.load(folder / f"g{k}.npy", mmap_mode="r"),
                                     tuple(g["latent_hw"]), members[train[members]], members[~train[members]]))
        self.text = None
        t = index.get("text")
        if t is not None:
            bits = _bits_dtype(self.dtype)
            offsets = np.load(folder / "txt_offsets.npy")
            txt = (np.memmap(folder / "txt.bin", dtype=bits, mode="r", shape=(int(offsets[-1]), t["dim"]))
                   if offsets[-1] else np.zeros((0, t["dim"]), bits))
            self.text = PromptStates(txt, offsets, np.load(folder / "pooled.npy", mmap_mode="r"), t["max_tokens"],
                                     t["padding"])

    @property
    def train_pairs(self) -> int:
        return sum(len(g.train) for g in self.groups)

    @classmethod
    def load_or_encode(cls, path: str | Path, autoencoder, settings: dict, text_encoder=None,
                       batch: int = 32) -> "EncodedPairs":
        """The cached encoding when its key matches (the pairs file's content and ``settings``: the encoders'
        identity and the latent dtype), else encode now and cache it. ``text_encoder`` (frozen encoders only)
        encodes the prompts too; for an encoder trained with the model pass None."""
        p = Path(path)
        if not p.is_file():
            raise UserError(f"dpo.pairs = {str(path)!r}: no such file (write one with 'difftrain pairs')")
        key = cache_key(p, settings)
        out = Path(f"{p}.encoded")
        index_path = out / "index.json"
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                index = {}
            if index.get("format") == ENCODED_FORMAT and index.get("key") == key:
                return cls(out, key)        # this very file was checked when it was encoded: not read again
        table = read_pairs(p)
        for stale in out.parent.glob(f"{out.name}.tmp*"):        # a killed encode's leftovers (one writer: rank 0)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(f"{out}.tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            index = _encode_into(tmp, table, p.parent, autoencoder, text_encoder, settings, batch, str(p))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        index.update(format=ENCODED_FORMAT, key=key, settings=settings)
        (tmp / "index.json").write_text(json.dumps(index))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return cls(out, key)

    # ---- batches ----------------------------------------------------------------------------------
    def text_length(self, rows, tokenize: Tokenize | None):
        """The text length of a step holding pairs ``rows``: with cached states, the rule's length for their
        longest prompt; else each token key's length for them (what ``tokenize`` pads them to)."""
        prompts = np.unique(self.prompt[np.asarray(rows, np.int64)])
        if self.text is not None:
            longest = int((self.text.offsets[prompts + 1] - self.text.offsets[prompts]).max())
            return max(longest, text_length(longest, self.text.max_tokens, self.text.padding))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {k: v.shape[1] for k, v in tokenize([self.prompts[i] for i in prompts]).items()}

    def batch(self, rows, tokenize: Tokenize | None, length=None) -> Batch:
        """Pairs ``rows`` (indices of the file's rows, all of one group) as one batch: winners, then losers; text
        padded to ``length`` (``text_length`` of the step)."""
        rows = np.asarray(rows, np.int64)
        g = np.unique(self.group[rows])
        if len(g) != 1:
            raise ValueError(f"a pair batch is one group, got groups {g.tolist()}")
        group = self.groups[int(g[0])]
        idx = np.concatenate([self.winner[rows], self.loser[rows]])
        lat = st.from_bits(group.latents[idx], self.dtype, keep=True)       # (2P, F, L, C*4), bf16 kept
        F = lat.shape[1]
        prompt_idx = np.concatenate([self.prompt[rows]] * 2)
        prompts = [self.prompts[i] for i in prompt_idx]
        length = self.text_length(rows, tokenize) if length is None else length
        tokens = {}
        if self.text is None:
            tokens = {k: pad_tokens({k: v}, length[k])[k] for k, v in tokenize(prompts).items()}
        targets = torch.tensor([[True] + [False] * (F - 1)] * len(idx))
        ids = self.pair_id[rows].tolist()
        meta = [{"pair_id": i, "side": side} for side in ("winner", "loser") for i in ids]
        b = assemble_packed(lat, *group.latent_hw, list(range(F)), targets, tokens, prompts, group.task, meta)
        b.sample_ids = ids * 2
        b.pairs = len(rows)
        if self.text is not None:
            b.text = self._embeddings(prompt_idx, length)
        return b

    def _embeddings(self, prompt_idx: np.ndarray, length: int) -> TextEmbedding:
        s = self.text
        txts, pools, masks = [], [], []
        for p in prompt_idx.tolist():
            a, e = int(s.offsets[p]), int(s.offsets[p + 1])
            t = st.from_bits(np.array(s.txt[a:e]), self.dtype)
            txts.append(torch.cat([t, t.new_zeros(length - t.shape[0], t.shape[1])]) if length > t.shape[0]
                        else t[:length])
            masks.append(torch.arange(length) < t.shape[0])
            pools.append(st.from_bits(np.array(s.pooled[p]), self.dtype))
        return TextEmbedding(torch.stack(txts), torch.stack(pools), torch.stack(masks))


def _encode_into(folder: Path, table, base: Path, autoencoder, text_encoder, settings: dict, batch: int,
                 name: str) -> dict:
    """Encode the pairs file into ``folder`` (see the module docstring); the index's content, without its key.
    Pass 1 reads image headers only (sizes, the distinct images of each group); pass 2 encodes each distinct
    image once, ``batch`` at a time, into a memory-mapped file: memory holds a batch, not the file."""
    import logging

    log = logging.getLogger("difftrain")
    dtype = settings.get("latent_dtype", "fp32")
    bits = _bits_dtype(dtype)
    n = table.num_rows
    ids = table["pair_id"].to_numpy(zero_copy_only=False)
    task = _strings(table, "task")
    cols = [_strings(table, c) for c in ("winner_image", "loser_image", "source_image")]
    sizes: dict[str, tuple[int, int]] = {}
    groups: dict[tuple, dict] = {}
    row_group = np.empty(n, np.int32)
    sides = np.empty((2, n), np.int64)
    for i in range(n):
        where = f"{name}: row {i} (pair_id {ids[i]})"
        w, lo = _resolve(base, cols[0][i]), _resolve(base, cols[1][i])
        (h, wd), hl = _image_size(w, where, sizes), _image_size(lo, where, sizes)
        if (h, wd) != hl:
            raise UserError(f"{where}: winner is {wd}x{h}, loser {hl[1]}x{hl[0]}; the two images of a pair have one "
                            "size")
        src = _resolve(base, cols[2][i]) if task[i] == "edit" else ""
        if src and (hs := _image_size(src, where, sizes)) != (h, wd):
            raise UserError(f"{where}: source image is {hs[1]}x{hs[0]}, the candidates {wd}x{h}")
        gk = (task[i], h, wd)
        g = groups.setdefault(gk, {"id": len(groups), "rows": {}, "images": []})
        row_group[i] = g["id"]
        for s, path in enumerate((w, lo)):
            r = g["rows"].setdefault((path, src), len(g["images"]))
            if r == len(g["images"]):
                g["images"].append((path, src, i))
            sides[s, i] = r
    keys = sorted(groups)
    remap = np.empty(len(keys), np.int32)
    for k, gk in enumerate(keys):
        remap[groups[gk]["id"]] = k
    weight = next(autoencoder.parameters(), None)
    device = weight.device if weight is not None else "cpu"
    index_groups = []
    for k, gk in enumerate(keys):
        images, mm, hw = groups[gk]["images"], None, None
        log.info("pairs %s: encoding %d images of group %s", name, len(images), gk)
        for s in range(0, len(images), batch):
            frames = []
            for path, src, row in images[s:s + batch]:
                where = f"{name}: row {row} (pair_id {ids[row]})"
                frames.append(np.stack([_load_rgb(path, where)] + ([_load_rgb(src, where)] if src else [])))
            px = torch.from_numpy(np.stack(frames)).float().div_(127.5).sub_(1.0).movedim(-1, -3)   # (B, F, 3, H, W)
            B, F = px.shape[:2]
            with torch.no_grad():
                lat = autoencoder.encode(px.flatten(0, 1).to(device)).float().cpu()
            tok = patchify(lat).reshape(B, F, -1, lat.shape[1] * 4)
            if mm is None:
                hw = lat.shape[-2:]
                mm = _NpyWriter(folder / f"g{k}.npy", bits, (len(images),) + tuple(tok.shape[1:]))
            mm.write(st.to_bits(tok, dtype).reshape(tok.shape))
        mm.close()
        index_groups.append({"task": gk[0], "size": [gk[1], gk[2]], "latent_hw": list(hw), "images": len(images)})
    import pyarrow.compute as pc

    coded = pc.dictionary_encode(pc.fill_null(table["prompt"], "")).combine_chunks()    # distinct prompts
    prompts = coded.dictionary.to_pylist()
    np.savez(folder / "pairs.npz", pair_id=np.asarray(ids, np.int64), group=remap[row_group], winner=sides[0],
             loser=sides[1], train=_is(pc.equal(table["split"], "train")),
             prompt=coded.indices.to_numpy(zero_copy_only=False).astype(np.int64))
    (folder / "prompts.json").write_text(json.dumps(prompts))
    text = None
    if text_encoder is not None:
        text = {"dim": text_encoder.dim, "pooled_dim": text_encoder.pooled_dim, "max_tokens": text_encoder.max_tokens,
                "padding": text_encoder.padding}
        log.info("pairs %s: encoding %d prompts with the frozen text encoders", name, len(prompts))
        offsets = np.zeros(len(prompts) + 1, np.int64)
        pooled = _NpyWriter(folder / "pooled.npy", bits, (len(prompts), text["pooled_dim"]))
        with open(folder / "txt.bin", "wb") as f, torch.no_grad():
            for s in range(0, len(prompts), batch):
                emb = text_encoder(text_encoder.tokenize(prompts[s:s + batch]))
                for j in range(emb.txt_BTD.shape[0]):
                    t = int(emb.mask_BT[j].sum())
                    f.write(st.to_bits(emb.txt_BTD[j, :t].float().cpu(), dtype).tobytes())
                    offsets[s + j + 1] = offsets[s + j] + t
                pooled.write(st.to_bits(emb.pooled_BP.float().cpu(), dtype).reshape(emb.pooled_BP.shape))
        pooled.close()
        np.save(folder / "txt_offsets.npy", offsets)
    return {"dtype": dtype, "pairs": n, "groups": index_groups, "text": text}
