"""``difftrain prepare CONFIG``: raw pairs -> curation record -> latent store, on Ray Data.

1. Every ``[[data.sources]]`` is listed (``ingest.iter_source``).
2. **Facts** (size, content hash, perceptual hash, decode errors) are read in Ray tasks.
3. **Filters** (``[[data.filters]]``, in order) run on the driver, where duplicates are seen globally;
   every input row lands in ``curation.parquet`` with its outcome and the reason it was dropped.
   ``--dry-run`` stops here and prints the counts per reason.
4. Each kept sample goes to one bucket of every stage whose mixture names its source, by aspect ratio.
5. **Encoding** streams through Ray Data: decode + resize-to-cover + crop in CPU tasks, the autoencoder
   (and frozen text encoders) in actors (one GPU each where GPUs exist), Lance fragments written in Ray
   tasks; the driver commits them table by table every ``commit_every`` rows (each commit a new Lance
   version). A killed prepare leaves every committed version intact and a re-run encodes only the
   sample ids missing from each table, so it finishes with the same content per sample id.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from typing import Any

import numpy as np

from difftrain.data import store as st
from difftrain.config.autoencoder import autoencoder_geometry
from difftrain.config.stages import parse_stages
from difftrain.data.curriculum import assign_bucket
from difftrain.errors import UserError

log = logging.getLogger("difftrain")


# --------------------------------------------------------------------------- Ray

def start_ray(address: str | None = None):
    """Connect to ``address`` (an existing cluster) or start a local Ray once per process."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      configure_logging=False)
        if address:
            ray.init(address=address, **kwargs)
        else:       # a new local cluster, never one another process on this machine happens to run
            ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), **kwargs)
    from ray.data import DataContext
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    if hasattr(ctx, "print_on_execution_start"):
        ctx.print_on_execution_start = False
    return ray


# --------------------------------------------------------------------------- per-sample work (Ray tasks)

def _sample_of(row: dict):
    from difftrain.data.ingest import RawSample
    return RawSample(row["source"], row["key"], row["task"], list(row["refs"]), row["caption"],
                     row.get("caption_error") or "", json.loads(row["scores"]))


def _facts_batch(batch: dict) -> dict:
    from difftrain.data.curate import facts_for
    out: dict[str, list] = {"idx": [], "width": [], "height": [], "sha256": [], "phash": [], "error": [],
                            "frames": [], "pid": []}
    for i in range(len(batch["idx"])):
        row = {k: batch[k][i] for k in batch}
        f = facts_for(_sample_of(row))
        out["idx"].append(int(row["idx"]))
        out["width"].append(int(f.width))
        out["height"].append(int(f.height))
        out["sha256"].append(f.sha256)
        out["phash"].append(int(f.phash))
        out["error"].append(f.error)
        out["frames"].append(len(row["refs"]))
        out["pid"].append(os.getpid())
    return out


def resize_cover_crop(img, h: int, w: int, crop: str, seed: int) -> tuple[np.ndarray, list[int]]:
    """Resize (Lanczos) so the image covers h x w, then crop h x w (centre, or at a position drawn from the
    sample's id). Returns (H x W x 3 uint8, [top, left, h, w] of the crop in the resized image)."""
    from PIL import Image

    W0, H0 = img.size
    s = max(h / H0, w / W0)
    rw, rh = max(w, round(W0 * s)), max(h, round(H0 * s))
    img = img.convert("RGB").resize((rw, rh), Image.Resampling.LANCZOS)
    if crop == "random":
        rng = np.random.default_rng([seed & 0x7FFFFFFFFFFFFFFF, 7])
        top, left = int(rng.integers(0, rh - h + 1)), int(rng.integers(0, rw - w + 1))
    else:
        top, left = (rh - h) // 2, (rw - w) // 2
    return np.asarray(img.crop((left, top, left + w, top + h)), dtype=np.uint8), [top, left, h, w]


def _decode_batch(batch: dict) -> dict:
    """Read, decode, resize and crop every frame of every row (CPU task)."""
    import io

    from PIL import Image

    from difftrain.data.ingest import read_ref

    out: dict[str, list] = defaultdict(list)
    for i in range(len(batch["sample_id"])):
        h, w = int(batch["h"][i]), int(batch["w"][i])
        frames, box, orig, err = [], [0, 0, h, w], (0, 0), ""
        try:
            for ref in batch["refs"][i]:
                with Image.open(io.BytesIO(read_ref(ref))) as img:
                    img.load()
                    if not orig[0]:
                        orig = (img.size[1], img.size[0])
                    arr, box = resize_cover_crop(img, h, w, str(batch["crop"][i]), int(batch["sample_id"][i]))
                frames.append(arr)
        except Exception as e:  # noqa: BLE001 - a per-sample fault: counted, never fatal here
            err = f"{type(e).__name__}: {e}"
        for k in ("sample_id", "table", "source", "key", "caption", "scores", "h", "w", "latent_dtype"):
            out[k].append(batch[k][i])
        out["pixels"].append(np.stack(frames).tobytes() if not err else b"")
        out["frames"].append(len(frames))
        out["orig"].append(list(orig))
        out["crop_box"].append(box)
        out["error"].append(err)
    return dict(out)


class _Encode:
    """An actor holding the autoencoder (and frozen text encoders): pixels -> latent bits (+ text bits)."""

    def __init__(self, cfg_dict: dict):
        import torch

        from difftrain.config.load import from_dict
        from difftrain.models import build_autoencoder

        self.cfg = from_dict(cfg_dict, "prepare")
        ae = self.cfg.autoencoder
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.ae = build_autoencoder(ae.kind, ae.factor, ae.path, ae.scaling, ae.shift).to(self.device).eval()
        self.text = None
        if self.cfg.text.kind == "hf":
            from difftrain.models import build_text_encoder
            self.text = build_text_encoder(self.cfg, None, self.device).eval()

    def __call__(self, batch: dict) -> dict:
        import torch

        n = len(batch["sample_id"])
        latents: list[bytes] = [b""] * n
        txt: list[bytes] = [b""] * n
        txt_len, pooled = [0] * n, [b""] * n
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in range(n):
            if not batch["error"][i]:
                groups[(int(batch["frames"][i]), int(batch["h"][i]), int(batch["w"][i]))].append(i)
        dtype = str(batch["latent_dtype"][0]) if n else "bf16"
        with torch.no_grad():
            for (F, h, w), rows in groups.items():
                pix = np.stack([np.frombuffer(batch["pixels"][i], np.uint8).reshape(F, h, w, 3) for i in rows])
                x = torch.from_numpy(pix).float().div_(127.5).sub_(1.0).movedim(-1, -3).flatten(0, 1)
                lat = self.ae.encode(x.to(self.device)).float().cpu()
                lat = lat.reshape(len(rows), F, *lat.shape[1:])
                for j, i in enumerate(rows):
                    latents[i] = st.to_bits(st.pack(lat[j]), dtype).tobytes()
                if self.text is not None:
                    prompts = [str(batch["caption"][i]) for i in rows]
                    emb = self.text(self.text.tokenize(prompts))
                    for j, i in enumerate(rows):
                        t = int(emb.mask_BT[j].sum())
                        txt[i] = st.to_bits(emb.txt_BTD[j, :t].float().cpu(), dtype).tobytes()
                        txt_len[i] = t
                        pooled[i] = st.to_bits(emb.pooled_BP[j].float().cpu(), dtype).tobytes()
        out = {k: batch[k] for k in ("sample_id", "table", "source", "key", "caption", "scores", "orig",
                                     "crop_box", "error", "latent_dtype")}
        out.update(latents=latents, txt=txt, txt_len=txt_len, pooled=pooled, pid=[os.getpid()] * n)
        return out


def _write_batch(batch: dict, store: str, tables: dict) -> dict:
    """Write this batch's rows as Lance fragments, one set per table (Ray task); the driver commits them."""
    import pyarrow as pa
    from lance.fragment import write_fragments

    out: dict[str, list] = {"table": [], "fragments": [], "rows": [], "errors": [], "pid": []}
    by_table: dict[str, list[int]] = defaultdict(list)
    errors: dict[str, list[str]] = defaultdict(list)
    for i in range(len(batch["sample_id"])):
        if batch["error"][i]:
            errors[str(batch["table"][i])].append(f"{batch['source'][i]}/{batch['key'][i]}: {batch['error'][i]}")
        else:
            by_table[str(batch["table"][i])].append(i)
    for name in sorted(set(by_table) | set(errors)):
        rows = by_table.get(name, [])
        frags: list[str] = []
        if rows:
            info = tables[name]
            dtype = str(batch["latent_dtype"][rows[0]])
            bits = np.uint16 if dtype == "bf16" else np.uint32
            n_val = int(np.prod(info["latent_shape"]))
            cols = {
                "sample_id": pa.array([int(batch["sample_id"][i]) for i in rows], pa.int64()),
                "source": pa.array([str(batch["source"][i]) for i in rows]),
                "key": pa.array([str(batch["key"][i]) for i in rows]),
                "caption": pa.array([str(batch["caption"][i]) for i in rows]),
                "orig_h": pa.array([int(batch["orig"][i][0]) for i in rows], pa.int32()),
                "orig_w": pa.array([int(batch["orig"][i][1]) for i in rows], pa.int32()),
                "crop": pa.array([[int(v) for v in batch["crop_box"][i]] for i in rows], pa.list_(pa.int32(), 4)),
                "scores": pa.array([str(batch["scores"][i]) for i in rows]),
                "latents": pa.array([batch["latents"][i] for i in rows], pa.large_binary()),
            }
            if info["text_embeddings"]:
                cols["txt"] = pa.array([np.frombuffer(batch["txt"][i], bits) for i in rows],
                                       pa.large_list(pa.from_numpy_dtype(bits)))
                cols["txt_len"] = pa.array([int(batch["txt_len"][i]) for i in rows], pa.int32())
                cols["pooled"] = pa.array([np.frombuffer(batch["pooled"][i], bits) for i in rows],
                                          pa.list_(pa.from_numpy_dtype(bits)))
            schema = st.schema(n_val, dtype, info["text_embeddings"])
            table = pa.table(cols, schema=schema)
            frags = [json.dumps(f.to_json()) for f in write_fragments(table, st.table_uri(store, name), schema=schema)]
        out["table"].append(name)
        out["fragments"].append(json.dumps(frags))
        out["rows"].append(len(rows))
        out["errors"].append(json.dumps(errors.get(name, [])))
        out["pid"].append(os.getpid())
    return out


# --------------------------------------------------------------------------- the driver

def _commit(store: str, name: str, frag_json: list[str], schema, replace: bool = False) -> int:
    """Commit fragments to a table: Overwrite creates (or, with ``replace``, supersedes) it, Append adds a
    version. Returns the new version; earlier versions stay readable until cleaned up."""
    import lance
    from lance.fragment import FragmentMetadata

    frags = [FragmentMetadata.from_json(j) for j in frag_json]
    uri = st.table_uri(store, name)
    try:
        ds = lance.dataset(uri)
    except Exception:  # noqa: BLE001 - no dataset yet
        ds = None
    if ds is None or replace:
        return lance.LanceDataset.commit(uri, lance.LanceOperation.Overwrite(schema, frags),
                                         read_version=ds.version if ds is not None else None).version
    return lance.LanceDataset.commit(uri, lance.LanceOperation.Append(frags), read_version=ds.version).version


def _existing_ids(store: str, name: str) -> set[int]:
    import lance
    try:
        ds = lance.dataset(st.table_uri(store, name))
    except Exception:  # noqa: BLE001
        return set()
    return set(ds.to_table(columns=["sample_id"])["sample_id"].to_pylist())


def list_samples(cfg) -> list:
    from difftrain.data.ingest import iter_source
    if not cfg.data.sources:
        raise UserError("data.sources is empty: add [[data.sources]] tables {name, kind, path} to the config")
    names = [s.get("name") for s in cfg.data.sources]
    if len(set(names)) != len(names):
        raise UserError(f"data.sources: names must be unique, got {names}")
    samples = []
    for spec in cfg.data.sources:
        samples.extend(iter_source(spec))
    return samples


def prepare(cfg, *, dry_run: bool = False, ray_address: str | None = None, overwrite: bool = False,
            progress: bool = True, commit_every: int = 256, batch_size: int = 32, limit: int = 0) -> dict:
    """Curate and encode ``cfg.data.sources`` into the store ``cfg.data.store``; returns a summary.
    ``limit`` (tests): stop after committing about that many rows, as a killed run would."""
    from difftrain.config.load import to_dict
    from difftrain.data.curate import apply_filters, reason_counts, write_record

    t0 = time.perf_counter()
    store = cfg.data.store
    if not store and not dry_run:
        raise UserError("data.store is empty: set it to the store's path or URI")
    stages = parse_stages(cfg, strict=True)
    samples = list_samples(cfg)
    ray = start_ray(ray_address)
    import ray.data

    # ---- facts, in Ray tasks
    items = [{"idx": i, "source": s.source, "key": s.key, "task": s.task, "refs": list(s.refs),
              "caption": s.caption, "caption_error": s.caption_error, "scores": json.dumps(s.scores)}
             for i, s in enumerate(samples)]
    from difftrain.data.curate import Facts
    facts: list[Any] = [None] * len(samples)
    pids: set[int] = set()
    if items:
        ds = ray.data.from_items(items).map_batches(_facts_batch, batch_size=batch_size, batch_format="numpy")
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for j, i in enumerate(batch["idx"]):
                facts[int(i)] = Facts(int(batch["width"][j]), int(batch["height"][j]), str(batch["sha256"][j]),
                                      int(batch["phash"][j]), str(batch["error"][j]))
            pids.update(int(p) for p in batch["pid"])
    outcomes = apply_filters(samples, facts, cfg.data.filters)
    K = cfg.data.frames   # a keyframe table has a fixed frame count
    for i, s in enumerate(samples):
        if outcomes[i][0] and s.task == "keyframes" and len(s.refs) != K:
            outcomes[i] = (False, f"frames: expected {K} (data.frames), got {len(s.refs)}")
    counts = reason_counts(outcomes)
    kept = [i for i, (ok, _) in enumerate(outcomes) if ok]
    decode_errors = sum(1 for ok, r in outcomes if not ok and r.startswith("decode"))
    summary: dict[str, Any] = {"inputs": len(samples), "kept": len(kept), "reasons": counts,
                               "decode_errors": decode_errors, "facts_pids": sorted(pids)}
    if dry_run:
        summary["seconds"] = round(time.perf_counter() - t0, 2)
        return summary
    write_record(f"{store.rstrip('/')}/curation.parquet", samples, facts, outcomes,
                 {"config": json.dumps(to_dict(cfg))})
    if samples and decode_errors / len(samples) > cfg.data.max_error_rate:
        raise UserError(f"{decode_errors} of {len(samples)} inputs could not be read or decoded "
                        f"({decode_errors / len(samples):.1%} > data.max_error_rate = {cfg.data.max_error_rate}); "
                        f"see {store}/curation.parquet for each one. Nothing was written to the store.")

    # ---- tables and cache keys
    manifest = st.read_manifest(store) or {"format": st.FORMAT, "tables": {}, "vocabulary": []}
    patch = stages[0].buckets[0].patch
    C = autoencoder_geometry(cfg.autoencoder)[0]
    tables: dict[str, dict] = {}
    refused = []
    todo: list[dict] = []
    for stage in stages:
        allowed = set(stage.mixture) if stage.mixture else None
        per_table: dict[str, list[int]] = defaultdict(list)
        for i in kept:
            s = samples[i]
            if allowed is not None and s.source not in allowed:
                continue
            b = assign_bucket(stage.buckets, facts[i].width, facts[i].height)
            per_table[st.table_name(stage.name, b.name, s.task)].append(i)
        for name, rows in sorted(per_table.items()):
            _, bname, task = name.split("/")
            bucket = stage.bucket(bname)
            F = st.task_frames(task, K)
            info = st.TableInfo(name, stage.name, bname, task, F, [F, C, bucket.h // patch * 2, bucket.w // patch * 2],
                                st.cache_key(cfg, stage, bucket, task), cfg.text.kind == "hf")
            old = manifest["tables"].get(name)
            if old is not None and not overwrite:
                diff = st.key_diff(old["key"], info.key)
                if diff:
                    refused.append(f"table {name}: " + "; ".join(diff))
                    continue
            done = set() if overwrite else _existing_ids(store, name)
            tables[name] = info.to_json()
            for i in rows:
                s = samples[i]
                if s.sample_id in done:
                    continue
                todo.append({"sample_id": s.sample_id, "table": name, "source": s.source, "key": s.key,
                             "caption": s.caption or "", "scores": json.dumps(s.scores),
                             # the store keeps an edit's target first, its reference second (RoPE index 0, 1)
                             "refs": list(s.refs[::-1]) if task == "edit" else list(s.refs),
                             "h": bucket.h, "w": bucket.w, "crop": stage.crop, "latent_dtype": cfg.data.latent_dtype})
    if refused:
        raise UserError(f"data.store = {store!r} holds tables built with other settings; nothing was changed. "
                        "Use another store, or --overwrite to write new versions (Lance keeps the old ones):\n  "
                        + "\n  ".join(refused))
    fresh = set(tables) if overwrite else set()     # their first commit is a Lance Overwrite (a new version)
    vocab = set(manifest.get("vocabulary", []))
    from difftrain.models.text import words_of
    for i in kept:
        vocab.update(words_of(samples[i].caption or ""))
    manifest["vocabulary"] = sorted(vocab)
    if cfg.text.kind == "hf":
        _write_empty_text(cfg, store)

    # ---- encode + write, streamed
    written, errors, enc_pids, write_pids = 0, [], set(), set()
    t_enc = time.perf_counter()
    if todo:
        use_gpu = _cluster_gpus(ray) > 0
        ds = (ray.data.from_items(todo)
              .map_batches(_decode_batch, batch_size=batch_size, batch_format="numpy")
              .map_batches(_Encode, fn_constructor_args=(to_dict(cfg),), batch_size=batch_size,
                           batch_format="numpy", concurrency=1, num_gpus=1 if use_gpu else 0)
              .map_batches(_write_batch, fn_kwargs={"store": store, "tables": tables}, batch_size=batch_size,
                           batch_format="numpy"))
        pending: dict[str, list[str]] = defaultdict(list)
        pending_rows: dict[str, int] = defaultdict(int)
        bar = _progress(progress, len(todo))

        def flush(name: str) -> None:
            if pending[name]:
                info = tables[name]
                _commit(store, name, pending[name], st.schema(int(np.prod(info["latent_shape"])),
                                                             cfg.data.latent_dtype, info["text_embeddings"]),
                        replace=name in fresh)
                fresh.discard(name)
                pending[name], pending_rows[name] = [], 0
                manifest["tables"][name] = info          # named in the manifest once it holds rows
                st.write_manifest(store, manifest)

        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for j, name in enumerate(batch["table"]):
                    name = str(name)
                    pending[name].extend(json.loads(batch["fragments"][j]))
                    n = int(batch["rows"][j])
                    pending_rows[name] += n
                    written += n
                    errs = json.loads(batch["errors"][j])
                    errors.extend(errs)
                    write_pids.add(int(batch["pid"][j]))
                    if bar:
                        bar[0].update(bar[1], advance=n + len(errs))
                    if pending_rows[name] >= commit_every:
                        flush(name)
                if errors and len(errors) / len(todo) > cfg.data.max_error_rate:
                    raise UserError(f"{len(errors)} samples failed to decode or encode (> data.max_error_rate = "
                                    f"{cfg.data.max_error_rate} of {len(todo)}); first: {errors[0]}. Committed "
                                    "versions are intact; fix the inputs and re-run (only the missing rows are done).")
                if limit and written >= limit:
                    break
            else:
                for name in list(pending):
                    flush(name)
        finally:
            if bar:
                bar[0].stop()
    st.write_manifest(store, manifest)
    for e in errors[:20]:
        log.warning("prepare: skipped %s", e)
    summary.update(encoded=written, encode_errors=len(errors), tables=len(tables),
                   encode_seconds=round(time.perf_counter() - t_enc, 2), seconds=round(time.perf_counter() - t0, 2),
                   images_per_s=round(written / max(1e-9, time.perf_counter() - t_enc), 1),
                   write_pids=sorted(write_pids), store=store)
    return summary


def _cluster_gpus(ray) -> int:
    try:
        return int(ray.cluster_resources().get("GPU", 0))
    except Exception:  # noqa: BLE001
        return 0


def _write_empty_text(cfg, store: str) -> None:
    """The empty prompt's embedding (caption dropout reads it when the store holds embeddings)."""
    from safetensors.torch import save_file

    from difftrain.models import build_text_encoder
    enc = build_text_encoder(cfg, None, "cpu").eval()
    import torch
    with torch.no_grad():
        emb = enc(enc.tokenize([""]))
    t = max(1, int(emb.mask_BT[0].sum()))
    save_file({"txt": emb.txt_BTD[0, :t].float().contiguous(), "pooled": emb.pooled_BP[0].float().contiguous()},
              f"{store.rstrip('/')}/empty_text.safetensors")


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]prepare"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 console=Console(stderr=True), transient=False)
    p.start()
    return p, p.add_task("encode", total=total)


__all__ = ["prepare", "start_ray", "resize_cover_crop", "list_samples"]
