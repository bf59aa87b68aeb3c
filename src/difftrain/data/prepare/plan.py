"""What ``difftrain prepare`` encodes, and on how many actors.

- ``encoder_plan``: the encoder actors (``data.encoder_actors``, ``data.encoder_device``) and the decode tasks
  beside them, from the Ray cluster's resources; bad requests are refused in one line naming the key.
- The table rows of the kept samples, as Ray Data map tasks over the curation record: one row per stage whose
  mixture names the sample's source, in the bucket nearest its aspect ratio, each marked with whether its
  table already holds the sample id (read in the task from the table's Lance version pinned at the start).
- Per-block tallies of rows per table, which the driver sums.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from difftrain.data.store import tables as st
from difftrain.errors import UserError

PLAN_COLUMNS = ["sample_id", "source", "key", "task", "refs", "caption", "scores", "width", "height", "reason", "mask"]


def encoder_plan(data, cpus: float, gpus: float) -> dict[str, Any]:
    """Encoder actors and decode tasks for a cluster of ``cpus`` CPUs and ``gpus`` GPUs.

    GPU actors (``encoder_device`` "gpu", or "auto" on a cluster with GPUs) take one GPU and one CPU each,
    one per GPU unless ``encoder_actors`` says fewer. CPU actors take one CPU each and run torch on one
    thread; by default half the CPUs, so the other half decode and write. Decode tasks get the CPUs the
    actors leave."""
    device, n = data.encoder_device, data.encoder_actors
    cpus_i, gpus_i = int(cpus), int(gpus)
    if device == "gpu" and gpus_i < 1:
        raise UserError(f"data.encoder_device = 'gpu': the Ray cluster has no GPUs ({cpus_i} CPUs); set "
                        "data.encoder_device = 'cpu' (or 'auto'), or join a cluster with GPUs (--ray-address)")
    use_gpu = device == "gpu" or (device == "auto" and gpus_i >= 1)
    if use_gpu:
        if n > gpus_i:
            raise UserError(f"data.encoder_actors = {n}: a GPU actor takes one GPU and the Ray cluster has {gpus_i}; "
                            f"set at most {gpus_i} (0: one per GPU), or data.encoder_device = 'cpu'")
        n = n or gpus_i
    else:
        if cpus_i < 2:
            raise UserError(f"the Ray cluster has {cpus_i} CPU: encoding on CPUs needs one for an encoder actor "
                            "and one for decoding; join a larger cluster (--ray-address)")
        if n >= cpus_i:
            raise UserError(f"data.encoder_actors = {n}: a CPU actor takes one CPU and the Ray cluster has {cpus_i}, "
                            f"which leaves none for decoding; set at most {cpus_i - 1} (0: half the CPUs)")
        n = n or max(1, cpus_i // 2)
    return {"encoder_actors": n, "decode_tasks": max(1, cpus_i - n), "encoder_device": "gpu" if use_gpu else "cpu"}


# --------------------------------------------------------------------------- table rows (Ray tasks)

_EXISTING: dict[tuple[str, int], np.ndarray] = {}


def _existing_ids(uri: str, version: int) -> np.ndarray:
    """The sample ids of a table version, sorted; read once per worker process."""
    if (uri, version) not in _EXISTING:
        import lance

        ids = lance.dataset(uri, version=version).to_table(columns=["sample_id"])["sample_id"].to_numpy()
        _EXISTING[(uri, version)] = np.sort(ids)
    return _EXISTING[(uri, version)]


def table_rows(t, stages: list, frames: int, latent_dtype: str, store: str, versions: dict[str, int]):
    """The table rows of this block's kept samples, each with ``exists`` (its table holds the id already)."""
    import pyarrow as pa

    from difftrain.data.curriculum import assign_bucket

    out: dict[str, list] = {k: [] for k in ("sample_id", "table", "source", "key", "caption", "scores", "refs",
                                            "mask", "h", "w", "patch", "crop",
                                            "latent_dtype")}
    for r in t.to_pylist():
        if r["reason"]:
            continue
        for stage in stages:
            if stage.mixture and r["source"] not in stage.mixture:
                continue
            b = assign_bucket(stage.buckets, r["width"], r["height"])
            refs = list(r["refs"])
            out["sample_id"].append(r["sample_id"])
            out["table"].append(st.table_name(stage.name, b.name, r["task"]))
            out["source"].append(r["source"])
            out["key"].append(r["key"])
            out["caption"].append(r["caption"] or "")
            out["scores"].append(r["scores"])
            # the store keeps an edit's target first, its reference second (RoPE index 0, 1)
            out["refs"].append(refs[::-1] if r["task"] == "edit" else refs)
            out["mask"].append(r.get("mask") or "")
            out["h"].append(b.h)
            out["patch"].append(b.patch)
            out["w"].append(b.w)
            out["crop"].append(stage.crop)
            out["latent_dtype"].append(latent_dtype)
    ids = np.asarray(out["sample_id"], dtype=np.int64)
    tables = np.asarray(out["table"], dtype=object)
    exists = np.zeros(len(ids), dtype=bool)
    for name in set(out["table"]) & set(versions):
        rows = tables == name
        exists[rows] = np.isin(ids[rows], _existing_ids(st.table_uri(store, name), versions[name]))
    cols: dict[str, Any] = dict(out, sample_id=pa.array(ids, pa.int64()), exists=pa.array(exists))
    cols["refs"] = pa.array(out["refs"], pa.list_(pa.string()))
    cols["h"] = pa.array(out["h"], pa.int32())
    cols["patch"] = pa.array(out["patch"], pa.int32())
    cols["w"] = pa.array(out["w"], pa.int32())
    return pa.table(cols)


def _table_tally_block(t):
    import pyarrow as pa

    rows, todo = Counter(t["table"].to_pylist()), Counter()
    for name, exists in zip(t["table"].to_pylist(), t["exists"].to_pylist()):
        todo[name] += not exists
    names = sorted(rows)
    return pa.table({"table": names, "rows": pa.array([rows[n] for n in names], pa.int64()),
                     "todo": pa.array([todo[n] for n in names], pa.int64())})


def table_tally(planned) -> dict[str, list[int]]:
    """{table: [kept rows, rows still to encode]}, summed on the driver from per-block tallies."""
    total: dict[str, list[int]] = {}
    for b in planned.map_batches(_table_tally_block, batch_size=None, batch_format="pyarrow").iter_batches(
            batch_size=None, batch_format="pyarrow"):
        for name, rows, todo in zip(b["table"].to_pylist(), b["rows"].to_pylist(), b["todo"].to_pylist()):
            acc = total.setdefault(name, [0, 0])
            acc[0] += rows
            acc[1] += todo
    return total


def missing_rows(t):
    import pyarrow.compute as pc
    return t.filter(pc.invert(t["exists"])).drop_columns(["exists"])


def table_versions(store: str, names: list[str]) -> dict[str, int]:
    """The current Lance version of each of ``names`` that exists (committed, named in the manifest or not)."""
    import lance

    out = {}
    for name in names:
        try:
            out[name] = lance.dataset(st.table_uri(store, name)).version
        except Exception:  # noqa: BLE001 - no dataset (yet)
            continue
    return out


def encoder_counts(rows_by_pid: Counter, actors: int) -> list[int]:
    """Rows encoded per actor, largest first (an actor that encoded nothing counts 0)."""
    counts = sorted(rows_by_pid.values(), reverse=True)
    return counts + [0] * max(0, actors - len(counts))


__all__ = ["PLAN_COLUMNS", "encoder_plan", "table_rows", "table_tally", "missing_rows", "table_versions",
           "encoder_counts"]
