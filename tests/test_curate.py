"""Curation: facts from images, each filter and its reason, filter order, deterministic dedup, the record."""

import hashlib
import random

import imagehash
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from difftrain.data.prepare.curate import (Facts, apply_filters, facts_for, hamming, near_dup_pairs, read_record,
                                   reason_counts, record_extra, write_record)
from difftrain.data.prepare.ingest import RawSample
from difftrain.errors import UserError


def save_png(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(arr, dtype=np.uint8)).save(path)
    return str(path)


def pattern(h, w, seed):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR))


def sample(key, caption="a red circle in the top left", scores=None, task="t2i", refs=None, source="src",
           caption_error=""):
    return RawSample(source, key, task, refs or [f"/nonexistent/{key}.png"], caption, caption_error,
                     dict(scores or {}))


def ok_facts(w=64, h=64, sha=None, phash=0, key=""):
    return Facts(w, h, sha or hashlib.sha256(key.encode() or b"x").hexdigest(), phash)


# --------------------------------------------------------------------------- facts


def test_facts_for_t2i_reads_size_hash_and_phash(tmp_path):
    arr = pattern(40, 72, 0)
    ref = save_png(tmp_path / "a.png", arr)
    f = facts_for(sample("a", refs=[ref]))
    assert (f.width, f.height, f.error) == (72, 40, "")
    assert f.sha256 == hashlib.sha256((tmp_path / "a.png").read_bytes()).hexdigest()
    want = int(str(imagehash.phash(Image.open(ref))), 16)
    assert f.phash & ((1 << 64) - 1) == want and -(1 << 63) <= f.phash < 1 << 63


def test_facts_for_edit_and_keyframes_use_the_target_and_check_frame_sizes(tmp_path):
    src = save_png(tmp_path / "s.png", pattern(32, 32, 1))
    tgt = save_png(tmp_path / "t.png", pattern(48, 64, 2))
    f = facts_for(sample("e", task="edit", refs=[src, tgt]))
    assert (f.width, f.height) == (64, 48)  # the target's size
    assert f.error == "images of different sizes (32x32, 64x48)"
    tgt2 = save_png(tmp_path / "t2.png", pattern(32, 32, 3))
    g = facts_for(sample("e2", task="edit", refs=[src, tgt2]))
    assert g.error == "" and g.phash == facts_for(sample("x", refs=[tgt2])).phash
    digests = b"".join(hashlib.sha256(open(p, "rb").read()).digest() for p in (src, tgt2))
    assert g.sha256 == hashlib.sha256(digests).hexdigest()
    frames = [save_png(tmp_path / f"f{i}.png", pattern(32, 32, 10 + i)) for i in range(3)]
    k = facts_for(sample("k", task="keyframes", refs=frames))
    assert k.error == "" and (k.width, k.height) == (32, 32)
    bad = facts_for(sample("k2", task="keyframes", refs=frames[:2] + [tgt]))
    assert bad.error == "frames of different sizes (32x32, 32x32, 64x48)"


def test_facts_for_reports_missing_truncated_and_garbage_files(tmp_path):
    ref = save_png(tmp_path / "full.png", pattern(64, 64, 4))
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.png").write_bytes(b"definitely not an image")
    missing = facts_for(sample("m", refs=[str(tmp_path / "gone.png")]))
    assert missing.error.startswith("image: ") and "gone.png: file not found" in missing.error
    cut = facts_for(sample("c", refs=[str(tmp_path / "cut.png")]))
    assert cut.error.startswith("image: ") and "cut.png" in cut.error and "truncat" in cut.error.lower()
    junk = facts_for(sample("j", refs=[str(tmp_path / "junk.png")]))
    assert junk.error.endswith("junk.png: not a recognised image format")
    edit = facts_for(sample("e", task="edit", refs=[ref, str(tmp_path / "cut.png")]))
    assert edit.error.startswith("target: ")
    assert facts_for(sample("ok", refs=[ref])).error == ""


# --------------------------------------------------------------------------- filters


def run(filters, samples, facts):
    return [r for _, r in apply_filters(samples, facts, filters)]


def test_size_area_and_aspect_reasons():
    dims = [(64, 64), (16, 64), (256, 300), (100, 50), (40, 90)]
    samples = [sample(f"s{i}") for i in range(len(dims))]
    facts = [ok_facts(w, h, key=f"s{i}") for i, (w, h) in enumerate(dims)]
    assert run([{"kind": "size", "min_side": 32, "max_side": 256}], samples, facts) == [
        "", "size: min_side", "size: max_side", "", ""]
    assert run([{"kind": "area", "min": 1025, "max": 5000}], samples, facts) == [
        "", "area: min", "area: max", "", ""]
    assert run([{"kind": "aspect", "min": 0.5, "max": 1.5}], samples, facts) == [
        "", "aspect: min", "", "aspect: max", "aspect: min"]
    assert run([{"kind": "size"}], samples, facts) == [""] * 5  # no bounds, nothing to fail


def test_caption_reasons():
    caps = ["a red circle in the top left", "", "   ", "circle", " ".join(["word"] * 30),
            " ".join(["abcdefghijklmno"] * 15), "bad \ufffd bytes", None]
    samples = [sample(f"c{i}", caption=c) for i, c in enumerate(caps)]
    facts = [ok_facts(key=f"c{i}") for i in range(len(caps))]
    assert run([{"kind": "caption", "min_words": 3, "max_words": 20, "max_chars": 200}], samples, facts) == [
        "", "caption: empty", "caption: empty", "caption: too short", "caption: too long", "caption: too long",
        "caption: undecodable", "caption: undecodable"]
    assert run([{"kind": "caption"}], samples, facts)[:6] == ["", "caption: empty", "caption: empty", "", "", ""]


def test_decode_error_then_caption_error_come_first_whatever_the_filters():
    samples = [sample("a", caption=None, caption_error="missing sidecar"),
               sample("b", caption=None, caption_error="not UTF-8"),
               sample("c", caption=None, caption_error="missing sidecar"),
               sample("d", scores={"quality": 0.1})]
    facts = [ok_facts(8, 8, key="a"), ok_facts(key="b"), Facts(0, 0, "", 0, "image: x.png: image file is truncated"),
             ok_facts(8, 8, key="d")]
    filters = [{"kind": "size", "min_side": 32}, {"kind": "score", "column": "quality", "min": 0.5}]
    assert run(filters, samples, facts) == ["caption: missing sidecar", "caption: not UTF-8",
                                            "decode: image: x.png: image file is truncated", "size: min_side"]
    assert run([], samples, facts)[:3] == ["caption: missing sidecar", "caption: not UTF-8",
                                           "decode: image: x.png: image file is truncated"]


def test_score_reasons():
    samples = [sample("a", scores={"quality": 0.9}), sample("b", scores={"quality": 0.2}),
               sample("c", scores={"aesthetic": 6.0}), sample("d", scores={"quality": 0.99}),
               sample("e", scores={"quality": float("nan")})]
    facts = [ok_facts(key=k) for k in "abcde"]
    assert run([{"kind": "score", "column": "quality", "min": 0.5, "max": 0.95}], samples, facts) == [
        "", "score: quality < 0.5", "score: quality missing", "score: quality > 0.95", "score: quality missing"]


def test_filter_order_decides_the_reason():
    samples = [sample("a", scores={"quality": 0.1})]
    facts = [ok_facts(10, 10, key="a")]
    size = {"kind": "size", "min_side": 32}
    score = {"kind": "score", "column": "quality", "min": 0.5}
    assert run([size, score], samples, facts) == ["size: min_side"]
    assert run([score, size], samples, facts) == ["score: quality < 0.5"]


@pytest.mark.parametrize("filters, pattern", [
    ([{"kind": "size"}, {"kind": "blur"}], r"data\.filters\[1\]\.kind: unknown filter kind 'blur'"),
    ([{"kind": "size", "min": 3}], r"data\.filters\[0\]\.min: unknown key for a 'size' filter"),
    ([{"kind": "near_dup"}], r"data\.filters\[0\]\.distance: missing"),
    ([{"kind": "near_dup", "distance": 2.5}], r"data\.filters\[0\]\.distance: expected an integer"),
    ([{"kind": "near_dup", "distance": 40}], r"data\.filters\[0\]\.distance: expected 0\.\.31"),
    ([{"kind": "near_dup", "distance": 2, "window": 0}], r"data\.filters\[0\]\.window: expected at least 1"),
    ([{"kind": "score", "min": 1}], r"data\.filters\[0\]\.column: missing"),
    ([{"kind": "score", "column": "q"}], r"data\.filters\[0\]\.min: a 'score' filter needs"),
    ([{"kind": "caption", "min_words": "3"}], r"data\.filters\[0\]\.min_words: expected an integer"),
    ([{"kind": "exact_dup", "distance": 1}], r"data\.filters\[0\]\.distance: .*takes no options"),
    ([{"kind": "area", "min": 10, "max": 5}], r"data\.filters\[0\]\.min: min = 10 is above max = 5"),
])
def test_bad_filters_are_user_errors(filters, pattern):
    with pytest.raises(UserError, match=pattern):
        apply_filters([sample("a")], [ok_facts()], filters)


# --------------------------------------------------------------------------- dedup


def dup_world(n_groups=30, seed=0):
    """Samples in groups sharing a sha256; returns samples, facts."""
    rng = random.Random(seed)
    samples, facts = [], []
    for g in range(n_groups):
        for j in range(rng.randint(1, 4)):
            s = sample(f"g{g}-{j}")
            samples.append(s)
            facts.append(Facts(64, 64, hashlib.sha256(f"group{g}".encode()).hexdigest(), g))
    return samples, facts


def test_exact_dup_keeps_the_smallest_sample_id_whatever_the_input_order():
    samples, facts = dup_world()
    base = {s.key: r for s, r in zip(samples, run([{"kind": "exact_dup"}], samples, facts))}
    groups: dict[str, list[RawSample]] = {}
    for s, f in zip(samples, facts):
        groups.setdefault(f.sha256, []).append(s)
    assert any(len(g) > 1 for g in groups.values())
    for g in groups.values():
        keeper = min(g, key=lambda s: s.sample_id)
        assert base[keeper.key] == ""
        for s in g:
            if s is not keeper:
                assert base[s.key] == f"exact_dup: {keeper.sample_id}"
    for seed in range(3):
        order = list(range(len(samples)))
        random.Random(seed).shuffle(order)
        shuffled = run([{"kind": "exact_dup"}], [samples[i] for i in order], [facts[i] for i in order])
        assert {samples[i].key: r for i, r in zip(order, shuffled)} == base


def test_a_dropped_sample_cannot_shadow_a_kept_one():
    a, b = sample("a", scores={"quality": 0.9}), sample("b", scores={"quality": 0.9})
    first, second = sorted([a, b], key=lambda s: s.sample_id)
    first.scores["quality"] = 0.1  # the one dedup would keep fails the score filter first
    facts = [Facts(64, 64, "same", 1), Facts(64, 64, "same", 1)]
    score = {"kind": "score", "column": "quality", "min": 0.5}
    reasons = dict(zip(["first", "second"], run([score, {"kind": "exact_dup"}], [first, second], facts)))
    assert reasons == {"first": "score: quality < 0.5", "second": ""}
    # With dedup first, the low-quality one wins the group and both end up dropped.
    reasons = dict(zip(["first", "second"], run([{"kind": "exact_dup"}, score], [first, second], facts)))
    assert reasons == {"first": "score: quality < 0.5", "second": f"exact_dup: {first.sample_id}"}


def clustered_hashes(n_centres, per_centre, max_flip, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n_centres):
        centre = rng.getrandbits(64)
        for _ in range(per_centre):
            h = centre
            for bit in rng.sample(range(64), rng.randint(0, max_flip)):
                h ^= 1 << bit
            out.append(h - (1 << 64) if h >= 1 << 63 else h)  # signed, as facts store them
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("distance", [0, 1, 3, 6, 10])
def test_near_dup_banding_finds_exactly_the_brute_force_pairs(distance):
    hashes = clustered_hashes(40, 6, 2 * distance + 2, seed=distance)
    hashes += hashes[:5]  # exact repeats too
    brute = [(i, j) for i in range(len(hashes)) for j in range(i + 1, len(hashes))
             if hamming(hashes[i], hashes[j]) <= distance]
    assert len(brute) > 20  # the clusters make the test meaningful
    assert near_dup_pairs(hashes, distance) == brute


def brute_greedy(ids, hashes, distance):
    kept, reasons = [], {}
    for i in sorted(range(len(ids)), key=lambda i: ids[i]):
        hits = [k for k in kept if hamming(hashes[i], hashes[k]) <= distance]
        if hits:
            reasons[i] = f"near_dup: {min(ids[k] for k in hits)}"
        else:
            kept.append(i)
            reasons[i] = ""
    return [reasons[i] for i in range(len(ids))]


@pytest.mark.parametrize("distance", [2, 5])
def test_near_dup_filter_matches_brute_force_and_ignores_input_order(distance):
    hashes = clustered_hashes(30, 5, distance + 3, seed=100 + distance)
    samples = [sample(f"n{i}") for i in range(len(hashes))]
    facts = [Facts(64, 64, f"sha{i}", h) for i, h in enumerate(hashes)]
    got = run([{"kind": "near_dup", "distance": distance}], samples, facts)
    assert got == brute_greedy([s.sample_id for s in samples], hashes, distance)
    assert 0 < sum(r.startswith("near_dup: ") for r in got) < len(got)
    order = list(range(len(samples)))
    random.Random(7).shuffle(order)
    shuffled = run([{"kind": "near_dup", "distance": distance}], [samples[i] for i in order],
                   [facts[i] for i in order])
    assert {samples[i].key: r for i, r in zip(order, shuffled)} == {s.key: r for s, r in zip(samples, got)}


def test_near_dup_scales_past_quadratic_on_distinct_hashes():
    rng = random.Random(3)
    n = 20000
    hashes = [rng.getrandbits(63) for _ in range(n)]
    samples = [sample(f"big{i}") for i in range(n)]
    facts = [Facts(8, 8, f"s{i}", h) for i, h in enumerate(hashes)]
    reasons = run([{"kind": "near_dup", "distance": 3}], samples, facts)  # n^2/2 = 2e8 compares would time out
    assert reasons == [""] * n


def test_near_dup_window_bounds_the_comparisons_on_skewed_hashes():
    """Distinct hashes sharing their top 48 bits fill one bucket of three bands of four: compared within the
    window, a row costs at most (distance + 1) x window comparisons; a window as large as the bucket finds every
    pair, as brute force does."""
    from difftrain.data.prepare.near_dup import near_dup_keepers

    rng = random.Random(5)
    top = rng.getrandbits(48) << 16
    hashes = [top | rng.getrandbits(16) for _ in range(300)]
    hashes = [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]
    ids = [sample(f"s{i}").sample_id for i in range(len(hashes))]
    keep, compared = near_dup_keepers(ids, hashes, 3, window=4)
    assert compared <= 4 * 4 * len(ids) and compared > 3 * 3 * len(ids)       # the crowded bands are capped
    full, compared_full = near_dup_keepers(ids, hashes, 3, window=len(ids))
    assert compared_full > 10 * compared
    want = brute_greedy(ids, hashes, 3)
    assert ["" if k < 0 else f"near_dup: {k}" for k in full.tolist()] == want
    assert sum(bool(r) for r in want) > 20


# --------------------------------------------------------------------------- record


def test_record_has_every_input_row_with_outcome_reason_and_scores(tmp_path):
    samples = [sample("a", scores={"quality": 0.9}), sample("b", scores={"quality": 0.1, "aesthetic": 4.0}),
               sample("c", caption=None, caption_error="missing sidecar"),
               RawSample("other", "d", "edit", ["s.png", "t.png"], "make it blue", "", {"width": 3.0})]
    facts = [ok_facts(key="a", phash=-5), ok_facts(key="b"), ok_facts(key="c"),
             Facts(0, 0, "", 0, "target: t.png: file not found")]
    outcomes = apply_filters(samples, facts, [{"kind": "score", "column": "quality", "min": 0.5}])
    path = tmp_path / "out" / "record.parquet"
    write_record(path, samples, facts, outcomes, extra={"filters": [{"kind": "score"}], "n": 4})
    table = read_record(path)
    assert table.num_rows == 4
    assert table.schema.field("sample_id").type == pa.int64()
    assert table.schema.field("refs").type == pa.list_(pa.string())
    rows = table.to_pylist()
    assert [r["sample_id"] for r in rows] == [s.sample_id for s in samples]
    assert [r["outcome"] for r in rows] == ["kept", "dropped", "dropped", "dropped"]
    assert [r["reason"] for r in rows] == ["", "score: quality < 0.5", "caption: missing sidecar",
                                           "decode: target: t.png: file not found"]
    assert rows[0]["phash"] == -5 and rows[0]["width"] == 64 and rows[0]["sha256"] == facts[0].sha256
    assert rows[3]["width"] is None and rows[3]["phash"] is None and rows[3]["refs"] == ["s.png", "t.png"]
    assert [r["quality"] for r in rows] == [0.9, 0.1, None, None]
    assert [r["aesthetic"] for r in rows] == [None, 4.0, None, None]
    assert rows[3]["score_width"] == 3.0  # a score named like a fixed column gets a prefix
    assert rows[2]["caption"] is None and rows[2]["caption_error"] == "missing sidecar"
    assert record_extra(table) == {"filters": [{"kind": "score"}], "n": 4}
    assert sorted(p.name for p in path.parent.iterdir()) == ["record.parquet"]  # no temp file left
    write_record(path, samples[:1], facts[:1], outcomes[:1])  # replaces atomically
    assert read_record(path).num_rows == 1
    with pytest.raises(ValueError, match="one fact and one outcome per sample"):
        write_record(path, samples, facts[:2], outcomes)
    with pytest.raises(UserError, match="curation record not found"):
        read_record(tmp_path / "nope.parquet")


def test_record_on_an_fsspec_uri():
    import uuid

    import fsspec

    uri = f"memory://records-{uuid.uuid4().hex}/run/curation.parquet"
    samples = [sample("a", scores={"q": 1.0}), sample("b")]
    facts = [ok_facts(key="a"), ok_facts(key="b")]
    try:
        write_record(uri, samples, facts, [(True, ""), (False, "exact_dup: 1")], extra={"k": "v"})
        table = read_record(uri)
        assert table.column("key").to_pylist() == ["a", "b"] and table.column("q").to_pylist() == [1.0, None]
        assert record_extra(table) == {"k": "v"}
    finally:
        fsspec.filesystem("memory").rm(uri.split("/run/")[0].replace("memory://", "/"), recursive=True)


def test_reason_counts_group_per_sample_details():
    outcomes = [(True, ""), (True, ""), (False, "exact_dup: 12"), (False, "exact_dup: 99"), (False, "near_dup: 5"),
                (False, "decode: image: a.png: truncated"), (False, "size: min_side"), (False, "size: min_side"),
                (False, "score: quality < 0.5")]
    assert reason_counts(outcomes) == {"exact_dup": 2, "kept": 2, "size: min_side": 2, "decode": 1, "near_dup": 1,
                                       "score: quality < 0.5": 1}
    assert list(reason_counts(outcomes))[:3] == ["exact_dup", "kept", "size: min_side"]
