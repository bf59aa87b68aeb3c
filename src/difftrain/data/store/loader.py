"""Training batches from the latent store: deterministic, stateful, elastic, asynchronous, cached.

**The plan.** A *stream* is (stage, bucket, task, source): the sorted sample ids of one source in one
table. Step s of the run is in the stage whose ``start_step`` it has passed; it draws one stream (by
the stage's mixture: source weights, or the config's task weights, shared among the streams of a
source or task in proportion to their sizes) with a generator seeded by (seed, s), and takes that
bucket's global batch from the stream's current epoch: a permutation of its ids seeded by (seed,
stage, stream, epoch). So the sequence of global batches is a pure function of (seed, stages, the
streams' ids, the global batch per bucket), every global batch has one shape, and samples are
addressed by id, never by row: a store rewritten with the same content gives the same stream.

**Epochs and the remainder.** Every id of a stream appears exactly once per epoch. When an epoch's
remainder is shorter than the global batch, the batch takes that remainder and the first ids of the
next epoch's permutation (nothing is dropped, nothing repeats within an epoch). Such a batch can hold an id
twice (the old epoch's tail and the new one's head); each slot of an id carries its repeat (``Batch.repeats``),
so the two draw their own noise and timestep. A stream smaller than its global batch cannot keep the
once-per-epoch promise and is left out, with a warning. Index and streams: ``streams.py``.

**Ranks.** Data rank r of D reads slice r of the global batch (D must divide every bucket's global batch
of the stages still to come), split into micro-batches of at most the bucket's cost-balanced size
(``Bucket.micro_for``). Per-example draws (caption dropout, which keyframes are given) are functions of
(seed, step, slot in the global batch), drawn as arrays from one generator per step; text is padded to one length per step whatever the split
(stored embeddings: the global batch's longest; captions: the encoder's token limit).

**State** (in checkpoints): steps consumed by the optimizer (not prefetched), each stream's (epoch,
position) at that point, the global batch per bucket and the table versions. Resuming on any world
size that divides the global batches continues the same sample sequence.

**Asynchronous.** Plans are made in order on the caller's thread (cheap: ids only); reading (Lance
``take`` by row), decoding bits and collating run in a thread pool ``data.prefetch`` steps ahead,
into pinned memory on GPU machines, so the trainer's copy is non-blocking.

**Location-aware.** With ``data.cache_dir``, the Lance fragments this rank reads in the next
``data.cache_lookahead`` steps (planned ahead: the plan is a pure function of the stream positions) are copied
in plan order to a node-local folder shared by the node's processes (``node_cache.py``: one copy per node, at
most ``data.cache_gb``, least recently wanted fragments evicted). Each read is split by fragment: rows of
installed fragments from the local copy, the others from the shared store, merged by sample id.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from difftrain.data.store import tables as st
from difftrain.data.batch import Batch, assemble_packed
from difftrain.config.stages import parse_stages
from difftrain.data.curriculum import stage_at
from difftrain.data.store.node_cache import Lookahead, NodeCache
from difftrain.data.store.streams import ORDER, Stream, Table
from difftrain.errors import UserError
from difftrain.models.text import TextEmbedding, pad_tokens, text_length

log = logging.getLogger("difftrain")

def keep_mask(keeps: list[bytes], frames: int, L: int) -> torch.Tensor | None:
    """The batch's loss mask (B, frames * L) from the rows' packed bits of their first (target) frame's L tokens;
    None when no row has one. Trailing zero bytes a transport dropped read as masked tokens, as they were."""
    if not any(keeps):
        return None
    out = torch.ones(len(keeps), frames * L, dtype=torch.bool)
    n = (L + 7) // 8
    for b, k in enumerate(keeps):
        if k:
            raw = np.frombuffer(bytes(k)[:n].ljust(n, b"\0"), dtype=np.uint8)
            out[b, :L] = torch.from_numpy(np.unpackbits(raw, count=L).astype(bool))
    return out


class StoreLoader:
    """Yields, per optimizer step, this data rank's micro-batches of the step's global batch."""

    def __init__(self, cfg, tokenize=None, rank: int = 0, num_ranks: int = 1, device: torch.device | str = "cpu"):
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")

        d = cfg.data
        self.cfg, self.seed, self.tokenize = cfg, cfg.run.seed, tokenize
        self.rank, self.num_ranks = rank, num_ranks
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.store = d.store
        self.stages = parse_stages(cfg, strict=True)
        self.manifest, infos = st.check_store(self.store, cfg, self.stages)
        self.latent_dtype = d.latent_dtype
        self.tables: dict[str, Table] = {}
        for name, info in infos.items():
            uri = st.table_uri(self.store, name)
            self.tables[name] = Table(info, uri, st.open_table(uri, name))
        lost = sum(t.lost for t in self.tables.values())
        total = sum(t.total for t in self.tables.values())
        for t in self.tables.values():
            for msg in t.damaged:
                log.warning("store table %s (%s): damaged %s; its rows are skipped", t.info.name, t.uri, msg)
        if lost and lost > d.max_error_rate * total:
            where = "; ".join(f"{t.info.name}: {m}" for t in self.tables.values() for m in t.damaged)
            raise UserError(f"store {self.store}: {lost} of {total} rows are in damaged fragments (> "
                            f"data.max_error_rate = {d.max_error_rate}): {where}. Re-run 'difftrain prepare' "
                            "(with --overwrite) to rewrite them.")
        self.empty_text = None
        if any(t.info.text_embeddings for t in self.tables.values()):
            from safetensors.torch import load_file
            self.empty_text = load_file(f"{self.store.rstrip('/')}/empty_text.safetensors")
        v = cfg.validation
        from difftrain.data.prepare.ingest import normalize_spec
        names = [normalize_spec(src).get("name") for src in d.sources if isinstance(src, dict)]
        if v.every and not v.source:
            raise UserError("validation.every > 0 with data.source = 'store' needs validation.source: the name of a "
                            f"[[data.sources]] entry held out from training ({', '.join(map(str, names)) or 'none'})")
        if v.source and names and v.source not in names:
            raise UserError(f"validation.source = {v.source!r}: no such entry in data.sources ({', '.join(names)})")
        self.streams = self._streams()
        self._cum = {}
        for stage, streams in self.streams.items():
            w = np.array([s.weight for s in streams])
            self._cum[stage] = np.cumsum(w / w.sum())
        self.step = 0
        self.lost = lost            # rows lost to damaged fragments (checked above against all rows)
        self.total_rows = total
        # The run's read-error budget, over every rank (``account_reads``, fed by the trainer's step reduction, the
        # same figures on every rank), saved and restored whole: rows unreadable when read, and rows asked for.
        self.read_errors = 0
        self.samples_read = 0
        self.last_unreadable = ""   # where this rank last met one (for the error message)
        # step -> whether this rank's first row of that step is to read as damaged: the trainer sets the fault
        # harness's hook here (``train.faults.unreadable_at``); None in normal runs
        self.fault_hook = None
        self._check_world(0)
        self.cache = (NodeCache(d.cache_dir, d.cache_gb * 1e9, {n: (t.uri, t.ds) for n, t in self.tables.items()})
                      if d.cache_dir else None)
        self._lookahead: Lookahead | None = None
        self.served = {"rows": 0, "rows_local": 0, "bytes": 0, "bytes_from_store": 0}
        self.pool = ThreadPoolExecutor(d.read_threads, thread_name_prefix="difftrain-read")
        self.queue: deque[tuple[dict, Future]] = deque()
        self.planned = 0                  # steps planned (>= self.step, the steps consumed)
        self.count_lock = threading.Lock()
        self._consumed = self._positions()

    # ---- streams ---------------------------------------------------------------------------------
    def _streams(self) -> dict[str, list[Stream]]:
        d = self.cfg.data
        task_weight = {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight}
        out: dict[str, list[Stream]] = {}
        for stage in self.stages:
            streams = []
            for name, table in sorted(self.tables.items()):
                info = table.info
                if info.stage != stage.name:
                    continue
                bucket = stage.bucket(info.bucket)
                for source, (lo, hi) in table.spans.items():
                    if stage.mixture and source not in stage.mixture or source == self.cfg.validation.source:
                        continue       # not in this stage's mixture, or the held-out validation split
                    sname = f"{name}/{source}"
                    if hi - lo < bucket.global_batch:
                        warnings.warn(f"stream {sname} has {hi - lo} samples, fewer than its bucket's global batch "
                                      f"{bucket.global_batch}: left out of the plan", stacklevel=2)
                        continue
                    streams.append(Stream(sname, stage, name, info.bucket, info.task, source, lo, table.ids[lo:hi]))
            groups: dict[str, int] = {}
            for s in streams:
                g = s.source if stage.mixture else s.task
                groups[g] = groups.get(g, 0) + len(s)
            for s in streams:
                g = s.source if stage.mixture else s.task
                s.weight = (stage.mixture[g] if stage.mixture else task_weight[s.task]) * len(s) / groups[g]
            streams = [s for s in streams if s.weight > 0]
            if not streams:
                raise UserError(f"stage {stage.name!r}: no stream of the store {self.store!r} has samples and a "
                                "positive weight (check data.stages' mixture and the tables prepare wrote)")
            out[stage.name] = streams
        return out

    def _check_world(self, step: int) -> None:
        current = stage_at(self.stages, step)
        for stage in self.stages[current.index:]:
            for b in stage.buckets:
                if b.global_batch % self.num_ranks:
                    raise UserError(f"stage {stage.name!r}, bucket {b.name}: global batch {b.global_batch} is not "
                                    f"divisible by {self.num_ranks} data-parallel ranks; run on a world size that "
                                    "divides every bucket's global batch")

    # ---- the plan (pure given the stream positions) ----------------------------------------------
    def _plan(self, step: int) -> dict:
        stage = stage_at(self.stages, step)
        streams = self.streams[stage.name]
        cum = self._cum[stage.name]
        u = np.random.default_rng([self.seed, 101, step]).random()
        s = streams[int(np.searchsorted(cum, u, side="right").clip(0, len(streams) - 1))]
        bucket = stage.bucket(s.bucket)
        at = s.take(bucket.global_batch, self.seed)
        table = self.tables[s.table]
        drop, targets = self._draws(step, len(at), table.info.frames, s.task)
        return {"step": step, "stage": stage.name, "stream": s.name, "table": s.table, "task": s.task,
                "bucket": bucket, "at": at, "ids": table.ids[at].tolist(), "drop": drop, "targets": targets}

    def _draws(self, step: int, n: int, frames: int, task: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-slot draws of one step from one generator seeded by (seed, step): whether the caption is dropped
        and which frames are targets (keyframes: all, or with probability ``keyframe_cond_prob`` a prefix or a
        random subset of 1..F-1 frames given). Slot j's values sit at index j of each array, so they depend on
        (seed, step, slot) only, whatever the world size; arrays, not a generator per slot."""
        rng = np.random.default_rng([self.seed, 202, step])
        drop = rng.random(n) < self.cfg.data.caption_dropout
        targets = np.zeros((n, frames), dtype=bool)
        targets[:, 0] = True
        if task == "keyframes":
            cond = rng.random(n) < self.cfg.data.keyframe_cond_prob
            given = rng.integers(1, max(2, frames), size=n)                 # frames given, 1..F-1
            prefix = rng.random(n) < 0.5
            rank = np.argsort(np.argsort(rng.random((n, frames)), axis=1), axis=1)  # a random order of frames
            where = np.where(prefix[:, None], np.arange(frames)[None, :], rank)
            targets = ~(cond[:, None] & (where < given[:, None]))
        return drop, targets

    def _positions(self) -> dict:
        return {s.name: [s.epoch, s.pos] for streams in self.streams.values() for s in streams}

    # ---- reading ---------------------------------------------------------------------------------
    def _table_ds(self, name: str):
        return self.tables[name]

    def _columns(self, table: Table) -> list[str]:
        return (["sample_id", "caption"] + (["txt", "txt_len", "pooled"] if table.info.text_embeddings else [])
                + (["keep"] if table.info.keep else []))

    def _take(self, table: Table, ds, rows_idx: list[int], buf: np.ndarray, slots: list[int], ids: list[int]):
        """Index columns of ``rows_idx`` by ``take``; their latents by ``take_blobs`` into ``buf[slots]``."""
        t = ds.take(rows_idx, columns=self._columns(table))
        for j, blob in zip(slots, ds.take_blobs("latents", indices=rows_idx)):
            with blob:
                view = memoryview(buf[j]).cast("B")
                if blob.readinto(view) != view.nbytes:
                    raise ValueError(f"sample {ids[j]}: latent blob shorter than {view.nbytes} bytes")
        return t

    def _rows(self, table: Table, ids: list[int], at: np.ndarray) -> dict[int, dict]:
        """Rows of the samples at index positions ``at`` (whose ids are ``ids``), keyed by sample id: index
        columns by ``take``, latents by ``take_blobs`` read straight into one buffer (no Python lists, one copy
        from the file). With a node cache, rows of installed fragments are read from the local copy (again from
        the store if that fails), the others from the shared store; the parts are merged in the plan's order."""
        import pyarrow as pa

        rows_idx = table.rows[at].astype(np.int64)
        bits = np.uint16 if self.latent_dtype == "bf16" else np.uint32
        values = int(np.prod(table.info.latent_shape))
        buf = np.empty((len(rows_idx), values), dtype=bits)
        local_ds, local = (self.cache.split(table.info.name, rows_idx) if self.cache is not None
                           else (None, None))
        parts = [(table.ds, np.arange(len(rows_idx)), False)]
        if local_ds is not None:
            parts = [(local_ds, np.flatnonzero(local), True), (table.ds, np.flatnonzero(~local), False)]
        got_parts, from_local = [], 0
        for ds, sel, is_local in parts:
            if not len(sel):
                continue
            args = (rows_idx[sel].tolist(), buf, sel.tolist(), ids)
            try:
                got_parts.append((sel, self._take(table, ds, *args)))
                from_local += len(sel) if is_local else 0
            except Exception as e:  # noqa: BLE001 - a local fragment evicted meanwhile: the store has it
                if not is_local:
                    raise
                self.cache.read_failed(table.info.name, e)
                got_parts.append((sel, self._take(table, table.ds, *args)))
        order = np.concatenate([sel for sel, _ in got_parts])
        t = pa.concat_tables([p for _, p in got_parts])
        if len(got_parts) > 1:
            t = t.take(pa.array(np.argsort(order)))
        n = t.num_rows
        if n == 0:
            return {}
        got = t["sample_id"].to_numpy()
        if got.tolist() != list(ids):
            raise RuntimeError(f"rows of {table.info.name} came back out of order")
        with self.count_lock:
            self.served["rows"] += n
            self.served["rows_local"] += from_local
            self.served["bytes"] += buf.nbytes
            self.served["bytes_from_store"] += (n - from_local) * buf.itemsize * values
        captions = t["caption"].to_pylist()
        rows = {int(got[i]): {"latents": buf[i], "caption": captions[i], "_buf": buf, "_i": i} for i in range(n)}
        if "keep" in t.column_names:
            for i, k in enumerate(t["keep"].to_pylist()):
                rows[int(got[i])]["keep"] = k or b""
        if "txt" in t.column_names:
            txt, pooled, lens = t["txt"].combine_chunks(), t["pooled"].combine_chunks(), t["txt_len"].to_numpy()
            for i in range(n):
                r = rows[int(got[i])]
                r["txt"] = txt[i].values.to_numpy(zero_copy_only=False)
                r["pooled"] = pooled[i].values.to_numpy(zero_copy_only=False)
                r["txt_len"] = int(lens[i])
        return rows

    def _read_rows(self, table: Table, ids: list[int], at: np.ndarray) -> dict[int, dict]:
        try:
            return self._rows(table, ids, at)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - fall back to row by row to find the damaged rows
            first = str(e).splitlines()[0]
        out = {}
        for i, a in zip(ids, at):
            try:
                out.update(self._rows(table, [i], np.asarray([a])))
            except Exception as e:  # noqa: BLE001
                log.warning("store table %s (%s): sample %d unreadable (%s); skipped", table.info.name, table.uri, i,
                            str(e).splitlines()[0] or first)
        return out

    def _build(self, plan: dict) -> list[Batch]:
        table = self._table_ds(plan["table"])
        bucket, ids, task = plan["bucket"], plan["ids"], plan["task"]
        share = bucket.global_batch // self.num_ranks
        lo = self.rank * share
        F = table.info.frames
        mb = bucket.micro_for(F, share)
        n_micro = -(-share // mb)
        bounds = [lo + (share * j) // n_micro for j in range(n_micro + 1)]
        mine = ids[lo:lo + share]
        rows = self._read_rows(table, mine, plan["at"][lo:lo + share])
        if mine and self.fault_hook is not None and self.fault_hook(plan["step"] + 1):
            rows.pop(mine[0], None)       # the fault harness: this rank's first row of the step reads as damaged
        missing = [i for i in mine if i not in rows]
        if missing:
            self.last_unreadable = f"table {table.info.name} ({table.uri}), sample ids {missing[:5]}"
            log.warning("store step %d: %d of this rank's %d rows unreadable (%s); the step goes on without them",
                        plan["step"] + 1, len(missing), len(mine), self.last_unreadable)
        lengths = self._text_lengths(table, plan)
        out = []
        for j in range(n_micro):
            slots = [s for s in range(bounds[j], bounds[j + 1]) if ids[s] in rows]
            if not slots:
                raise UserError(f"store table {table.info.name}: a whole micro-batch of step {plan['step']} is "
                                f"unreadable (sample ids {ids[bounds[j]:bounds[j + 1]][:5]}...)")
            out.append(self._collate(table, task, [rows[ids[s]] for s in slots], plan["drop"][slots],
                                     plan["targets"][slots], [ids[s] for s in slots], lengths))
        seen: dict[int, int] = {}
        repeats = []                          # each slot's repeat of its id in the global batch (0: the first)
        for i in ids:
            repeats.append(seen.get(i, 0))
            seen[i] = seen.get(i, 0) + 1
        if len(seen) < len(ids):
            for j in range(n_micro):
                slots = [s for s in range(bounds[j], bounds[j + 1]) if ids[s] in rows]
                out[j].repeats = [repeats[s] for s in slots]
        out[0].rows_asked, out[0].rows_unreadable = len(mine), len(missing)
        return out

    def account_reads(self, unreadable: int, asked: int) -> None:
        """A step's reads summed over every rank: the run's read-error budget, decided with the same figures on every
        rank (so every rank stops at the same step, or none). The budget is ``data.max_error_rate`` of the rows read
        so far, and never less than that share of the store's rows (the startup check's measure): one bad row in the
        first steps of a long run does not end it."""
        self.read_errors += int(unreadable)
        self.samples_read += int(asked)
        rate = self.cfg.data.max_error_rate
        if self.read_errors > rate * max(self.samples_read, self.total_rows):
            raise UserError(f"store {self.store}: {self.read_errors} of the {self.samples_read} samples read so far "
                            f"over every rank were unreadable (> data.max_error_rate = {rate} of "
                            f"max(rows read, the store's {self.total_rows} rows)); "
                            + (f"this rank's last: {self.last_unreadable}. " if self.last_unreadable else "")
                            + "Re-run 'difftrain prepare' to rewrite the damaged fragments.")

    def _text_lengths(self, table: Table, plan: dict) -> int:
        """Text length every micro-batch of the step is padded to, the same however the global batch is split:
        stored states, the ``text.padding`` rule's length for the global batch's longest (from the index: a rung
        of the ladder under 'masked', all ``max_tokens`` stored states under 'padded'); captions, the encoder's
        token limit (only this rank's captions are read)."""
        if table.info.text_embeddings:
            lens = table.txt_len[plan["at"]].astype(np.int64)
            empty = self.empty_text["txt"].shape[0] if self.empty_text is not None else 1
            longest = int(np.where(plan["drop"], empty, lens).max())
            return max(longest, text_length(longest, self.cfg.text.max_tokens, self.cfg.text.padding))
        return self.cfg.text.max_tokens

    def _collate(self, table: Table, task: str, rows: list[dict], drop: np.ndarray, targets: np.ndarray,
                 ids: list[int], txt_len: int) -> Batch:
        shape = table.info.latent_shape
        B = len(rows)
        first = rows[0].get("_i", -1)
        if all(r.get("_buf") is rows[0].get("_buf") and r.get("_i") == first + j for j, r in enumerate(rows)):
            bits = rows[0]["_buf"][first:first + B]             # consecutive rows of one read: a view, no copy
        else:
            bits = np.stack([r["latents"] for r in rows])
        F, C, h, w = shape
        # stored in token order: a reshape; bf16 stays bf16 (widened on the device)
        lat = st.from_bits(bits, self.latent_dtype, keep=True).reshape(B, F, (h // 2) * (w // 2), C * 4)
        prompts = ["" if d else (r["caption"] or "") for r, d in zip(rows, drop.tolist())]
        indices = list(range(F))
        batch = assemble_packed(lat, h, w, indices, torch.from_numpy(targets.copy()), {}, prompts, task,
                                [{"sample_id": i} for i in ids])
        batch.sample_ids = list(ids)
        batch.keep_BL = keep_mask([r.get("keep", b"") for r in rows], F, (h // 2) * (w // 2))
        if table.info.text_embeddings:
            batch.text = self._embeddings(rows, drop.tolist(), txt_len)
        elif self.tokenize is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batch.tokens = pad_tokens(self.tokenize(prompts), txt_len)
        if self.pin:
            batch = batch.pin_memory()
        return batch

    def _embeddings(self, rows: list[dict], drop: list[bool], length: int) -> TextEmbedding:
        dt = self.latent_dtype
        txts, pools, masks = [], [], []
        for r, dropped in zip(rows, drop):
            if dropped:
                t, p = self.empty_text["txt"], self.empty_text["pooled"]
            else:
                bits = np.uint16 if dt == "bf16" else np.uint32
                p = st.from_bits(np.asarray(r["pooled"], dtype=bits), dt)
                t = st.from_bits(np.asarray(r["txt"], dtype=bits), dt).reshape(int(r["txt_len"]), -1)
            pad = length - t.shape[0]
            masks.append(torch.arange(length) < t.shape[0])
            txts.append(torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad > 0 else t[:length])
            pools.append(p)
        return TextEmbedding(torch.stack(txts), torch.stack(pools), torch.stack(masks))

    # ---- iteration -------------------------------------------------------------------------------
    def _request_cache(self) -> None:
        """Post the next step to plan and the stream positions it starts from to the lookahead, which plans
        data.cache_lookahead steps from there in a thread of its own, on a copy of the streams (the plan is a
        pure function of their positions: the loader's state is untouched), and asks the node cache for the
        fragments this rank will read, first needed first. A resume posts other positions: it starts over."""
        if self.cache is None:
            return
        if self._lookahead is None:
            shadow = copy.copy(self)          # the same plan on streams of its own
            shadow.streams = {k: [dataclasses.replace(s) for s in v] for k, v in self.streams.items()}
            self._lookahead = Lookahead(self.cache, self.cfg.data.cache_lookahead, shadow, self._fragments_read)
        self._lookahead.post(self.planned, self._positions())

    def _fragments_read(self, plan: dict) -> list[tuple[str, int]]:
        """(table, fragment) this rank reads for ``plan``, in the order its rows meet them."""
        share = plan["bucket"].global_batch // self.num_ranks
        at = plan["at"][self.rank * share:(self.rank + 1) * share]
        return [(plan["table"], f) for f in self.cache.fragments(plan["table"], self.tables[plan["table"]].rows[at])]

    def _fill(self) -> None:
        while len(self.queue) < self.cfg.data.prefetch:
            plan = self._plan(self.planned)
            self.planned += 1
            after = {"step": self.planned, "positions": self._positions()}
            self.queue.append((after, self.pool.submit(self._build, plan)))
        self._request_cache()

    def __iter__(self) -> "StoreLoader":
        return self

    def __next__(self) -> list[Batch]:
        self._fill()
        after, fut = self.queue.popleft()
        batches = fut.result()
        self.step, self._consumed = after["step"], after["positions"]
        self._fill()
        return batches

    def cache_stats(self) -> dict:
        """Read and node-cache counters of this process: rows and bytes served (``bytes``: latents), the share of
        rows read from the node-local copy (``hit_rate``), bytes read from the shared store (fragments copied
        into the cache plus latents read directly) over bytes served, and the cache's own counters (copies,
        evictions, orphaned temporary copies removed, faults; ``disabled`` says why it stopped copying)."""
        with self.count_lock:
            out = dict(self.served)
        cache = self.cache.stats() if self.cache is not None else {"bytes_copied": 0, "disabled": "no data.cache_dir"}
        out.update(cache)
        out["store_bytes_read"] = out["bytes_from_store"] + cache["bytes_copied"]
        out["hit_rate"] = out["rows_local"] / out["rows"] if out["rows"] else 0.0
        out["store_bytes_read_over_bytes_served"] = out["store_bytes_read"] / out["bytes"] if out["bytes"] else 0.0
        return out

    @property
    def errors(self) -> int:
        """Per-sample faults so far: rows lost to damaged fragments and rows unreadable when read."""
        return self.lost + self.read_errors

    def close(self) -> None:
        for _, f in self.queue:
            f.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._lookahead is not None:
            self._lookahead.close()
        if self.cache is not None:
            self.cache.close()

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        positions = self._consumed
        return {"kind": "store", "order": ORDER, "step": self.step, "stage": stage_at(self.stages, self.step).name,
                "positions": positions,
                "global_batches": {f"{s.name}/{b.name}": b.global_batch for s in self.stages for b in s.buckets},
                "versions": {n: t.version for n, t in self.tables.items()}, "read_errors": self.read_errors,
                "samples_read": self.samples_read, "reads_counted": "once"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "store":
            raise UserError("the checkpoint's loader state is not a store loader's (it was trained with "
                            "data.source = 'shapes'); resume with the same data.source")
        if state.get("order", "permutation/1") != ORDER:
            raise UserError(f"the checkpoint's loader state orders samples as {state.get('order', 'permutation/1')!r}; "
                            f"this release orders them as {ORDER!r} (planning a step no longer draws a permutation "
                            "of the whole stream, nor a generator per slot), so the run would not continue its "
                            "sample stream: finish it with the release that started it, or start a new run directory")
        gbs = {f"{s.name}/{b.name}": b.global_batch for s in self.stages for b in s.buckets}
        if state["global_batches"] != gbs:
            raise UserError(f"the checkpoint's global batches per bucket {state['global_batches']} differ from this "
                            f"config's {gbs}: the data order would differ")
        for name, v in state.get("versions", {}).items():
            t = self.tables.get(name)
            if t is not None and t.version != v:
                log.warning("store table %s is at version %d, the checkpoint read version %d: the sample stream "
                            "continues by sample id (the same only if the content per id is the same)",
                            name, t.version, v)
        for f in self.queue:
            f[1].cancel()
        self.queue.clear()
        self.step = self.planned = int(state["step"])
        self._check_world(self.step)
        for streams in self.streams.values():
            for s in streams:
                s.epoch, s.pos = state["positions"].get(s.name, [0, 0])
        self._consumed = self._positions()
        # the run's totals over every rank (a checkpoint from before they were kept says rank 0's errors and no
        # reads: the budget's floor, the store's rows, then keeps one bad row from ending every later resume)
        self.read_errors = int(state.get("read_errors", 0))
        self.samples_read = int(state.get("samples_read", 0))
