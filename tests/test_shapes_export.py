"""The shapes world exported as files: layout, determinism, aspect canvases, and the whole curation path
(ingest every kind -> facts -> filters) dropping each planted fault for the expected reason."""

import json

import numpy as np
import pytest
from PIL import Image

from difftrain.data.prepare.curate import apply_filters, facts_for, hamming, read_record, reason_counts, write_record
from difftrain.data.prepare.ingest import iter_source
from difftrain.shapes.world import ShapesWorld
from difftrain.shapes.export import (DEGRADED_KINDS, NEAR_DUP_MAX_BITS, SOURCE_NAMES, SPECIAL_KINDS,
                                          canvas_size, centre_crop, export_shapes, export_sources, widen)

SEED = 3
N = (120, 30, 15)
FILTERS = [
    {"kind": "size", "min_side": 32},
    {"kind": "caption", "min_words": 3, "max_words": 40},
    {"kind": "score", "column": "quality", "min": 0.5},
    {"kind": "exact_dup"},
]
EXPECTED = {"blur": "score: quality < 0.5", "noise": "score: quality < 0.5", "wrong_caption": "score: quality < 0.5",
            "tiny": "size: min_side", "empty_caption": "caption: empty", "missing_sidecar": "caption: missing sidecar",
            "non_utf8": "caption: not UTF-8"}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes") / "ds"
    summary = export_shapes(out, seed=SEED, n=N)
    return out, summary


@pytest.fixture(scope="module")
def curated(export):
    out, summary = export
    samples = [s for spec in export_sources(out) for s in iter_source(spec)]
    facts = [facts_for(s) for s in samples]
    return samples, facts


def test_layout_counts_and_export_json(export):
    out, summary = export
    assert json.loads((out / "export.json").read_text()) == summary
    counts = summary["counts"]
    assert counts == {k: len(v) for k, v in summary["variants"].items()}
    n_t2i, n_edit, n_key = N
    assert summary["samples"] == {"t2i": 90 + 2, "t2i_shards": 30, "edit": n_edit, "keyframes": n_key}
    assert sum(counts.values()) == n_t2i + 2 + n_edit + n_key  # every example once, plus the two copies
    assert sum(counts[k] for k in DEGRADED_KINDS) == round(0.15 * n_t2i) + round(0.15 * n_edit) + round(0.15 * n_key)
    assert all(counts[k] >= 1 for k in DEGRADED_KINDS + SPECIAL_KINDS)
    assert sorted(p.name for p in (out / "t2i").iterdir()) == ["extra", "part0", "part1", "part2", "part3"]
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["t2i-000.tar", "t2i-001.tar"]
    assert len(list((out / "t2i").rglob("*.png"))) == 92
    assert sorted(p.name for p in (out / "edit" / "e_000000").iterdir()) == [
        "instruction.txt", "scores.json", "source.png", "target.png"]
    assert sorted(p.name for p in (out / "keyframes" / "k_000000").iterdir()) == [
        "caption.txt", "frame_000.png", "frame_001.png", "frame_002.png", "scores.json"]
    rows = [json.loads(line) for line in (out / "edit" / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == n_edit and set(rows[0]) == {"id", "source", "target", "instruction", "quality"}
    bad = {v["key"] for k in DEGRADED_KINDS for v in summary["variants"][k] if v["source"] == SOURCE_NAMES["edit"]}
    for r in rows:
        assert (r["quality"] < 0.3) if r["id"] in bad else (0.8 <= r["quality"] <= 1.0), r


def test_export_is_deterministic_for_a_seed(tmp_path):
    small = dict(n=(40, 6, 4), sizes=(32, 48))
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    export_shapes(a, seed=1, **small)
    export_shapes(b, seed=1, **small)
    export_shapes(c, seed=2, **small)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "export.json").read_text() != (c / "export.json").read_text()


def test_canvas_sizes_and_widen():
    """Margins are whole 16-pixel tokens on each side, so the scene sits on the square canvas's token grid."""
    assert canvas_size(48, 1.0) == (48, 48)
    assert canvas_size(48, 5 / 3) == (80, 48) and canvas_size(48, 3 / 5) == (48, 80)
    assert canvas_size(96, 5 / 3) == (160, 96) and canvas_size(96, 4 / 3) == (128, 96)
    assert canvas_size(48, 4 / 3) == (80, 48)                   # a half-token margin is rounded up to a token
    assert canvas_size(48, 4 / 3, align=8) == (64, 48)          # the earlier half-token layout
    for size, aspect in ((48, 5 / 3), (48, 3 / 5), (96, 5 / 3), (96, 4 / 3), (64, 2.0)):
        w, h = canvas_size(size, aspect)
        assert (w - size) % 32 == 0 and (h - size) % 32 == 0    # 16 px a side, whole tokens
    img = ShapesWorld(0, size=48).t2i(5)[0]
    wide = widen(img, 5 / 3)
    assert wide.shape == (48, 80, 3)
    assert (wide[:, :16] == img[0, 0]).all() and (wide[:, -16:] == img[0, 0]).all()
    assert np.array_equal(centre_crop(wide), img) and np.array_equal(centre_crop(widen(img, 3 / 5)), img)


def test_clean_images_are_the_world_scene_on_a_widened_canvas(export):
    out, summary = export
    seen_shapes = set()
    worlds = {s: ShapesWorld(SEED, size=s, frames=3, motion="across") for s in (48, 96)}
    for v in summary["variants"]["clean"]:
        if v["source"] != SOURCE_NAMES["t2i"]:
            continue
        i = int(v["key"].rsplit("_", 1)[1])
        img = np.asarray(Image.open(out / "t2i" / (v["key"] + ".png")).convert("RGB"))
        h, w = img.shape[:2]
        side = min(h, w)
        assert side in (48, 96) and (h == w or (max(h, w) - side) % 32 == 0)
        seen_shapes.add((w, h))
        world_img, caption, _ = worlds[side].t2i(i)
        assert np.array_equal(centre_crop(img), world_img), v["key"]
        side_json = json.loads((out / "t2i" / (v["key"] + ".json")).read_text())
        assert side_json["caption"] == caption and 0.8 <= side_json["quality"] <= 1.0
    assert seen_shapes == {(48, 48), (80, 48), (48, 80), (96, 96), (160, 96), (96, 160)}
    for v in summary["variants"]["wrong_caption"]:
        if v["source"] == SOURCE_NAMES["t2i"]:
            i = int(v["key"].rsplit("_", 1)[1])
            side_json = json.loads((out / "t2i" / (v["key"] + ".json")).read_text())
            assert side_json["caption"] != worlds[48].prompt("t2i", i) and side_json["quality"] < 0.3


def test_edit_folder_and_manifest_describe_the_same_triples(export):
    out, _ = export
    (folder_spec,) = [s for s in export_sources(out, edit="folder") if s["kind"] == "edit"]
    (manifest_spec,) = [s for s in export_sources(out) if s["name"] == SOURCE_NAMES["edit"]]
    by_folder = {s.key: s for s in iter_source(folder_spec)}
    by_manifest = {s.key: s for s in iter_source(manifest_spec)}
    assert sorted(by_folder) == sorted(by_manifest) and len(by_folder) == N[1]
    for key, s in by_folder.items():
        m = by_manifest[key]
        assert (s.refs, s.caption, s.scores, s.task) == (m.refs, m.caption, m.scores, "edit")


def test_curation_drops_every_planted_fault_for_its_reason_and_keeps_clean_examples(export, curated, tmp_path):
    out, summary = export
    samples, facts = curated
    assert {s.source for s in samples} == set(SOURCE_NAMES.values())
    assert len(samples) == sum(summary["samples"].values())
    outcomes = apply_filters(samples, facts, FILTERS)
    result = {(s.source, s.key): (s, f, r) for s, f, (_, r) in zip(samples, facts, outcomes)}
    assert len(result) == len(samples)
    dup_members = {(p["source"], k) for p in summary["pairs"]["exact_dup"] for k in (p["original"], p["copy"])}
    for kind, expected in EXPECTED.items():
        for v in summary["variants"][kind]:
            assert result[(v["source"], v["key"])][2] == expected, (kind, v)
    for v in summary["variants"]["truncated"]:
        reason = result[(v["source"], v["key"])][2]
        assert reason.startswith("decode: image: ") and "truncated" in reason, reason
    for v in summary["variants"]["clean"] + summary["variants"]["near_dup"]:
        if (v["source"], v["key"]) not in dup_members:
            assert result[(v["source"], v["key"])][2] == "", v
    for p in summary["pairs"]["exact_dup"]:
        a, b = result[(p["source"], p["original"])], result[(p["source"], p["copy"])]
        assert a[1].sha256 == b[1].sha256
        keep, drop = sorted([a, b], key=lambda x: x[0].sample_id)
        assert keep[2] == "" and drop[2] == f"exact_dup: {keep[0].sample_id}"
    counts = reason_counts(outcomes)
    c = summary["counts"]
    assert counts["score: quality < 0.5"] == sum(c[k] for k in DEGRADED_KINDS)
    assert counts["exact_dup"] == c["exact_dup"] and counts["decode"] == c["truncated"]
    # Originals of both duplicate kinds count as clean; each exact pair keeps one of its two members.
    assert counts["kept"] == c["clean"] + c["near_dup"]
    path = tmp_path / "record.parquet"
    write_record(path, samples, facts, outcomes, extra={"filters": FILTERS})
    table = read_record(path)
    assert table.num_rows == len(samples)
    assert table.column("outcome").to_pylist().count("kept") == counts["kept"]


def test_near_duplicates_are_within_a_few_bits_and_caught(export, curated):
    """The shapes world is phash-degenerate (one shape on flat grey: many different scenes share a
    hash), so a near_dup filter also drops clean scenes; what must hold is that every planted copy
    is near its original and that each pair loses a member to a kept sample within the distance."""
    out, summary = export
    samples, facts = curated
    d = NEAR_DUP_MAX_BITS
    outcomes = apply_filters(samples, facts, FILTERS + [{"kind": "near_dup", "distance": d}])
    result = {(s.source, s.key): (s, f, r) for s, f, (_, r) in zip(samples, facts, outcomes)}
    by_id = {s.sample_id: (s, f, r) for s, f, (_, r) in zip(samples, facts, outcomes)}
    assert summary["pairs"]["near_dup"]
    for p in summary["pairs"]["near_dup"]:
        a, b = result[(p["source"], p["original"])], result[(p["source"], p["copy"])]
        assert a[1].sha256 != b[1].sha256 and hamming(a[1].phash, b[1].phash) == p["distance"] <= d
        dropped = [x for x in (a, b) if x[2].startswith("near_dup: ")]
        assert dropped, p
        for x in dropped:
            keeper = by_id[int(x[2].split(": ")[1])]
            assert keeper[2] == "" and hamming(keeper[1].phash, x[1].phash) <= d


def test_an_export_sized_for_a_curriculum_puts_scenes_where_its_stages_read_them(tmp_path):
    """``export_plan`` of the shapes-store preset (32-pixel buckets for its first 1,000 of 4,000 steps, then
    48-pixel ones): scenes split between the sizes as the stages' samples are (1/4, 3/4), each size placed only at
    its own buckets' aspects, so every clean image is on the canvas of a bucket of the curriculum."""
    from difftrain.config import load_config, preset_path
    from difftrain.shapes.export import export_plan

    cfg = load_config(preset_path("shapes-store"), [])
    plan = export_plan(cfg, epochs=4)
    assert plan["sizes"] == (32, 48) and plan["size_weights"] == (0.25, 0.75)
    assert plan["aspects_by_size"] == {32: (0.5, 1.0, 2.0), 48: (0.6, 1.0, 1.666667)}
    # samples of a task over the run / epochs / the kept fraction: 4,000 x 32 x 0.3 / 4 / 0.8075 keyframe clips
    assert plan["n"][2] == int(np.ceil(4000 * 32 * 0.3 / 4 / 0.8075))
    summary = export_shapes(tmp_path / "ds", seed=SEED, **dict(plan, n=(160, 16, 16)))
    buckets = {(32, 32), (64, 32), (32, 64), (48, 48), (80, 48), (48, 80)}
    sides = []
    for v in summary["variants"]["clean"]:
        if v["source"] == SOURCE_NAMES["t2i"]:
            w, h = Image.open(tmp_path / "ds" / "t2i" / (v["key"] + ".png")).size
            assert (w, h) in buckets, v["key"]
            sides.append(min(w, h))
    assert 0.1 < sides.count(32) / len(sides) < 0.4
    with pytest.raises(ValueError, match="size_weights"):
        export_shapes(tmp_path / "bad", seed=SEED, n=(8, 0, 0), sizes=(32, 48), size_weights=(1.0,))
    with pytest.raises(ValueError, match="aspects_by_size"):
        export_shapes(tmp_path / "bad2", seed=SEED, n=(8, 0, 0), sizes=(32, 48), aspects_by_size={32: (1.0,)})
