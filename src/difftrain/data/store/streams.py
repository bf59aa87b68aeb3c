"""The store's index and sample streams: a Lance table's index (``Table``: per sample its id, row and text length,
sorted by source then id) and a stream's epochs (``Stream``: each epoch a keyed permutation of the stream's ids,
``keyed_order``, evaluated at any position without materialising it). Pure functions of the ids and the seed:
``loader.StoreLoader`` plans its steps from them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from difftrain.config.stages import Stage
from difftrain.data.store import tables as st
from difftrain.errors import UserError

TASK_IDS = {"t2i": 0, "edit": 1, "keyframes": 2}


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & 0x7FFFFFFFFFFFFFFF


# The sample order of the loader state: "keyed-bijection/4" (an unbalanced Feistel permutation of each epoch's
# positions on a domain under 2n, computed for the positions a step takes; a step's per-slot draws from one
# generator). Format 3 walked a balanced Feistel network on up to 4n; format 2 drew the draws from a generator
# per slot; format 1 drew a full permutation of the stream on every step.
ORDER = "keyed-bijection/4"
_ROUNDS = 6


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit mixing function (splitmix64's finaliser) of x ^ key; uint64 arithmetic wraps."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keyed_order(n: int, key: list[int], positions: np.ndarray) -> np.ndarray:
    """Where ``positions`` land in a pseudo-random permutation of range(n) that is a pure function of ``key``:
    an unbalanced Feistel network on the smallest power of two >= n (its two halves, of ceil and floor of half
    the bits, each updated in turn from a keyed mix of the other), walked until it lands below n. The domain is
    under 2n, so under 2 walks on average whatever n. O(len(positions)), whatever n: no permutation is
    stored."""
    bits = max(2, (max(1, n) - 1).bit_length())
    lo_bits = bits // 2
    hi_mask, lo_mask = np.uint64((1 << (bits - lo_bits)) - 1), np.uint64((1 << lo_bits) - 1)
    shift = np.uint64(lo_bits)
    keys = np.random.default_rng(key).integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)
    cur = np.asarray(positions, dtype=np.uint64).copy()
    out = np.empty_like(cur)
    todo = np.arange(cur.size)
    with np.errstate(over="ignore"):
        while todo.size:
            hi, lo = cur[todo] >> shift, cur[todo] & lo_mask
            for r, k in enumerate(keys):
                if r % 2 == 0:
                    hi = hi ^ (_mix(lo, k) & hi_mask)
                else:
                    lo = lo ^ (_mix(hi, k) & lo_mask)
            v = (hi << shift) | lo
            done = v < np.uint64(n)
            out[todo[done]] = v[done]
            cur[todo[~done]] = v[~done]
            todo = todo[~done]
    return out.astype(np.int64)


@dataclass
class Stream:
    name: str                 # stage/bucket/task/source
    stage: Stage
    table: str
    bucket: str
    task: str
    source: str
    lo: int                   # the stream is positions lo.. of its table's index (sorted by source, then id)
    ids: np.ndarray           # its sorted sample ids: a view of the table's index, not a copy
    weight: float = 0.0
    epoch: int = 0
    pos: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, count: int, seed: int) -> np.ndarray:
        """Index positions (in the table) of the next ``count`` samples: each epoch is a keyed permutation of
        the stream (a function of seed, stage, stream and epoch), every sample once; the cost is that of
        ``count`` samples, not of the stream."""
        n = len(self)
        parts = []
        need = count
        while need:
            k = min(need, n - self.pos)
            key = [seed, 303, self.stage.index, _h64(self.name), self.epoch]
            parts.append(self.lo + keyed_order(n, key, np.arange(self.pos, self.pos + k)))
            self.pos += k
            need -= k
            if self.pos == n:
                self.epoch, self.pos = self.epoch + 1, 0
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _smallest_uint(top: int) -> type:
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return dt
    return np.uint64


class Table:
    """One Lance table's index: per sample its id, row and (with stored text states) text length, sorted by
    (source, sample id) so that each source is one contiguous span; 8 bytes an id, 4 a row (8 past 2^32 rows),
    2 a text length. Sources are read as Arrow dictionary codes, never as Python strings."""

    def __init__(self, info: st.TableInfo, uri: str, store_ds):
        import pyarrow.compute as pc

        self.info, self.uri, self.ds = info, uri, store_ds
        self.version = store_ds.version
        cols = ["sample_id", "source"] + (["txt_len"] if info.text_embeddings else [])
        # The index, fragment by fragment: a damaged fragment loses its rows (counted, logged), not the table.
        ids, codes, lens, rows = [], [], [], []
        names: dict[str, int] = {}
        self.lost, self.damaged = 0, []
        offset = 0
        for frag in store_ds.get_fragments():
            n = frag.count_rows()
            try:
                t = frag.to_table(columns=cols)
                if t.num_rows != n:
                    raise ValueError(f"{t.num_rows} rows read, {n} expected")
            except Exception as e:  # noqa: BLE001 - Lance/Arrow raise several types for a damaged file
                files = [f.path for f in frag.metadata.files]
                self.damaged.append(f"fragment {frag.fragment_id} ({', '.join(files)}): {str(e).splitlines()[0]}")
                self.lost += n
                offset += n
                continue
            ids.append(t["sample_id"].to_numpy())
            enc = pc.dictionary_encode(t["source"]).combine_chunks()
            local = np.array([names.setdefault(v, len(names)) for v in enc.dictionary.to_pylist()], dtype=np.int32)
            codes.append(local[enc.indices.to_numpy(zero_copy_only=False)] if len(local) else
                         np.zeros(n, np.int32))
            if info.text_embeddings:
                lens.append(t["txt_len"].to_numpy())
            rows.append(np.arange(offset, offset + n, dtype=np.int64))
            offset += n
        self.total = offset
        ids_all = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        code_all = np.concatenate(codes) if codes else np.zeros(0, np.int32)
        by_name = sorted(names)                                  # spans in source-name order
        rank = np.zeros(len(names), np.int32)
        for r, name in enumerate(by_name):
            rank[names[name]] = r
        code_all = rank[code_all] if len(code_all) else code_all
        order = np.lexsort((ids_all, code_all))
        del codes
        self.ids = ids_all[order]
        row_dt = np.uint32 if offset < 2**32 else np.int64
        self.rows = np.concatenate(rows)[order].astype(row_dt) if rows else np.zeros(0, row_dt)
        self.txt_len = None
        if lens:
            ln = np.concatenate(lens)[order]
            self.txt_len = ln.astype(_smallest_uint(int(ln.max()) if len(ln) else 0))
        sorted_codes = code_all[order]
        bounds = np.searchsorted(sorted_codes, np.arange(len(by_name) + 1))
        self.spans = {name: (int(bounds[r]), int(bounds[r + 1])) for r, name in enumerate(by_name)}
        del sorted_codes, code_all, order
        for name, (lo, hi) in self.spans.items():
            d = np.flatnonzero(np.diff(self.ids[lo:hi]) == 0)
            if d.size:
                raise UserError(f"store table {info.name}: sample id {int(self.ids[lo + d[0]])} of source {name!r} "
                                "appears twice (a damaged or doubly committed table); re-run 'difftrain prepare "
                                "--overwrite'")

    @property
    def index_bytes(self) -> int:
        """Bytes the index holds for the table's samples (ids, rows, text lengths)."""
        return self.ids.nbytes + self.rows.nbytes + (self.txt_len.nbytes if self.txt_len is not None else 0)
