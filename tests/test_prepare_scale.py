"""``difftrain prepare`` at scale: curation as Ray Data operations (reproducing the recorded curation of the
shapes export exactly), near duplicates with bounded work, encoder actors, and a failed prepare that leaves the
previous record and table versions untouched. Real Ray (the session's local one, conftest) and real Lance."""

from __future__ import annotations

import json
import random
from pathlib import Path

import lance
import pyarrow.parquet as pq
import pytest

from difftrain.config import load_config, preset_path
from difftrain.data.store import tables as st
from difftrain.data.prepare.curate import hamming, read_record, record_extra
from difftrain.data.prepare.job import prepare
from difftrain.data.prepare.plan import encoder_plan
from difftrain.errors import UserError
from difftrain.shapes.export import export_shapes

from conftest import TINY

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "shapes_curation.parquet"
# Curation does not depend on the stages; one stage fed by the keyframe clips alone keeps the encoding short.
STAGES = ('[{name = "low", start_step = 0, buckets = [[32, 32], [32, 48], [48, 32]], global_batch = 8}, '
          '{name = "high", start_step = 6, buckets = [[64, 64], [64, 80], [80, 64]], global_batch = 8, '
          'micro_cost = 64}]')
ONE_STAGE = '[{name = "low", start_step = 0, buckets = [[48, 48]], global_batch = 8, mixture = {shapes_keyframes = 1}}]'


@pytest.fixture(scope="module")
def shapes_default(tmp_path_factory):
    """``difftrain shapes export shapes-export`` with its defaults, in a folder of its own (the preset's paths
    are relative to the working directory)."""
    root = tmp_path_factory.mktemp("default-export")
    export_shapes(root / "shapes-export")
    return root


def fixture_rows(export: Path) -> list[tuple[str, str, str]]:
    t = pq.read_table(FIXTURE).to_pylist()
    return [(r["source"], r["key"], r["reason"].replace("{export}", str(export))) for r in t]


def record_rows(path: str) -> list[tuple[str, str, str]]:
    t = read_record(path).to_pylist()
    return sorted((r["source"], r["key"], r["reason"]) for r in t)


def test_curation_of_the_shapes_export_reproduces_the_fixture(ray_local, shapes_default, monkeypatch):
    """The kept set and every reason, row for row, as the curation of the shapes export recorded before
    curation ran on Ray Data (tests/fixtures/shapes_curation.parquet). Facts are read in Ray tasks: this process
    cannot compute them."""
    from difftrain.data.prepare import curate

    def no_facts_here(sample):
        raise AssertionError("facts computed on the driver")

    monkeypatch.setattr(curate, "facts_for", no_facts_here)
    monkeypatch.chdir(shapes_default)
    cfg = load_config(preset_path("shapes-store"), [f"data.stages={ONE_STAGE}"])
    summary = prepare(cfg, progress=False)
    want = fixture_rows(shapes_default / "shapes-export")
    got = record_rows("shapes-store/curation.parquet")
    assert len(got) == len(want) == summary["inputs"] == 1212
    assert got == sorted(want)
    assert summary["kept"] == sum(r == "" for _, _, r in want) == 996
    parts = {p.name for p in Path("shapes-store/curation.parquet").iterdir()} - {"_difftrain.json"}
    assert parts and all(p.endswith(".parquet") for p in parts)                # parts written by Ray, and the extra
    assert json.loads(record_extra(read_record("shapes-store/curation.parquet"))["config"])["data"]["filters"]


def test_a_user_error_in_a_listing_task_comes_back_as_one_line(ray_local, tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "image": "x.png", "caption": "one"}\n'
                        '{"id": "a", "image": "y.png", "caption": "two"}\n')
    cfg = load_config(None, [f'data.sources=[{{name = "m", kind = "manifest", path = "{manifest}"}}]'])
    with pytest.raises(UserError) as e:
        prepare(cfg, dry_run=True, progress=False)
    assert str(e.value) == ("data.sources['m']: key 'a' appears twice; keys must be unique within a source "
                            "(they make the sample id)")


# --------------------------------------------------------------------------- encoder actors

def data_cfg(**kw):
    from difftrain.config.schema import DataConfig
    return DataConfig(**kw)


def test_encoder_plan_defaults_and_refusals():
    plan = encoder_plan(data_cfg(), cpus=16, gpus=0)
    assert plan == {"encoder_actors": 8, "decode_tasks": 8, "encoder_device": "cpu"}        # half the CPUs
    assert encoder_plan(data_cfg(), cpus=64, gpus=8) == {"encoder_actors": 8, "decode_tasks": 56,
                                                         "encoder_device": "gpu"}           # one per GPU
    assert encoder_plan(data_cfg(encoder_actors=3), cpus=4, gpus=0)["decode_tasks"] == 1
    assert encoder_plan(data_cfg(encoder_device="cpu"), cpus=8, gpus=2)["encoder_device"] == "cpu"
    with pytest.raises(UserError, match=r"^data\.encoder_device = 'gpu': the Ray cluster has no GPUs \(8 CPUs\); "
                                        r"set data\.encoder_device = 'cpu'"):
        encoder_plan(data_cfg(encoder_device="gpu"), cpus=8, gpus=0)
    with pytest.raises(UserError, match=r"^data\.encoder_actors = 4: a GPU actor takes one GPU and the Ray cluster "
                                        r"has 2; set at most 2"):
        encoder_plan(data_cfg(encoder_actors=4), cpus=8, gpus=2)
    with pytest.raises(UserError, match=r"^data\.encoder_actors = 2: .* has 2, which leaves none for decoding; "
                                        r"set at most 1"):
        encoder_plan(data_cfg(encoder_actors=2), cpus=2, gpus=0)


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-export")
    export_shapes(root, n=(48, 16, 8), sizes=(32, 64), frames=3)
    return root


def small_cfg(export: Path, store: Path, sources=("t2i", "edit", "keyframes"), *extra: str):
    specs = {"t2i": f'{{name = "shapes_t2i", kind = "folder", path = "{export}/t2i"}}',
             "edit": (f'{{name = "shapes_edit", kind = "manifest", task = "edit", '
                      f'path = "{export}/edit/manifest.jsonl"}}'),
             "keyframes": f'{{name = "shapes_keyframes", kind = "keyframes", path = "{export}/keyframes"}}'}
    return load_config(preset_path("shapes-store"), TINY + [
        "autoencoder.factor=8", f"data.sources=[{', '.join(specs[s] for s in sources)}]", f"data.store={store}",
        f"data.stages={STAGES}", "data.max_error_rate=0.05", *extra])


def test_a_cluster_without_gpus_refuses_gpu_actors_before_any_work(ray_local, small_export, tmp_path):
    cfg = small_cfg(small_export, tmp_path / "s", ("t2i",), "data.encoder_device=gpu")
    with pytest.raises(UserError) as e:
        prepare(cfg, progress=False)
    assert str(e.value).startswith("data.encoder_device = 'gpu': the Ray cluster has no GPUs")
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def slow_vae(tmp_path_factory):
    """A diffusers AutoencoderKL (x2, random weights) slow enough on one thread that encoding, not decoding,
    limits the rate, as a real autoencoder does."""
    import diffusers
    import torch

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(128, 256),
                                  layers_per_block=3, latent_channels=4, norm_num_groups=32).eval()
    path = tmp_path_factory.mktemp("slow-vae") / "vae"
    vae.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def two_actor_store(ray_local, small_export, slow_vae, tmp_path_factory):
    """A store prepared from the text-to-image source with two encoder actors: its config, summary, record
    rows and table versions as this first prepare left them."""
    store = tmp_path_factory.mktemp("two-actors") / "store"
    extra = ("data.encoder_actors=2", "autoencoder.kind=diffusers", f"autoencoder.path={slow_vae}")
    summary = prepare(small_cfg(small_export, store, ("t2i",), *extra), progress=False, batch_size=4)
    return store, extra, summary, record_rows(str(store / "curation.parquet")), versions_content(store)


def test_two_encoder_actors_each_encode_their_share(ray_local, two_actor_store):
    """The actor pool hands each batch to the least busy actor, so where encoding limits the rate both actors
    encode their share (where decoding limits it, one actor keeps up and takes most batches)."""
    _, _, summary, _, _ = two_actor_store
    assert summary["encoder_actors"] == 2 and summary["decode_tasks"] == ray_local.cluster_resources()["CPU"] - 2
    rows = summary["encoder_rows"]
    assert len(rows) == 2 and sum(rows) == summary["encoded"] > 0
    assert min(rows) >= 0.4 * summary["encoded"] / 2, rows                 # each at least 40% of its fair share


# --------------------------------------------------------------------------- failure atomicity

def versions_content(store: Path) -> dict[str, tuple[int, dict[int, bytes]]]:
    """Each table's current version and its rows (latents by sample id)."""
    out = {}
    for name in st.read_manifest(str(store))["tables"]:
        ds = lance.dataset(st.table_uri(str(store), name))
        out[name] = (ds.version, version_rows(store, name, ds.version))
    return out


def version_rows(store: Path, name: str, version: int) -> dict[int, bytes]:
    ds = lance.dataset(st.table_uri(str(store), name), version=version)
    ids = ds.to_table(columns=["sample_id"])["sample_id"].to_pylist()
    return {int(i): b.read() for i, b in zip(ids, ds.take_blobs("latents", indices=list(range(len(ids)))))}


def test_a_failed_prepare_leaves_the_previous_record_and_every_committed_version(two_actor_store, small_export):
    """A second prepare that fails while writing (a table path the store cannot hold: a worker's Lance write
    fails) leaves the first prepare's record and table versions as they were, and no staged record behind."""
    store, extra, first, record_before, before = two_actor_store
    assert first["encoded"] > 0 and before
    for bucket in ("32x32", "32x48", "48x32"):                 # every keyframe table of stage "low"
        p = store / "tables" / "low" / bucket / "keyframes.lance"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("not a Lance table")
    with pytest.raises(Exception, match="keyframes.lance"):
        prepare(small_cfg(small_export, store, ("t2i", "edit", "keyframes"), *extra), progress=False,
                commit_every=8, batch_size=8)
    assert record_rows(str(store / "curation.parquet")) == record_before
    for name, (version, rows) in before.items():
        assert version_rows(store, name, version) == rows, name
    assert [p.name for p in store.iterdir() if p.name.startswith(".")] == []     # no staged record left


# --------------------------------------------------------------------------- near duplicates on Ray

def skewed_hashes(seed: int = 0):
    """Ids and signed 64-bit hashes: a crowd of distinct hashes sharing their top 40 bits (one huge bucket of
    every band but the last), near pairs scattered through it, exact repeats, and random hashes."""
    rng = random.Random(seed)
    top = rng.getrandbits(40) << 24
    hashes = [top | rng.getrandbits(24) for _ in range(400)]
    hashes += [h ^ (1 << rng.randrange(64)) for h in hashes[:60]]              # near pairs, 1 bit apart
    hashes += hashes[:30]                                                      # exact repeats
    hashes += [rng.getrandbits(64) for _ in range(300)]
    ids = rng.sample(range(1 << 62), len(hashes))
    return ids, [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]


def all_pairs_greedy(ids, hashes, distance):
    """The rule over all pairs, brute force: each sample's keeper (-1 when kept)."""
    kept, keeper = [], {}
    for i in sorted(range(len(ids)), key=lambda i: ids[i]):
        hits = [ids[k] for k in kept if hamming(hashes[i], hashes[k]) <= distance]
        keeper[i] = min(hits) if hits else -1
        if not hits:
            kept.append(i)
    return [keeper[i] for i in range(len(ids))]


def test_near_dup_on_ray_is_the_in_memory_rule_with_bounded_comparisons(ray_local):
    import numpy as np
    import pyarrow as pa
    import ray.data

    from difftrain.data.prepare.near_dup import near_dup_dataset, near_dup_keepers

    ids, hashes = skewed_hashes()
    reasons = ["size: min_side" if i % 17 == 0 else "" for i in range(len(ids))]     # dropped before: left alone
    table = pa.table({"sample_id": pa.array(ids, pa.int64()), "phash": pa.array(hashes, pa.int64()),
                      "reason": reasons})
    alive = [i for i, r in enumerate(reasons) if not r]
    a_ids, a_hashes = [ids[i] for i in alive], [hashes[i] for i in alive]
    distance, window = 3, 8
    out, stats = near_dup_dataset(ray.data.from_arrow(table).repartition(8), distance, window)
    got = {r["sample_id"]: r["reason"] for r in out.take_all()}
    keepers, compared = near_dup_keepers(a_ids, a_hashes, distance, window)
    want = {ids[i]: reasons[i] for i in range(len(ids))}
    want.update({s: f"near_dup: {k}" for s, k in zip(a_ids, keepers.tolist()) if k >= 0})
    assert got == want                                           # the Ray job applies the in-memory rule exactly
    assert stats["rows"] == len(alive) and stats["comparisons"] == compared
    assert stats["comparisons_per_row"] <= (distance + 1) * window                 # bounded however skewed
    exact = all_pairs_greedy(a_ids, a_hashes, distance)
    should, found = {s for s, k in zip(a_ids, exact) if k >= 0}, {s for s, k in zip(a_ids, keepers) if k >= 0}
    assert len(should) > 60 and len(found & should) / len(should) >= 0.9       # recall of the dropped rows
    by_id = dict(zip(a_ids, a_hashes))
    for s, k in zip(a_ids, keepers.tolist()):        # a dropped sample names a kept one within the distance
        assert k < 0 or (k not in found and hamming(by_id[s], by_id[k]) <= distance)
    wide, _ = near_dup_keepers(a_ids, a_hashes, distance, window=len(a_ids))     # a window as large as any bucket
    assert np.array_equal(wide, np.asarray(exact))                              # is the all-pairs result
