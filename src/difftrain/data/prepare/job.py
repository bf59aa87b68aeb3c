"""``difftrain prepare CONFIG``: raw pairs -> curation record -> latent store, on Ray Data.

1. Every ``[[data.sources]]`` is listed in a Ray read task (``curation_ops``).
2. **Facts** (size, content hash, perceptual hash, decode errors) are read in Ray tasks.
3. **Filters** (``[[data.filters]]``, in order) run as Ray Data operations: per-row maps, a sort on the
   content hash for exact duplicates, banded perceptual hashes for near duplicates (``near_dup``); every
   input row lands in the curation record, written by Ray as Parquet parts beside ``curation.parquet`` and
   swapped in only when the prepare succeeds. ``--dry-run`` stops here and prints the counts per reason.
4. Each kept sample goes to one bucket of every stage whose mixture names its source, by aspect ratio; the
   sample ids a table already holds (read from its Lance version in the tasks) are left out.
5. **Encoding** streams through Ray Data: decode + resize-to-cover + crop in CPU tasks, the autoencoder
   (and frozen text encoders) in ``data.encoder_actors`` actors (one per GPU where the cluster has GPUs), Lance
   fragments written in Ray tasks; the driver commits them table by table every ``commit_every`` rows (each
   commit a new Lance version). A killed or failed prepare leaves every committed version and the previous
   curation record intact, and a re-run encodes only the sample ids missing from each table, so it finishes
   with the same content per sample id.

The driver holds counters (per reason, per table, per encoder actor), never a list of the rows.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from typing import Any
from pathlib import Path

import numpy as np

from difftrain.config.autoencoder import autoencoder_geometry
from difftrain.config.load import to_dict
from difftrain.config.stages import parse_stages
from difftrain.data.store import tables as st
from difftrain.data.prepare.curation_ops import (RECORD_NAME, StagedRecord, check_sources, curated_dataset, local_path,
                                         reason_tally, user_error_in)
from difftrain.data.prepare.ingest import TASKS
from difftrain.data.prepare.plan import (PLAN_COLUMNS, encoder_counts, encoder_plan, missing_rows, table_rows,
                                         table_tally, table_versions)
from difftrain.errors import UserError

log = logging.getLogger("difftrain")
FAILED_RECORD = "curation.failed.parquet"    # the record of a prepare refused (decode errors, or nothing kept)


# --------------------------------------------------------------------------- Ray

def start_ray(address: str | None = None, num_cpus: int | None = None):
    """Connect to ``address`` (an existing cluster) or start a local Ray once per process, with ``num_cpus``
    logical CPUs (default: the machine's, at least 2)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      configure_logging=False)
        if address:
            ray.init(address=address, **kwargs)
        else:       # a new local cluster, never one another process on this machine happens to run
            ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kwargs)
    from ray.data import DataContext
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    if hasattr(ctx, "print_on_execution_start"):
        ctx.print_on_execution_start = False
    # Encoder actors start together (each gets its share from the first batch on), and an actor pool the
    # cluster cannot host fails after this long instead of waiting for ever.
    ctx.wait_for_min_actors_s = 600
    return ray


# --------------------------------------------------------------------------- per-sample work (Ray tasks)

def _cover_box(W0: int, H0: int, h: int, w: int, crop: str, seed: int) -> tuple[int, int, int, int]:
    """(resized width, resized height, top, left): the resize that covers h x w and the crop box's corner (centre,
    or at a position drawn from the sample's id)."""
    s = max(h / H0, w / W0)
    rw, rh = max(w, round(W0 * s)), max(h, round(H0 * s))
    if crop == "random":
        rng = np.random.default_rng([seed & 0x7FFFFFFFFFFFFFFF, 7])
        return rw, rh, int(rng.integers(0, rh - h + 1)), int(rng.integers(0, rw - w + 1))
    return rw, rh, (rh - h) // 2, (rw - w) // 2


def resize_cover_crop(img, h: int, w: int, crop: str, seed: int) -> tuple[np.ndarray, list[int]]:
    """Resize (Lanczos) so the image covers h x w, then crop h x w (centre, or at a position drawn from the
    sample's id). Returns (H x W x 3 uint8, [top, left, h, w] of the crop in the resized image)."""
    from PIL import Image

    rw, rh, top, left = _cover_box(*img.size, h, w, crop, seed)
    img = img.convert("RGB").resize((rw, rh), Image.Resampling.LANCZOS)
    return np.asarray(img.crop((left, top, left + w, top + h)), dtype=np.uint8), [top, left, h, w]


def token_keep(mask, size: tuple[int, int], h: int, w: int, patch: int, crop: str, seed: int) -> np.ndarray:
    """A loss mask (a PIL image, white where the loss is taken) as one flag per token of the h x w crop, in token
    order (row-major over the (h / patch) x (w / patch) grid): resized and cropped as its image is (bilinear), a
    pixel counts where it is >= 128, and a token where at least half of its patch x patch pixels count. ``size`` is
    the image's (width, height): a mask of another size is refused."""
    from PIL import Image

    if mask.size != size:
        raise ValueError(f"mask is {mask.size[0]}x{mask.size[1]}, its image {size[0]}x{size[1]}")
    rw, rh, top, left = _cover_box(*size, h, w, crop, seed)
    m = mask.convert("L").resize((rw, rh), Image.Resampling.BILINEAR).crop((left, top, left + w, top + h))
    on = np.asarray(m, dtype=np.uint8) >= 128
    share = on.reshape(h // patch, patch, w // patch, patch).mean(axis=(1, 3))
    keep = (share >= 0.5).reshape(-1)
    if not keep.any():
        raise ValueError(f"mask keeps no token of the {h}x{w} crop (a token needs half its pixels white)")
    return keep


def _mask_of(img, ref: str, read_ref):
    """The loss mask of a target image: its alpha channel (``ingest.ALPHA``) or the mask file ``ref``."""
    import io

    from PIL import Image

    from difftrain.data.prepare.ingest import ALPHA

    if ref == ALPHA:
        if img.mode not in ("RGBA", "LA", "PA") and "transparency" not in img.info:
            raise ValueError(f"mask = 'alpha' but the image ({img.mode}) has no alpha channel")
        return img.convert("RGBA").getchannel("A")
    with Image.open(io.BytesIO(read_ref(ref))) as m:
        m.load()
        return m.copy()


def _decode_batch(batch: dict) -> dict:
    """Read, decode, resize and crop every frame of every row (CPU task)."""
    import io

    from PIL import Image

    from difftrain.data.prepare.refs import read_ref

    out: dict[str, list] = defaultdict(list)
    for i in range(len(batch["sample_id"])):
        h, w = int(batch["h"][i]), int(batch["w"][i])
        frames, box, orig, err, keep = [], [0, 0, h, w], (0, 0), "", b""
        mask_ref = str(batch["mask"][i]) if "mask" in batch else ""
        crop, sid = str(batch["crop"][i]), int(batch["sample_id"][i])
        try:
            for f, ref in enumerate(batch["refs"][i]):
                with Image.open(io.BytesIO(read_ref(ref))) as img:
                    img.load()
                    if not orig[0]:
                        orig = (img.size[1], img.size[0])
                    arr, box = resize_cover_crop(img, h, w, crop, sid)
                    if f == 0 and mask_ref:      # the target (an edit's is first) carries the loss mask
                        try:
                            m = _mask_of(img, mask_ref, read_ref)
                            keep = np.packbits(token_keep(m, img.size, h, w, int(batch["patch"][i]), crop,
                                                          sid)).tobytes()
                        except Exception as e:  # noqa: BLE001
                            raise ValueError(f"loss mask {mask_ref}: {e}") from None
                frames.append(arr)
        except Exception as e:  # noqa: BLE001 - a per-sample fault: counted, never fatal here
            err = f"{type(e).__name__}: {e}"
        for k in ("sample_id", "table", "source", "key", "caption", "scores", "h", "w", "latent_dtype"):
            out[k].append(batch[k][i])
        out["pixels"].append(np.stack(frames).tobytes() if not err else b"")
        out["keep"].append(keep if not err else b"")
        out["frames"].append(len(frames))
        out["orig"].append(list(orig))
        out["crop_box"].append(box)
        out["error"].append(err)
    return dict(out)


class _Encode:
    """An actor holding the autoencoder (and frozen text encoders): pixels -> latent bits (+ text bits)."""

    def __init__(self, cfg_dict: dict, threads: int = 1):
        import torch

        from difftrain.config.load import from_dict
        from difftrain.models import build_autoencoder

        self.cfg = from_dict(cfg_dict, "prepare")
        ae = self.cfg.autoencoder
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(threads)          # the actor's CPU share; the other CPUs decode and write
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
                                     "crop_box", "error", "latent_dtype", "keep")}
        out.update(latents=latents, txt=txt, txt_len=txt_len, pooled=pooled, pid=[os.getpid()] * n)
        return out


def _write_batch(batch: dict, store: str, tables: dict) -> dict:
    """Write this batch's rows as Lance fragments, one set per table (Ray task); the driver commits them."""
    import pyarrow as pa
    from lance.fragment import write_fragments

    out: dict[str, list] = {"table": [], "fragments": [], "rows": [], "errors": [], "pid": [], "encoders": []}
    by_table: dict[str, list[int]] = defaultdict(list)
    errors: dict[str, list[str]] = defaultdict(list)
    for i in range(len(batch["sample_id"])):
        if batch["error"][i]:
            errors[str(batch["table"][i])].append(f"{batch['source'][i]}/{batch['key'][i]}: {batch['error'][i]}")
        elif len(batch["keep"][i]) and not tables[str(batch["table"][i])].get("keep"):
            errors[str(batch["table"][i])].append(
                f"{batch['source'][i]}/{batch['key'][i]}: has a loss mask, but table {batch['table'][i]} was written "
                "before loss masks existed; re-run 'difftrain prepare --overwrite' to rewrite it with them")
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
            if info.get("keep"):
                cols["keep"] = pa.array([bytes(batch["keep"][i]) for i in rows], pa.binary())
            if info["text_embeddings"]:
                cols["txt"] = pa.array([np.frombuffer(batch["txt"][i], bits) for i in rows],
                                       pa.large_list(pa.from_numpy_dtype(bits)))
                cols["txt_len"] = pa.array([int(batch["txt_len"][i]) for i in rows], pa.int32())
                cols["pooled"] = pa.array([np.frombuffer(batch["pooled"][i], bits) for i in rows],
                                          pa.list_(pa.from_numpy_dtype(bits)))
            schema = st.schema(n_val, dtype, info["text_embeddings"], bool(info.get("keep")))
            table = pa.table(cols, schema=schema)
            frags = [json.dumps(f.to_json()) for f in write_fragments(table, st.table_uri(store, name), schema=schema)]
        out["table"].append(name)
        out["fragments"].append(json.dumps(frags))
        out["rows"].append(len(rows))
        out["errors"].append(json.dumps(errors.get(name, [])))
        out["pid"].append(os.getpid())
        out["encoders"].append(json.dumps(Counter(str(batch["pid"][i]) for i in rows)))    # rows per encoder actor
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


def prepare(cfg, *, dry_run: bool = False, ray_address: str | None = None, overwrite: bool = False,
            progress: bool = True, commit_every: int = 256, batch_size: int = 32, limit: int = 0) -> dict:
    """Curate and encode ``cfg.data.sources`` into the store ``cfg.data.store``; returns a summary.
    ``limit`` (tests): stop after committing about that many rows, as a killed run would (the new curation
    record is not swapped in)."""
    t0 = time.perf_counter()
    store = cfg.data.store
    if not store and not dry_run:
        raise UserError("data.store is empty: set it to the store's path or URI")
    store = local_path(store) if store else store
    stages = parse_stages(cfg, strict=True)
    specs = check_sources(cfg)
    ray = start_ray(ray_address)
    actors = None
    if not dry_run:       # refuse an impossible actor request before any work
        res = ray.cluster_resources()
        actors = encoder_plan(cfg.data, res.get("CPU", 0), res.get("GPU", 0))
    try:
        curated, stats = curated_dataset(cfg, specs)
        if dry_run:                 # the same checks as the real run, and the same error where it would fail
            summary = _curation_summary(reason_tally(curated)[0], stats)
            summary["seconds"] = round(time.perf_counter() - t0, 2)
            problem = _curation_problem(cfg, summary)
            if problem is not None:
                raise UserError(f"{problem} (--dry-run: nothing was written)")
            return summary
        record = StagedRecord(store)
        record.recover()
        st.remove_manifest_temps(store)
        try:
            curated = curated.materialize()          # the rows in the object store: record, counts and tables read them
            record.write(curated, {"config": json.dumps(to_dict(cfg))})
            counts, words = reason_tally(curated, words=True)
            summary = _curation_summary(counts, stats)
            problem = _curation_problem(cfg, summary)
            if problem is not None:
                failed = record.publish(FAILED_RECORD)
                raise UserError(f"{problem}; see {failed} for each input and its reason. Nothing was written to the "
                                f"store (its {RECORD_NAME} is still the last successful prepare's).")
            finished = _encode(cfg, store, stages, curated, words, summary, actors, overwrite=overwrite,
                               progress=progress, commit_every=commit_every, batch_size=batch_size, limit=limit)
            if finished:
                record.publish()
        finally:
            record.discard()
    except Exception as e:
        err = user_error_in(e)          # a UserError raised in a Ray task: its message, not the task's traceback
        if err is not None and str(err) != str(e):
            raise err from None
        raise
    summary.update(seconds=round(time.perf_counter() - t0, 2), store=store)
    return summary


def _encoder_paths_absolute(cfg_dict: dict) -> dict:
    """The config the encoder actors build from, its local encoder folders made absolute: a Ray worker does not run in
    the directory the command ran in (nor on its machine, on a cluster: there the folders must be shared paths)."""
    out = json.loads(json.dumps(cfg_dict))
    for sec, key in (("autoencoder", "path"), ("text", "t5_path"), ("text", "clip_path")):
        value = out[sec][key]
        if value and "://" not in value and Path(value).exists():
            out[sec][key] = str(Path(value).resolve())
    return out


def _curation_problem(cfg, summary: dict[str, Any]) -> str | None:
    """Why curation's outcome cannot make a store (the same verdict for ``--dry-run`` and the real run), or None: more
    unreadable inputs than ``data.max_error_rate`` allows, or no input kept at all (a store with nothing to train on:
    ``train`` would only say that the store was built with other settings)."""
    n, bad, kept = summary["inputs"], summary["decode_errors"], summary["kept"]
    if n and bad / n > cfg.data.max_error_rate:
        return (f"{bad} of {n} inputs could not be read or decoded ({bad / n:.1%} > data.max_error_rate = "
                f"{cfg.data.max_error_rate})")
    if not kept:
        why = ", ".join(f"{reason}: {count}" for reason, count in sorted(summary["reasons"].items(),
                                                                         key=lambda kv: -kv[1]))
        return (f"curation kept none of the {n} inputs ({why or 'no inputs found in data.sources'}): relax the "
                "filter named (data.filters; a 'size: min_side' reason is the images' shorter side under the filter's "
                "min_side) or check the sources")
    return None


def _curation_summary(counts: dict[str, int], stats: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"inputs": sum(counts.values()), "kept": counts.get("kept", 0), "reasons": counts,
                           "decode_errors": counts.get("decode", 0)}
    out.update(stats)
    return out


def _encode(cfg, store: str, stages, curated, words: set[str], summary: dict, actors: dict, *, overwrite: bool,
            progress: bool, commit_every: int, batch_size: int, limit: int) -> bool:
    """Plan the table rows of the curated rows, check the tables' cache keys, then encode what the tables lack
    and commit it (``words``: the kept captions' words, for the store's vocabulary).
    Returns whether every row was done (False when ``limit`` stopped it)."""
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    K = cfg.data.frames   # a keyframe table has a fixed frame count
    manifest = st.read_manifest(store) or {"format": st.FORMAT, "tables": {}, "vocabulary": []}
    patch = stages[0].buckets[0].patch
    C = autoencoder_geometry(cfg.autoencoder)[0]
    infos: dict[str, st.TableInfo] = {}
    for stage in stages:
        for bucket in stage.buckets:
            for task in TASKS:
                F = st.task_frames(task, K)
                name = st.table_name(stage.name, bucket.name, task)
                infos[name] = st.TableInfo(name, stage.name, bucket.name, task, F,
                                           [F, C, bucket.h // patch * 2, bucket.w // patch * 2],
                                           st.cache_key(cfg, stage, bucket, task), cfg.text.kind == "hf")
    versions = {} if overwrite else table_versions(store, sorted(infos))
    planned = (curated.select_columns(PLAN_COLUMNS)
               .map_batches(table_rows, fn_kwargs={"stages": stages, "frames": K, "store": store, "versions": versions,
                                                    "latent_dtype": cfg.data.latent_dtype}, batch_format="pyarrow")
               .materialize())
    per_table = table_tally(planned)
    refused = []
    for name in sorted(per_table):
        old = manifest["tables"].get(name)
        if old is not None and not overwrite and (diff := st.key_diff(old["key"], infos[name].key)):
            refused.append(f"table {name}: " + "; ".join(diff))
    if refused:
        raise UserError(f"data.store = {store!r} holds tables built with other settings; nothing was changed. "
                        "Use another store, or --overwrite to write new versions (Lance keeps the old ones):\n  "
                        + "\n  ".join(refused))
    for name in per_table:      # a table written before the loss-mask column existed gets appended without it
        old = manifest["tables"].get(name)
        infos[name].keep = overwrite or old is None or bool(old.get("keep"))
    tables = {name: infos[name].to_json() for name in per_table}
    fresh = set(tables) if overwrite else set()     # their first commit is a Lance Overwrite (a new version)
    manifest["vocabulary"] = sorted(set(manifest.get("vocabulary", [])) | words)
    if cfg.text.kind == "hf":
        _write_empty_text(cfg, store)

    # ---- encode + write, streamed
    n_todo = sum(todo for _, todo in per_table.values())
    written, n_errors, first_errors = 0, 0, []
    write_pids: set[int] = set()
    enc_rows: Counter = Counter()
    t_enc = time.perf_counter()
    finished = True
    if n_todo:
        use_gpu = actors["encoder_device"] == "gpu"
        # Up to 4 batches a task (each task costs the driver some memory), fewer when a few tasks a worker need it.
        workers = actors["encoder_actors"] + actors["decode_tasks"]
        block = min(4 * batch_size, max(batch_size, n_todo // (4 * workers)))
        ds = (planned.map_batches(missing_rows, batch_format="pyarrow")
              .repartition(target_num_rows_per_block=block)
              .map_batches(_decode_batch, batch_size=batch_size, batch_format="numpy",
                           compute=TaskPoolStrategy(size=actors["decode_tasks"]),
                           memory=_decode_memory(stages, max(t["frames"] for t in tables.values()), batch_size))
              .map_batches(_Encode, fn_constructor_args=(_encoder_paths_absolute(to_dict(cfg)),), batch_size=batch_size,
                           batch_format="numpy",
                           compute=ActorPoolStrategy(size=actors["encoder_actors"]), num_cpus=1,
                           num_gpus=1 if use_gpu else 0)
              .map_batches(_write_batch, fn_kwargs={"store": store, "tables": tables}, batch_size=batch_size,
                           batch_format="numpy"))
        pending: dict[str, list[str]] = defaultdict(list)
        pending_rows: dict[str, int] = defaultdict(int)
        bar = _progress(progress, n_todo)

        def flush(name: str) -> None:
            if pending[name]:
                info = tables[name]
                _commit(store, name, pending[name], st.schema(int(np.prod(info["latent_shape"])),
                                                             cfg.data.latent_dtype, info["text_embeddings"],
                                                             bool(info.get("keep"))),
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
                    n_errors += len(errs)
                    first_errors.extend(errs[:max(0, 20 - len(first_errors))])
                    write_pids.add(int(batch["pid"][j]))
                    enc_rows.update(json.loads(batch["encoders"][j]))
                    if bar:
                        bar[0].update(bar[1], advance=n + len(errs))
                    if pending_rows[name] >= commit_every:
                        flush(name)
                if n_errors and n_errors / n_todo > cfg.data.max_error_rate:
                    raise UserError(f"{n_errors} samples failed to decode or encode (> data.max_error_rate = "
                                    f"{cfg.data.max_error_rate} of {n_todo}); first: {first_errors[0]}. Committed "
                                    "versions are intact; fix the inputs and re-run (only the missing rows are done).")
                if limit and written >= limit:
                    finished = False
                    break
            else:
                for name in list(pending):
                    flush(name)
        finally:
            if bar:
                bar[0].stop()
    st.write_manifest(store, manifest)
    for e in first_errors:
        log.warning("prepare: skipped %s", e)
    summary.update(actors, encoded=written, encode_errors=n_errors, tables=len(tables),
                   encoder_rows=encoder_counts(enc_rows, actors["encoder_actors"]) if n_todo else [],
                   encode_seconds=round(time.perf_counter() - t_enc, 2),
                   images_per_s=round(written / max(1e-9, time.perf_counter() - t_enc), 1),
                   write_pids=sorted(write_pids))
    return finished


def _decode_memory(stages, frames: int, batch_size: int) -> int:
    """Bytes a decode task holds: a batch of the largest bucket's ``frames`` frames, resized and cropped (x4 for
    the resize's intermediates), plus the worker process itself (256 MiB: Python, Arrow, Lance, PIL).

    Asking for it also keeps Ray Data from fusing the decode tasks into the encoder actors (it fuses a task
    stage into a following actor stage that asks for the same resources), so decoding runs on its own CPUs."""
    area = max(b.h * b.w for s in stages for b in s.buckets)
    return batch_size * frames * area * 3 * 4 + (256 << 20)


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


__all__ = ["prepare", "start_ray", "resize_cover_crop"]
