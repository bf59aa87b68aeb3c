"""The latent store: encoded training examples on Lance, one table per (stage, bucket, task).

Layout under the store URI (a local path or any URI Lance and fsspec both read: s3://, gs://, ...):

    store.json                                 the manifest: format, tables, their cache keys, vocabulary
    curation.parquet/                          every input row of the last successful prepare, its outcome and reason
    tables/<stage>/<h>x<w>/<task>.lance        Lance datasets

A task fixes the frames per example (t2i 1, edit 2: target then reference, keyframes K), so every latent
column is fixed-shape: ``latents`` (a Lance blob column) holds F x C x h x w values, bf16 kept as its raw
16-bit pattern (Arrow has no bf16) or fp32 as 32-bit patterns, in token order (each frame packed
in 2x2 patches as the model reads it, ``difftrain.tokens.patchify``), so serving a batch is a reshape. Text is kept as the caption
(encoders trained with the model tokenize it when reading) or, for frozen encoders, as embeddings at their
true length (``txt``: T x D values, ``txt_len`` = T; ``pooled``): a 512 x 4096 T5 embedding padded is 8x a
1024^2 latent. Index columns: sample_id, source, key, caption, orig_h, orig_w, crop (top, left, h, w of
the crop box in the resized image), scores (JSON), and ``keep`` (the loss mask: a bit a target token, packed;
empty where every token counts).

Why Lance: random access by row for shuffled reads, versioned atomic commits (a failed prepare never
damages the committed version) and object-store support.

The **cache key** of a table holds the encoder identities, the bucket and the preprocessing settings;
a prepare or a training run whose settings differ from a table's key is refused with the difference.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from difftrain.errors import UserError

if TYPE_CHECKING:      # torch is imported where tensors are converted: prepare's Ray tasks read this module without it
    import torch

os.environ.setdefault("LANCE_LOG", "error")     # Lance's Rust logger warns on every new dataset otherwise

FORMAT = "difftrain-store/1"
TASK_FRAMES_FIXED = {"t2i": 1, "edit": 2}
RESIZE = "lanczos"      # resize filter, part of the cache key


def task_frames(task: str, keyframes: int) -> int:
    return TASK_FRAMES_FIXED.get(task, keyframes)


def table_name(stage: str, bucket: str, task: str) -> str:
    return f"{stage}/{bucket}/{task}"


def table_uri(store: str, name: str) -> str:
    return f"{store.rstrip('/')}/tables/{name}.lance"


# --------------------------------------------------------------------------- encoder identity, cache key

def _path_digest(path: str) -> str:
    """Identity of a model folder: a hash over its config files' contents and its weight files' names and sizes
    (hashing tens of GB of weights at every start would cost minutes)."""
    if not path:
        return ""
    p = Path(path)
    if not p.exists():
        return f"missing:{path}"
    h = hashlib.sha256()
    for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
        if f.is_file():
            rel = str(f.relative_to(p)) if p.is_dir() else f.name
            h.update(rel.encode())
            if f.suffix in (".json", ".txt", ".model"):
                h.update(f.read_bytes())
            else:
                h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def encoder_identity(cfg) -> dict[str, Any]:
    ae, t = cfg.autoencoder, cfg.text
    out: dict[str, Any] = {"autoencoder": {"kind": ae.kind}}
    if ae.kind == "pixel-unshuffle":
        out["autoencoder"]["factor"] = ae.factor
    else:
        out["autoencoder"].update(path_digest=_path_digest(ae.path), scaling=ae.scaling, shift=ae.shift)
    if t.kind == "hf":     # frozen encoders: their embeddings are in the store
        out["text"] = {"kind": "hf", "t5": _path_digest(t.t5_path), "clip": _path_digest(t.clip_path),
                       "max_tokens": t.max_tokens, "dtype": t.dtype, "padding": t.padding}
        if t.precision != "native":      # only then: stores written before the key existed keep their key
            out["text"]["precision"] = t.precision
    else:                  # encoders trained with the model read the caption
        out["text"] = {"kind": "caption"}
    return out


def cache_key(cfg, stage, bucket, task: str) -> dict[str, Any]:
    return {"format": FORMAT, **encoder_identity(cfg), "bucket": [bucket.h, bucket.w], "task": task, "layout": "tokens-2x2",
            "frames": task_frames(task, cfg.data.frames), "crop": stage.crop, "resize": RESIZE,
            "latent_dtype": cfg.data.latent_dtype}


def key_diff(have: dict, want: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two cache keys."""
    out = []
    for k in sorted(set(have) | set(want)):
        a, b = have.get(k, "<absent>"), want.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += key_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: store has {a!r}, this config has {b!r}")
    return out


# --------------------------------------------------------------------------- manifest

def _fs(uri: str):
    import fsspec
    return fsspec.core.url_to_fs(uri)


def read_manifest(store: str) -> dict | None:
    fs, root = _fs(store)
    path = f"{root.rstrip('/')}/store.json"
    if not fs.exists(path):
        return None
    try:
        data = json.loads(fs.cat_file(path).decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{store}/store.json: not a valid store manifest ({e})") from None
    if data.get("format") != FORMAT:
        raise UserError(f"{store}/store.json: format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def write_manifest(store: str, manifest: dict) -> None:
    """Atomic on a local disk (write then rename); object stores replace whole objects anyway."""
    fs, root = _fs(store)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    tmp = f"{root}/.store.json.tmp{os.getpid()}"
    with fs.open(tmp, "wb") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
    fs.mv(tmp, f"{root}/store.json")


def remove_manifest_temps(store: str) -> int:
    """Remove the half-written manifests (``.store.json.tmp<pid>``) of writers killed between write and rename;
    the caller is the store's one writer (``prepare``), so none of them is in use. Returns how many."""
    fs, root = _fs(store)
    root = root.rstrip("/")
    if not fs.exists(root):
        return 0
    temps = [p for p in fs.ls(root, detail=False) if os.path.basename(p.rstrip("/")).startswith(".store.json.tmp")]
    for p in temps:
        fs.rm(p)
    return len(temps)


# --------------------------------------------------------------------------- bits <-> tensors

def to_bits(x: torch.Tensor, dtype: str) -> np.ndarray:
    """Latents as raw integer patterns: bf16 -> uint16, fp32 -> uint32 (flattened). A device tensor (an encoder
    on a GPU) is moved to the host here, explicitly."""
    import torch
    x = x.detach().cpu()
    if dtype == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return x.float().contiguous().numpy().view(np.uint32).reshape(-1)


def from_bits(a: np.ndarray, dtype: str, keep: bool = False) -> torch.Tensor:
    """Inverse of ``to_bits``: float32, or with ``keep`` the stored dtype itself (bf16 without a conversion:
    half the bytes to pack and to copy to the GPU, where the trainer widens it)."""
    import torch
    if dtype == "bf16":
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:      # a view of a read-only Arrow buffer: a tensor over it could be written (UB)
            a = a.copy()
        x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return x if keep else x.float()
    return torch.from_numpy(np.ascontiguousarray(a).view(np.float32).copy())


def schema(latent_values: int, dtype: str, text_embeddings: bool, keep: bool = False) -> pa.Schema:
    bits = pa.uint16() if dtype == "bf16" else pa.uint32()
    fields = [("sample_id", pa.int64()), ("source", pa.string()), ("key", pa.string()), ("caption", pa.string()),
              ("orig_h", pa.int32()), ("orig_w", pa.int32()), ("crop", pa.list_(pa.int32(), 4)),
              ("scores", pa.string())]
    if text_embeddings:
        fields += [("txt", pa.large_list(bits)), ("txt_len", pa.int32()), ("pooled", pa.list_(bits))]
    if keep:       # the loss mask: one bit a target token (np.packbits, token order); empty = every token counts
        fields += [("keep", pa.binary())]
    # Latents are a Lance blob column: stored out of line and read by ``take_blobs`` straight into the batch
    # buffer (measured 3x the throughput of a fixed-size-list column on shuffled reads, bench/loader.py).
    # ``latent_values`` values of 2 (bf16) or 4 (fp32) bytes each.
    latents = pa.field("latents", pa.large_binary(), metadata={"lance-encoding:blob": "true",
                                                               "difftrain:values": str(latent_values)})
    return pa.schema([pa.field(n, t) for n, t in fields] + [latents])


@dataclass
class TableInfo:
    name: str
    stage: str
    bucket: str
    task: str
    frames: int
    latent_shape: list[int]        # F, C, h, w
    key: dict
    text_embeddings: bool
    keep: bool = False             # has the loss-mask column (tables written before it existed do not)

    @classmethod
    def from_json(cls, name: str, d: dict) -> "TableInfo":
        return cls(name, d["stage"], d["bucket"], d["task"], int(d["frames"]), list(d["latent_shape"]), d["key"],
                   bool(d["text_embeddings"]), bool(d.get("keep", False)))

    def to_json(self) -> dict:
        out = {"stage": self.stage, "bucket": self.bucket, "task": self.task, "frames": self.frames,
               "latent_shape": self.latent_shape, "key": self.key, "text_embeddings": self.text_embeddings}
        if self.keep:
            out["keep"] = True
        return out


def open_table(uri: str, name: str):
    import lance
    try:
        return lance.dataset(uri)
    except Exception as e:   # noqa: BLE001 - Lance raises several types for a damaged dataset
        raise UserError(f"store table {name} ({uri}) cannot be opened: {str(e).splitlines()[0]}") from None


def store_captions(store: str, n: int) -> list[str]:
    """The first ``n`` non-empty captions of the store's text-to-image tables (a read of the caption column of
    as few rows as that takes), in table order: prompts from the run's own data, for previews."""
    manifest = read_manifest(store) or {"tables": {}}
    out: list[str] = []
    for name, info in sorted(manifest["tables"].items()):
        if info.get("task") != "t2i" or len(out) >= n:
            continue
        ds = open_table(table_uri(store, name), name)
        for batch in ds.to_batches(columns=["caption"], batch_size=max(64, n)):
            out += [c for c in batch.column(0).to_pylist() if c]
            if len(out) >= n:
                break
    return out[:n]


def check_store(store: str, cfg, stages) -> tuple[dict, dict[str, TableInfo]]:
    """The store's manifest and the tables this config's stages read, refusing a store whose cache keys
    differ from this config's (the difference is shown)."""
    manifest = read_manifest(store)
    if manifest is None:
        raise UserError(f"data.store = {store!r}: no store there (store.json missing); run "
                        "'difftrain prepare CONFIG' first")
    tables: dict[str, TableInfo] = {}
    problems: list[str] = []
    for stage in stages:
        found = 0
        for bucket in stage.buckets:
            for task in ("t2i", "edit", "keyframes"):
                name = table_name(stage.name, bucket.name, task)
                entry = manifest["tables"].get(name)
                if entry is None:
                    continue
                info = TableInfo.from_json(name, entry)
                diff = key_diff(info.key, cache_key(cfg, stage, bucket, task))
                if diff:
                    problems.append(f"table {name}: " + "; ".join(diff))
                tables[name] = info
                found += 1
        if not found:
            problems.append(f"stage {stage.name!r}: no table for its buckets {[b.name for b in stage.buckets]} "
                            "(prepare the store with this config)")
    # A store written before text.padding existed holds states computed over padding, unmasked: 'padded'-like.
    rules = {info.key["text"].get("padding", "padded") for info in tables.values()
             if info.key.get("text", {}).get("kind") == "hf"}
    if rules and rules != {cfg.text.padding}:
        raise UserError(f"data.store = {store!r} holds text states under text.padding = {sorted(rules)[0]!r}, this "
                        f"config says {cfg.text.padding!r}: set text.padding = {sorted(rules)[0]!r}, or re-run "
                        "'difftrain prepare --overwrite' to encode the captions under the config's rule")
    if problems:
        raise UserError(f"data.store = {store!r} was built with other settings; re-run 'difftrain prepare' "
                        "(it never overwrites silently):\n  " + "\n  ".join(problems))
    return manifest, tables


def pack(latents_FCHW: torch.Tensor) -> torch.Tensor:
    """(F, C, h, w) latents in the store's token order: (F, h/2 * w/2, C * 4)."""
    from difftrain.tokens import patchify
    return patchify(latents_FCHW)


def write_table(store: str, info: TableInfo, rows: dict, dtype: str = "bf16", mode: str = "append") -> int:
    """Write rows {column: list} (``latents`` as float arrays of ``info.latent_shape``) to a table directly,
    without the prepare pipeline (benchmarks, tests, importing latents encoded elsewhere); records the
    table in the manifest. Returns the table's new version."""
    import lance
    import torch

    n_val = int(np.prod(info.latent_shape))
    lat = np.concatenate([to_bits(pack(torch.as_tensor(np.asarray(x, dtype=np.float32))), dtype)
                          for x in rows["latents"]])
    n = len(rows["sample_id"])
    cols = {
        "sample_id": pa.array(rows["sample_id"], pa.int64()),
        "source": pa.array(rows.get("source", ["direct"] * n)),
        "key": pa.array(rows.get("key", [str(i) for i in rows["sample_id"]])),
        "caption": pa.array(rows.get("caption", [""] * n)),
        "orig_h": pa.array(rows.get("orig_h", [info.latent_shape[2]] * n), pa.int32()),
        "orig_w": pa.array(rows.get("orig_w", [info.latent_shape[3]] * n), pa.int32()),
        "crop": pa.array(rows.get("crop", [[0, 0, 0, 0]] * n), pa.list_(pa.int32(), 4)),
        "scores": pa.array(rows.get("scores", ["{}"] * n)),
        "latents": pa.array([r.tobytes() for r in lat.reshape(n, n_val)], pa.large_binary()),
    }
    sch = schema(n_val, dtype, False)
    uri = table_uri(store, info.name)
    ds = lance.write_dataset(pa.table(cols, schema=sch), uri, schema=sch, mode=mode)
    manifest = read_manifest(store) or {"format": FORMAT, "tables": {}, "vocabulary": []}
    manifest["tables"][info.name] = info.to_json()
    vocab = set(manifest.get("vocabulary", []))
    from difftrain.words import words_of
    for c in rows.get("caption", []):
        vocab.update(words_of(c))
    manifest["vocabulary"] = sorted(vocab)
    write_manifest(store, manifest)
    return ds.version
