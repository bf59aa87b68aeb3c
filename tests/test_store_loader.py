"""The store loader: one shape per global batch, the deterministic elastic stream (resume across world
sizes, in-process and with real gloo processes), epochs without repeats or gaps, the curriculum switch,
cache-key refusal, damaged fragments, the node-local cache, prefetch vs consumed state."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from difftrain.config.load import from_dict
from difftrain.data.store import tables as st
from difftrain.config.stages import parse_stages
from difftrain.data.store.loader import StoreLoader
from difftrain.errors import UserError

FACTOR = 4                      # pixel-unshuffle x4: 16 x 16 images are 4 x 4 latents of 48 channels
STAGES = [
    {"name": "low", "start_step": 0, "buckets": [{"size": [16, 16], "global_batch": 8},
                                                 {"size": [16, 24], "global_batch": 8, "micro_batch": 2}]},
    {"name": "high", "start_step": 6, "buckets": [[32, 32]], "global_batch": 4, "micro_cost": 32},
]
SIZES = {"low/16x16": 40, "low/16x24": 36, "high/32x32": 20}


def make_cfg(store: str, stages=None, **data) -> object:
    return from_dict({
        "run": {"seed": 3},
        "autoencoder": {"kind": "pixel-unshuffle", "factor": FACTOR},
        "data": {"source": "store", "store": store, "stages": stages or STAGES, "frames": 3, "prefetch": 3,
                 "caption_dropout": 0.2, **data},
        "train": {"global_batch": 8},
    })


def make_store(root: Path, cfg=None, shuffle_seed: int | None = None, tasks=("t2i", "edit", "keyframes")) -> str:
    """A store written directly: per (stage, bucket) SIZES[...] samples per task, latent values a function of
    the sample id (so content can be checked), rows optionally shuffled (same content, other order)."""
    store = str(root / "store")
    cfg = cfg or make_cfg(store)
    for stage in parse_stages(cfg):
        for b in stage.buckets:
            n = SIZES[f"{stage.name}/{b.name}"]
            for task in tasks:
                F = st.task_frames(task, 3)
                shape = [F, 3 * FACTOR * FACTOR, b.h // FACTOR, b.w // FACTOR]
                name = st.table_name(stage.name, b.name, task)
                info = st.TableInfo(name, stage.name, b.name, task, F, shape, st.cache_key(cfg, stage, b, task), False)
                ids = [zlib.crc32(f"{stage.name}/{b.name}/{task}/{i}".encode()) for i in range(n)]   # the same in every process
                if shuffle_seed is not None:
                    ids = list(np.random.default_rng(shuffle_seed).permutation(ids))
                lat = [np.full(shape, (i % 1000) / 1000.0, dtype=np.float32) for i in ids]
                src = ["broad" if i % 3 else "curated" for i in ids]
                st.write_table(store, info, {"sample_id": ids, "latents": lat, "source": src,
                                             "caption": [f"a red circle number {i % 7}" for i in ids]})
    return store


def tokenize(prompts):
    return {"ids": torch.tensor([[len(p) % 5 + 1, 1] for p in prompts])}


def ids_of(batches) -> list[int]:
    return [i for b in batches for i in b.sample_ids]


def run(loader, steps: int) -> list[list[int]]:
    return [ids_of(next(loader)) for _ in range(steps)]


def run_ranks(cfg, world: int, steps: int, state=None) -> tuple[list[list[int]], dict]:
    """``steps`` global batches read by ``world`` in-process ranks, concatenated in rank order."""
    loaders = [StoreLoader(cfg, tokenize, r, world) for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        out.append([i for ld in loaders for i in ids_of(next(ld))])
    state = loaders[0].state_dict()
    for ld in loaders:
        ld.close()
    return out, state


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("store"))


def test_batches_have_one_shape_and_balanced_micro_batches(store):
    cfg = make_cfg(store)
    loader = StoreLoader(cfg, tokenize)
    for step in range(10):
        batches = next(loader)
        shapes = {(b.grid, b.x0_BLC.shape[1:]) for b in batches}
        assert len(shapes) == 1, shapes
        F, H, W = batches[0].grid
        assert (H * FACTOR) % (2 * FACTOR) == 0 and (W * FACTOR) % (2 * FACTOR) == 0
        size = (H * FACTOR, W * FACTOR)
        total = sum(len(b) for b in batches)
        if step < 6:
            assert size in ((16, 16), (16, 24)) and total == 8
            if size == (16, 24):
                assert all(len(b) <= 2 for b in batches)
        else:         # micro_cost 32 tokens: a 32x32 t2i sample is 16 tokens -> 2 a micro-batch; keyframes 48 -> 1
            assert size == (32, 32) and total == 4
            assert all(len(b) * F * 16 <= 32 or len(b) == 1 for b in batches)
        # captions are padded to one length (the token limit) whatever the split: every micro-batch the same
        assert {b.tokens["ids"].shape[1] for b in batches} == {cfg.text.max_tokens}
    loader.close()


def test_latent_content_follows_the_sample_id(store):
    loader = StoreLoader(make_cfg(store), tokenize)
    from difftrain.data.batch import frames_of
    for _ in range(4):
        for b in next(loader):
            lat = frames_of(b.x0_BLC, b.grid)
            for j, sid in enumerate(b.sample_ids):
                want = torch.tensor((sid % 1000) / 1000.0).to(torch.bfloat16).float()
                assert torch.all(lat[j] == want)
    loader.close()


def test_resume_across_world_sizes_in_process(store):
    cfg = make_cfg(store)
    reference, _ = run_ranks(cfg, 1, 16)
    got, state = run_ranks(cfg, 1, 3)
    for world, steps in ((2, 4), (4, 5), (1, 4)):      # crosses the curriculum switch at step 6
        more, state = run_ranks(cfg, world, steps, state)
        got += more
    assert got == reference
    assert state["step"] == 16 and state["stage"] == "high"


def test_epochs_have_no_repeat_and_no_gap(store):
    """Over a stream's epoch every id appears once; the boundary batch takes the remainder and the next epoch's
    head."""
    cfg = make_cfg(store, stages=[{"name": "low", "start_step": 0, "buckets": [[16, 16]], "global_batch": 6}],
                   t2i_weight=1.0, edit_weight=0.0, keyframe_weight=0.0)
    loader = StoreLoader(cfg, tokenize)
    (stream,) = [s for s in loader.streams["low"] if s.source == "broad"] or [None]
    seen: list[int] = []
    per_stream: dict[str, list[int]] = {}
    for _ in range(30):
        plan_stream = None
        batches = next(loader)
        ids = ids_of(batches)
        for s in loader.streams["low"]:
            if set(ids) <= set(s.ids.tolist()):
                plan_stream = s.name
        per_stream.setdefault(plan_stream, []).extend(ids)
        seen += ids
    for name, ids in per_stream.items():
        stream = next(s for s in loader.streams["low"] if s.name == name)
        n = len(stream.ids)
        for e in range(len(ids) // n):
            epoch = ids[e * n:(e + 1) * n]
            assert sorted(epoch) == sorted(stream.ids.tolist()), f"{name} epoch {e} repeats or skips"
    loader.close()


def test_same_content_rewritten_gives_the_same_stream(tmp_path, store):
    other = make_store(tmp_path, make_cfg(str(tmp_path / "store")), shuffle_seed=5)
    a, _ = run_ranks(make_cfg(store), 1, 12)
    b, _ = run_ranks(make_cfg(other), 2, 12)
    assert a == b


def test_prefetched_batches_are_not_in_the_state(store):
    cfg = make_cfg(store, prefetch=4)
    loader = StoreLoader(cfg, tokenize)
    next(loader)
    next(loader)
    state = loader.state_dict()
    assert loader.planned > 2 and state["step"] == 2
    rest = run(loader, 3)
    again = StoreLoader(cfg, tokenize)
    again.load_state_dict(state)
    assert run(again, 3) == rest
    loader.close()
    again.close()


def test_cache_key_refusal_shows_the_difference(store):
    cfg = from_dict({"autoencoder": {"kind": "pixel-unshuffle", "factor": 2},
                     "data": {"source": "store", "store": store, "stages": [
                         {"name": "low", "start_step": 0, "buckets": [[16, 16]]}]}})
    with pytest.raises(UserError, match=r"autoencoder.factor: store has 4, this config has 2"):
        StoreLoader(cfg, tokenize)
    cfg = make_cfg(store, latent_dtype="fp32")
    with pytest.raises(UserError, match="latent_dtype: store has 'bf16', this config has 'fp32'"):
        StoreLoader(cfg, tokenize)
    with pytest.raises(UserError, match="no store there"):
        StoreLoader(make_cfg(str(Path(store).parent / "nothing")), tokenize)


def test_world_size_must_divide_every_bucket(store):
    with pytest.raises(UserError, match=r"bucket 16x16: global batch 8 is not divisible by 3"):
        StoreLoader(make_cfg(store), tokenize, 0, 3)
    # 8 on 8 ranks is fine for 'low' but 'high' has 4: the resume must be refused up front
    with pytest.raises(UserError, match=r"stage 'high', bucket 32x32: global batch 4 is not divisible by 8"):
        StoreLoader(make_cfg(store), tokenize, 0, 8)


def test_damaged_fragment_is_skipped_counted_then_fatal(tmp_path):
    store = str(tmp_path / "store")
    cfg = make_cfg(store, stages=[STAGES[0]], t2i_weight=1.0, edit_weight=0.0, keyframe_weight=0.0,
                   max_error_rate=0.0)
    stage = parse_stages(cfg)[0]
    for k, b in enumerate(stage.buckets):
        name = st.table_name("low", b.name, "t2i")
        shape = [1, 48, b.h // FACTOR, b.w // FACTOR]
        info = st.TableInfo(name, "low", b.name, "t2i", 1, shape, st.cache_key(cfg, stage, b, "t2i"), False)
        for part in range(4):                        # four fragments of 10 rows
            ids = list(range(100 * k + part * 10 + 1, 100 * k + part * 10 + 11))
            st.write_table(store, info, {"sample_id": ids, "latents": [np.zeros(shape, np.float32)] * 10,
                                         "caption": ["a red circle"] * 10})
    data = sorted((Path(store) / "tables" / "low" / "16x16" / "t2i.lance" / "data").glob("*.lance"),
                  key=lambda p: p.stat().st_mtime)
    raw = data[1].read_bytes()
    data[1].write_bytes(raw[: len(raw) // 3])               # a truncated fragment file
    with pytest.raises(UserError, match=r"10 of 80 rows are in damaged fragments.*low/16x16/t2i: fragment 1 \("
                                        + data[1].name):
        StoreLoader(cfg, tokenize)
    tolerant = StoreLoader(make_cfg(store, stages=[STAGES[0]], t2i_weight=1.0, edit_weight=0.0,
                                    keyframe_weight=0.0, max_error_rate=0.2), tokenize)
    seen = set()
    for _ in range(12):
        seen.update(ids_of(next(tolerant)))
    assert tolerant.errors == 10 and not seen & set(range(11, 21))      # the damaged rows are never served
    assert tolerant.tables["low/16x16/t2i"].lost == 10
    tolerant.close()


def test_node_cache_copies_ahead_and_reads_locally(store, tmp_path):
    """The fragments of the next steps are copied ahead of the reads; once installed, every row is read from the
    node-local copy; the sample stream is the uncached one."""
    cfg = make_cfg(store, cache_dir=str(tmp_path / "cache"), cache_gb=1.0, cache_lookahead=12)
    loader = StoreLoader(cfg, tokenize)
    reference, _ = run_ranks(make_cfg(store), 1, 14)
    assert run(loader, 10) == reference[:10]
    for _, f in loader.queue:                     # steps already being read
        f.result()
    before = loader.cache_stats()
    assert loader.cache.wait_idle(timeout=60), "the lookahead's fragments were not all installed"
    assert run(loader, 4) == reference[10:14]
    for _, f in loader.queue:
        f.result()
    after = loader.cache_stats()
    read = after["rows"] - before["rows"]
    assert read > 0 and after["rows_local"] - before["rows_local"] == read, "installed fragments read from the store"
    cached = {p.name.split("@")[0] for p in (tmp_path / "cache").glob("*.lance")}
    assert {"high__32x32__t2i", "high__32x32__edit", "high__32x32__keyframes"} <= cached
    assert after["units_copied"] == len(loader.cache.copied) == len(set(loader.cache.copied))
    loader.close()


def test_node_cache_evicts_least_recently_wanted(tmp_path):
    """A fragment that does not fit makes room by evicting the fragment wanted least recently, never one this
    process still wants; the folder stays under the limit."""
    from difftrain.data.store.node_cache import NodeCache

    store = str(tmp_path / "store")
    cfg = make_cfg(store, stages=[STAGES[0]])
    stage = parse_stages(cfg)[0]
    b = stage.buckets[0]
    name = st.table_name("low", b.name, "t2i")
    shape = [1, 48, b.h // FACTOR, b.w // FACTOR]
    info = st.TableInfo(name, "low", b.name, "t2i", 1, shape, st.cache_key(cfg, stage, b, "t2i"), False)
    for part in range(4):
        st.write_table(store, info, {"sample_id": list(range(part * 10, part * 10 + 10)),
                                     "latents": [np.random.default_rng(part).random(shape, np.float32)] * 10})
    uri = st.table_uri(store, name)
    ds = st.open_table(uri, name)
    files = [p for p in Path(uri).rglob("*") if p.is_file()]
    frag_bytes = max(p.stat().st_size for p in files if p.parent.name == "data")
    meta_bytes = sum(p.stat().st_size for p in files if "data" not in p.relative_to(uri).parts)
    cache_dir = tmp_path / "c"
    limit = meta_bytes + 2.5 * frag_bytes                      # room for two fragments
    cache = NodeCache(str(cache_dir), limit, {name: (uri, ds)})
    stems = [Path(f.metadata.files[0].path).stem for f in ds.get_fragments()]

    def installed() -> set[int]:
        return {i for i, s in enumerate(stems) if (cache_dir / f"low__{b.name}__t2i@v{ds.version}.lance" / "data" /
                                                   f"{s}.lance").exists()}

    cache.want([(name, 0), (name, 1)])
    assert cache.wait_idle(60) and installed() == {0, 1}
    cache.want([(name, 1)])
    cache.want([(name, 0)])                   # fragment 0 wanted again: now fragment 1 is the least recent
    cache.want([(name, 0), (name, 2)])
    assert cache.wait_idle(60) and installed() == {0, 2}
    used = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
    assert used <= limit and cache.stats()["evicted_units"] == 1
    cache.want([(name, 0), (name, 2), (name, 3)])  # no room without evicting a wanted fragment: not copied
    assert not cache.wait_idle(60) and installed() == {0, 2} and cache.stats()["not_fitting"] >= 1
    cache.close()


def _gloo_worker(rank: int, world: int, store: str, steps: int, state, port: int, out: str) -> None:
    import json

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = StoreLoader(make_cfg(store), tokenize, rank, world)
    if state is not None:
        loader.load_state_dict(state)
    mine = [ids_of(next(loader)) for _ in range(steps)]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        merged = [[i for r in range(world) for i in gathered[r][s]] for s in range(steps)]
        Path(out).write_text(json.dumps({"ids": merged, "state": loader.state_dict()}))
    loader.close()
    dist.destroy_process_group()


def test_resume_across_world_sizes_with_gloo_processes(store, tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    cfg = make_cfg(store)
    reference, _ = run_ranks(cfg, 1, 14)
    got, state = [], None
    for k, (world, steps) in enumerate(((1, 3), (2, 4), (4, 4), (1, 3))):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tmp_path / f"seg{k}.json"
        mp.spawn(_gloo_worker, args=(world, store, steps, state, port, str(out)), nprocs=world, join=True)
        seg = json.loads(out.read_text())
        got += seg["ids"]
        state = seg["state"]
    assert got == reference


def test_previews_of_a_store_run_use_its_own_captions_or_a_prompts_file(tmp_path):
    """Training previews of a store run show its own data's prompts (the store's text-to-image captions), or
    those of ``sample.prompts``; never the shapes world's unless that is the source."""
    from difftrain.errors import UserError
    from difftrain.sources import ConfiguredSource

    store = make_store(tmp_path)
    cfg = make_cfg(store)
    prompts = ConfiguredSource(cfg).preview_prompts(6)
    assert len(prompts) == 6 and all(p.startswith("a red circle number ") for p in prompts)
    listed = tmp_path / "prompts.txt"
    listed.write_text("a blue square\n\n  a green triangle  \n")
    cfg.sample.prompts = str(listed)
    assert ConfiguredSource(cfg).preview_prompts(6) == ["a blue square", "a green triangle"]
    listed.write_text("\n \n")
    with pytest.raises(UserError, match="sample.prompts = .*no prompts"):
        ConfiguredSource(cfg).preview_prompts(6)
    cfg.sample.prompts = str(tmp_path / "absent.txt")
    with pytest.raises(UserError, match="sample.prompts = .*cannot read"):
        ConfiguredSource(cfg).preview_prompts(6)
    cfg.sample.prompts = ""
    empty = make_store(tmp_path / "e", make_cfg(str(tmp_path / "e" / "store")), tasks=("edit",))
    with pytest.raises(UserError, match="no captions in its text-to-image tables"):
        ConfiguredSource(make_cfg(empty)).preview_prompts(6)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 1_000_000])
def test_each_epoch_is_a_keyed_permutation_computed_for_the_positions_taken(n):
    from difftrain.data.store.streams import keyed_order

    whole = keyed_order(n, [3, 303, 0, 7, 0], np.arange(n))
    assert np.array_equal(np.sort(whole), np.arange(n))                  # every id once per epoch
    part = keyed_order(n, [3, 303, 0, 7, 0], np.arange(n // 3, n // 3 + min(n, 2048) // 2))
    assert np.array_equal(part, whole[n // 3:n // 3 + min(n, 2048) // 2])  # any slice, without the rest
    if n >= 17:
        assert not np.array_equal(whole, keyed_order(n, [3, 303, 0, 7, 1], np.arange(n)))   # another epoch
        assert not np.array_equal(whole, np.arange(n))


def test_a_loader_state_of_the_earlier_sample_order_is_refused(tmp_path):
    from difftrain.errors import UserError

    store = make_store(tmp_path)
    loader = StoreLoader(make_cfg(store), tokenize, 0, 1, "cpu")
    try:
        state = loader.state_dict()
        assert state["order"] == "keyed-bijection/4"
        for old in ("keyed-bijection/3", "keyed-bijection/2", None):     # per-slot generators; a state written before 'order'
            st = dict(state, order=old) if old else {k: v for k, v in state.items() if k != "order"}
            with pytest.raises(UserError, match=f"orders samples as '{old or 'permutation/1'}'"):
                loader.load_state_dict(st)
    finally:
        loader.close()
