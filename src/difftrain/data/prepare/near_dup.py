"""Near duplicates by perceptual hash, with bounded work per row: one rule for the in-memory filter
(``curate.apply_filters``) and for ``difftrain prepare`` on Ray Data.

The rule: in sample-id order, a sample whose 64-bit phash is within ``distance`` bits of an already kept
sample is dropped, its reason naming the smallest such kept id (so the outcome does not depend on the
input order). It is applied to the pairs the candidate search finds:

1. Samples with identical hashes form a group that the smallest id stands for. Its other members are at
   distance 0 from it, so they are dropped: naming it when it is kept, naming its keeper when it is dropped
   itself (exactly what the rule gives over all pairs). Skewed data (one hash shared by thousands of
   flat images) costs one sort here, not thousands of comparisons.
2. Distinct hashes are cut into ``distance + 1`` bands; two hashes within ``distance`` bits agree exactly on
   at least one band (pigeonhole), so only hashes sharing a (band, value) bucket are compared. Within a
   bucket sorted by hash (rotated so that the next band leads), each hash is compared with the next ``window``
   ones: a bucket of up to ``window + 1`` hashes is compared all pairs (exact), a larger one within the
   window, where hashes that also share the next band sit side by side. So a row costs at most
   ``(distance + 1) * window`` comparisons however skewed the hashes; pairs that only a large bucket holds,
   farther apart in its order than the window, are missed (recall against the all-pairs result is measured
   in bench/prepare_scale.py, docs/data-path.md).
3. The rule runs over the found pairs in id order (``greedy``).

On Ray (``near_dup_dataset``): a sort on the phash groups identical hashes, the bucket rows of the distinct
hashes are sorted by bucket and compared block by block, the rule runs in one task over the found pairs
(their number, not the rows', bounds it), and its result (dropped group representatives and their keepers)
is read by the tasks that write the reasons.
"""

from __future__ import annotations

from typing import Any

import numpy as np

WINDOW = 32                 # default comparisons per hash per band in a bucket
SHUFFLE_ROWS = 65536        # rows per block going into a sort
_U64 = (1 << 64) - 1


def bands(distance: int) -> list[tuple[int, int]]:
    """(shift, mask) of ``distance + 1`` bands covering the 64 bits as evenly as possible."""
    n = distance + 1
    edges = [round(64 * k / n) for k in range(n + 1)]
    return [(lo, (1 << (hi - lo)) - 1) for lo, hi in zip(edges[:-1], edges[1:])]


def _u64(hashes: Any) -> np.ndarray:
    return np.asarray(hashes, dtype=np.int64).view(np.uint64)


# --------------------------------------------------------------------------- the steps, on arrays

def hash_groups(ids: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """The smallest id among the samples sharing each sample's hash (its group's representative)."""
    ids = np.asarray(ids, dtype=np.int64)
    h = np.asarray(hashes, dtype=np.int64)
    if not len(ids):
        return ids.copy()
    order = np.lexsort((ids, h))
    hs = h[order]
    start = np.ones(len(hs), dtype=bool)
    start[1:] = hs[1:] != hs[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(len(hs)), 0))
    rep = np.empty_like(ids)
    rep[order] = ids[order][first]
    return rep


def _rotl(h: np.ndarray, s: int) -> np.ndarray:
    s %= 64
    return h if s == 0 else (h << np.uint64(s)) | (h >> np.uint64(64 - s))


def bucket_rows(ids: np.ndarray, hashes: np.ndarray, distance: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bucket key, id, hash) once per band for each distinct hash: key = band << 32 | the band's bits. The hash
    comes rotated so that the next band's bits lead (a rotation keeps Hamming distances): a bucket sorted by it
    puts hashes that also share the next band side by side, so a window finds them even in a crowded bucket."""
    ids = np.asarray(ids, dtype=np.int64)
    h = _u64(hashes)
    if distance == 0 or not len(ids):        # distinct hashes are never within 0 bits of each other
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    bs = bands(distance)
    keys, rotated = [], []
    for b, (shift, mask) in enumerate(bs):
        keys.append(((h >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64) | (b << 32))
        nxt_shift, nxt_mask = bs[(b + 1) % len(bs)]
        rotated.append(_rotl(h, 64 - (nxt_shift + nxt_mask.bit_length())).view(np.int64))
    n = len(keys)
    return np.concatenate(keys), np.tile(ids, n), np.concatenate(rotated)


def window_pairs(keys: np.ndarray, ids: np.ndarray, hashes: np.ndarray, distance: int,
                 window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pairs (smaller id, larger id) within ``distance`` bits among bucket rows, each compared with the next
    ``window`` rows of its bucket in hash order; returns (lo, hi, comparisons made)."""
    if not len(keys):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, 0
    order = np.lexsort((_u64(hashes), keys))
    k, i, h = keys[order], np.asarray(ids)[order], _u64(hashes)[order]
    lo, hi, compared = [], [], 0
    for off in range(1, min(window, len(k) - 1) + 1):
        same = k[:-off] == k[off:]
        n_same = int(same.sum())
        if not n_same:
            break                           # every bucket is shorter than this offset
        compared += n_same
        close = same & (np.bitwise_count(h[:-off] ^ h[off:]) <= distance)
        a, b = i[:-off][close], i[off:][close]
        lo.append(np.minimum(a, b))
        hi.append(np.maximum(a, b))
    if not lo:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, compared
    return np.concatenate(lo), np.concatenate(hi), compared


def greedy(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule over pairs (lo < hi): in id order, a node with a kept smaller neighbour is dropped, naming the
    smallest one. Returns (dropped ids ascending, their keepers)."""
    if not len(lo):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    order = np.lexsort((lo, hi))
    lo, hi = np.asarray(lo)[order].tolist(), np.asarray(hi)[order].tolist()
    keeper: dict[int, int] = {}
    j, n = 0, len(hi)
    while j < n:
        v, best = hi[j], None
        while j < n and hi[j] == v:
            u = lo[j]
            if u not in keeper and (best is None or u < best):     # u is decided: it is smaller than v
                best = u
            j += 1
        if best is not None:
            keeper[v] = best
    dropped = np.fromiter(keeper.keys(), dtype=np.int64, count=len(keeper))
    keepers = np.fromiter(keeper.values(), dtype=np.int64, count=len(keeper))
    order = np.argsort(dropped)
    return dropped[order], keepers[order]


def keepers_for(ids: np.ndarray, rep: np.ndarray, dropped: np.ndarray, keeper: np.ndarray) -> np.ndarray:
    """Each sample's keeper (-1: kept) from its group's representative and the dropped representatives
    (``dropped`` ascending)."""
    ids, rep = np.asarray(ids, dtype=np.int64), np.asarray(rep, dtype=np.int64)
    pos = np.searchsorted(dropped, rep)
    pos_ok = np.minimum(pos, max(len(dropped) - 1, 0))
    found = (pos < len(dropped)) & (dropped[pos_ok] == rep if len(dropped) else False)
    rep_keeper = np.where(found, keeper[pos_ok] if len(dropped) else -1, -1)
    return np.where(ids == rep, rep_keeper, np.where(found, rep_keeper, rep))


def near_dup_keepers(ids: Any, hashes: Any, distance: int, window: int = WINDOW) -> tuple[np.ndarray, int]:
    """The rule in memory: each sample's keeper id (-1 when kept) and the comparisons it took."""
    ids = np.asarray(ids, dtype=np.int64)
    hashes = np.asarray(hashes, dtype=np.int64)
    rep = hash_groups(ids, hashes)
    is_rep = rep == ids
    keys, bid, bh = bucket_rows(ids[is_rep], hashes[is_rep], distance)
    lo, hi, compared = window_pairs(keys, bid, bh, distance, window)
    dropped, keeper = greedy(lo, hi)
    return keepers_for(ids, rep, dropped, keeper), compared


# --------------------------------------------------------------------------- the steps, as Ray Data operations

def sorted_by(ds, key: str):
    """``ds`` sorted on ``key`` (a block then holds whole groups of equal keys), from blocks of SHUFFLE_ROWS rows.

    A sort's shuffle makes (input blocks) x (output blocks) objects, each tracked by the driver: from blocks of a
    few thousand rows, 10^6 rows cost the driver hundreds of MB; coalesced first, a few MB."""
    return ds.repartition(target_num_rows_per_block=SHUFFLE_ROWS, strict=True).sort(key)


def _with_groups(t):
    """(A block sorted by phash.) The representative of each alive row's hash group (-1 for dropped rows)."""
    import pyarrow as pa

    alive = np.asarray(t["reason"].to_numpy(zero_copy_only=False) == "")
    ids = t["sample_id"].to_numpy()
    rep = np.full(len(ids), -1, dtype=np.int64)
    rep[alive] = hash_groups(ids[alive], t["phash"].to_numpy()[alive])
    return t.append_column("phash_group", pa.array(rep, pa.int64()))


def _bucket_block(t, distance: int):
    """The bucket rows of this block's group representatives, and two tally rows (bucket -2: the alive rows,
    bucket -1: the distinct hashes, in their sample_id column)."""
    import pyarrow as pa

    ids, rep = t["sample_id"].to_numpy(), t["phash_group"].to_numpy()
    alive = rep >= 0
    is_rep = alive & (rep == ids)
    keys, bid, bh = bucket_rows(ids[is_rep], t["phash"].to_numpy()[is_rep], distance)
    return pa.table({"bucket": np.concatenate([[-2, -1], keys]).astype(np.int64),
                     "sample_id": np.concatenate([[alive.sum(), is_rep.sum()], bid]).astype(np.int64),
                     "phash": np.concatenate([[0, 0], bh]).astype(np.int64)})


def _pairs_block(t, distance: int, window: int):
    """(A block sorted by bucket: a bucket is never split.) The close pairs of its buckets, after three tally
    rows (lo -3, -2, -1: comparisons, alive rows, distinct hashes, in the hi column)."""
    import pyarrow as pa

    keys, ids, h = t["bucket"].to_numpy(), t["sample_id"].to_numpy(), t["phash"].to_numpy()
    rows = keys >= 0
    lo, hi, compared = window_pairs(keys[rows], ids[rows], h[rows], distance, window)
    tally = [compared, int(ids[keys == -2].sum()), int(ids[keys == -1].sum())]
    return pa.table({"lo": np.concatenate([[-3, -2, -1], lo]).astype(np.int64),
                     "hi": np.concatenate([tally, hi]).astype(np.int64)})


def _greedy_block(t):
    """(Every pair, one block.) Dropped representatives and their keepers, after one tally row
    (sample_id -1; keeper: the comparisons; rows, hashes)."""
    import pyarrow as pa

    lo, hi = t["lo"].to_numpy(), t["hi"].to_numpy()
    pairs = lo >= 0
    compared, rows, hashes = (int(hi[lo == k].sum()) for k in (-3, -2, -1))
    dropped, keeper = greedy(lo[pairs], hi[pairs])
    zeros = np.zeros(len(dropped), dtype=np.int64)
    return pa.table({"sample_id": np.concatenate([[-1], dropped]).astype(np.int64),
                     "keeper": np.concatenate([[compared], keeper]).astype(np.int64),
                     "rows": np.concatenate([[rows], zeros]).astype(np.int64),
                     "hashes": np.concatenate([[hashes], zeros]).astype(np.int64)})


_DROPPED_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _dropped(refs: list) -> tuple[np.ndarray, np.ndarray]:
    """The dropped representatives (ascending) and keepers, read once per worker process."""
    key = tuple(r.hex() for r in refs)
    if key not in _DROPPED_CACHE:
        import pyarrow as pa
        import ray

        t = pa.concat_tables(ray.get(refs))
        ids, keep = t["sample_id"].to_numpy(), t["keeper"].to_numpy()
        real = ids >= 0
        order = np.argsort(ids[real])
        _DROPPED_CACHE.clear()
        _DROPPED_CACHE[key] = (ids[real][order], keep[real][order])
    return _DROPPED_CACHE[key]


def _reasons_block(t, refs: list):
    """Alive rows whose keeper is another sample get ``near_dup: <keeper id>``."""
    import pyarrow as pa

    dropped, keeper = _dropped(refs)
    rep = t["phash_group"].to_numpy()
    ids = t["sample_id"].to_numpy()
    keep = keepers_for(ids, np.maximum(rep, 0), dropped, keeper)
    reason = t["reason"].to_numpy(zero_copy_only=False).astype(object)
    hit = (rep >= 0) & (keep >= 0)
    reason[hit] = [f"near_dup: {k}" for k in keep[hit].tolist()]
    t = t.set_column(t.schema.get_field_index("reason"), "reason", pa.array(reason, pa.string()))
    return t.drop_columns(["phash_group"])


def near_dup_dataset(ds, distance: int, window: int = WINDOW) -> tuple[Any, dict]:
    """``ds`` (rows with sample_id, phash, reason) with the near-duplicate reasons of its alive rows, and the
    work it took: {"rows", "hashes", "comparisons", "comparisons_per_row", "window"}."""
    grouped = (sorted_by(ds, "phash").map_batches(_with_groups, batch_size=None, batch_format="pyarrow")
               .materialize())
    buckets = grouped.map_batches(_bucket_block, fn_kwargs={"distance": distance}, batch_size=None,
                                  batch_format="pyarrow")
    resolved = (sorted_by(buckets, "bucket")
                .map_batches(_pairs_block, fn_kwargs={"distance": distance, "window": window}, batch_size=None,
                             batch_format="pyarrow")
                .repartition(1)
                .map_batches(_greedy_block, batch_size=None, batch_format="pyarrow")
                .materialize())
    tally = resolved.take(1)[0]          # the tally row leads the one block
    refs = resolved.to_arrow_refs()
    out = grouped.map_batches(_reasons_block, fn_kwargs={"refs": refs}, batch_size=None, batch_format="pyarrow")
    rows = int(tally["rows"])
    stats = {"rows": rows, "hashes": int(tally["hashes"]), "comparisons": int(tally["keeper"]),
             "comparisons_per_row": round(int(tally["keeper"]) / max(1, rows), 3), "window": window}
    return out, stats


__all__ = ["WINDOW", "SHUFFLE_ROWS", "sorted_by", "bands", "hash_groups", "bucket_rows", "window_pairs", "greedy", "keepers_for",
           "near_dup_keepers", "near_dup_dataset"]
