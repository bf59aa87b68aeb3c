"""Candidates, preference pairs and ``difftrain dpo`` through the CLI, on a tiny model of the shapes world: the
candidates' manifest and resume, pairs by majority, DPO on 1 and 2 gloo ranks (the same weights), a kill mid-DPO
resuming exactly, and bad input refused before any work, naming the file, row or key."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from difftrain.config import load_config, to_toml

from conftest import TINY

pytestmark = pytest.mark.slow

BASE = TINY + ["train.steps=20", "train.checkpoint_every=10", "train.keep_checkpoints=3", "train.threads=1"]


def _cli(args: list[str], cwd: Path, ranks: int = 1, faults: str = "", check: bool = True,
         restarts: int = 0) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--max-restarts={restarts}"] if ranks > 1 or restarts else [sys.executable])
    proc = subprocess.run(launch + ["-m", "difftrain", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FAULTS": faults})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _light_rankings(cands: Path, out: Path, contrary: set[str] = frozenset()) -> None:
    """An automatic rater preferring a lighter background (the mean of the image's border); a second rater
    agrees except on the prompts in ``contrary``, where it ranks the other way."""
    rows = [json.loads(x) for x in (cands / "candidates.jsonl").read_text().splitlines()]
    by: dict[str, list] = {}
    for r in rows:
        img = np.asarray(Image.open(cands / r["image"]).convert("RGB"), dtype=np.float64)
        light = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]]).mean()
        by.setdefault(r["prompt_id"], []).append((light, r["id"]))
    with out.open("w") as f:
        for pid, xs in by.items():
            order = [c for _, c in sorted(xs, reverse=True)]
            f.write(json.dumps({"prompt_id": pid, "rater": "a", "order": order}) + "\n")
            f.write(json.dumps({"prompt_id": pid, "rater": "b", "order": order[::-1] if pid in contrary else order})
                    + "\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    (d / "base.toml").write_text(to_toml(load_config(None, BASE)))
    _cli(["train", "base.toml", "--run-dir", "base", "--no-progress"], d)
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(d / "source.png")
    prompts = ["a small red circle in the top left", "a big blue square", "a small green triangle in the bottom right",
               "a red square in the top right", "a blue circle", "a green circle in the centre"]
    lines = [json.dumps({"prompt": p}) for p in prompts]
    lines += [json.dumps({"id": "e1", "prompt": "make it red", "task": "edit", "source": "source.png"}),
              json.dumps({"id": "k1", "prompt": "a red circle moving right", "task": "keyframes", "frames": 2})]
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    out = json.loads(_cli(["candidates", "base", "prompts.jsonl", "--k", "3", "--out", "cands", "--no-progress",
                           "--batch", "4"], d).stdout.splitlines()[-1])
    assert out["written"] == 24 and out["skipped"] == 0
    return d


def test_candidates_manifest_seeds_no_metadata_and_resume(world):
    from difftrain.train.verification import checkpoint_digest

    cands = world / "cands"
    manifest = json.loads((cands / "manifest.json").read_text())
    rows = [json.loads(x) for x in (cands / "candidates.jsonl").read_text().splitlines()]
    assert manifest["digest"] == checkpoint_digest(manifest["checkpoint"]) and manifest["step"] == 20
    assert manifest["sampler"]["steps"] == 3 and manifest["k"] == 3 and len(manifest["prompts"]) == 8
    assert {r["task"] for r in rows} == {"t2i", "edit", "keyframes"}
    assert len({r["noise_seed"] for r in rows}) == 24
    kf = next(r for r in rows if r["task"] == "keyframes")
    assert len(kf["frames"]) == 2 and all((cands / f).is_file() for f in kf["frames"])
    edit = next(r for r in rows if r["task"] == "edit")
    # the edit's source copied into the folder (what the rating app may serve), pixels unchanged
    assert edit["source"].startswith("sources/") and (cands / edit["source"]).resolve().is_relative_to(cands.resolve())
    with Image.open(cands / edit["source"]) as copy, Image.open(world / "source.png") as original:
        assert copy.format == "PNG" and np.array_equal(np.asarray(copy), np.asarray(original.convert("RGB")))
    with Image.open(cands / rows[0]["image"]) as im:
        assert im.format == "PNG" and not getattr(im, "text", {}) and set(im.info) <= {"dpi"}
    # a run killed after 20 candidates: the rest are made on rerun, the same images as in one go
    before = {r["id"]: (cands / r["image"]).read_bytes() for r in rows}
    kept = (cands / "candidates.jsonl").read_text().splitlines()[:20]
    (cands / "candidates.jsonl").write_text("\n".join(kept) + "\n" + '{"id": "torn')
    for r in rows[20:]:
        (cands / r["image"]).unlink()
    out = json.loads(_cli(["candidates", "base", "prompts.jsonl", "--k", "3", "--out", "cands", "--no-progress",
                           "--batch", "4"], world).stdout.splitlines()[-1])
    assert out["written"] == 4 and out["skipped"] == 20
    after = [json.loads(x) for x in (cands / "candidates.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in after) == sorted(before)
    assert all((cands / r["image"]).read_bytes() == before[r["id"]] for r in after)
    # another checkpoint on the same prompts and seeds: the same noise seeds (a comparison batch)
    other = json.loads(_cli(["candidates", "base/checkpoints/step_00000010", "prompts.jsonl", "--k", "3", "--out",
                             "cands10", "--no-progress"], world).stdout.splitlines()[-1])
    rows10 = {json.loads(x)["id"]: json.loads(x) for x in (world / "cands10" / "candidates.jsonl").read_text().splitlines()}
    assert other["digest"] != manifest["digest"]
    assert all(rows10[r["id"]]["noise_seed"] == r["noise_seed"] for r in after)
    # under torchrun (2 gloo ranks, the model sharded): each rank its slice of every batch, the same images
    _cli(["candidates", "base", "prompts.jsonl", "--k", "3", "--out", "cands2", "--no-progress", "--batch", "4"],
         world, ranks=2)
    two = {json.loads(x)["id"]: json.loads(x) for x in (world / "cands2" / "candidates.jsonl").read_text().splitlines()}
    assert two.keys() == before.keys()
    assert all((world / "cands2" / two[i]["image"]).read_bytes() == before[i] for i in before)
    # the same folder with other settings is refused
    bad = _cli(["candidates", "base", "prompts.jsonl", "--k", "2", "--out", "cands", "--no-progress"], world, check=False)
    assert bad.returncode == 2 and "k differ" in bad.stderr


def test_pairs_by_majority_with_agreement_split_by_prompt(world):
    import pyarrow.parquet as pq

    (world / "t2i.jsonl").write_text("".join(line + "\n" for line in            # 6 text-to-image prompts, 1 edit
                                             (world / "prompts.jsonl").read_text().splitlines()[:7]))
    _cli(["candidates", "base", "t2i.jsonl", "--k", "4", "--out", "c4", "--no-progress"], world)
    _light_rankings(world / "c4", world / "rankings.jsonl", contrary={"p000002"})
    out = json.loads(_cli(["pairs", "rankings.jsonl", "--candidates", "c4", "--out", "pairs/all.parquet",
                           "--validation", "0.3"], world).stdout.splitlines()[-1])
    # prompt 2's two raters disagree on every pair: all 6 are ties; the other 6 prompts give C(4, 2) = 6 each
    assert out["pairs"] == 36 and out["ties_dropped"] == 6
    rows = pq.read_table(world / "pairs" / "all.parquet").to_pylist()
    assert {r["agreement"] for r in rows} == {1.0} and {r["raters"] for r in rows} == {2}
    splits = {}
    for r in rows:
        splits.setdefault(r["prompt_id"], set()).add(r["split"])
        assert (world / "pairs" / r["winner_image"]).is_file()
    assert all(len(s) == 1 for s in splits.values()) and out["validation"] > 0
    edits = [r for r in rows if r["task"] == "edit"]
    assert len(edits) == 6 and all(r["source_image"].startswith("../c4/sources/") for r in edits)
    assert all((world / "pairs" / r["source_image"]).is_file() for r in edits)
    bw = json.loads(_cli(["pairs", "rankings.jsonl", "--candidates", "c4", "--out", "pairs/bw.parquet", "--mode",
                          "best-worst"], world).stdout.splitlines()[-1])
    assert bw["pairs"] == 6
    # unknown candidates are named with their line
    (world / "bad.jsonl").write_text(json.dumps({"prompt_id": "p000001", "order": ["p000001-0", "nope"]}) + "\n")
    bad = _cli(["pairs", "bad.jsonl", "--candidates", "c4", "--out", "x.parquet"], world, check=False)
    assert bad.returncode == 2 and "bad.jsonl:1: unknown candidate 'nope'" in bad.stderr


def test_pickapic_layout_is_read_and_ties_dropped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from difftrain.align.pairs import pickapic_pairs
    from difftrain.data.store.pairs import read_pairs

    def jpg(shade):
        buf = io.BytesIO()
        Image.fromarray(np.full((40, 48, 3), shade, np.uint8)).save(buf, format="JPEG")
        return buf.getvalue()

    pq.write_table(pa.table({"caption": ["a", "b", "c"], "jpg_0": [jpg(10), jpg(20), jpg(30)],
                             "jpg_1": [jpg(200), jpg(210), jpg(220)], "label_0": [1.0, 0.5, 0.0],
                             "model_0": ["m0", "m0", "m0"], "model_1": ["m1", "m1", "m1"]}), tmp_path / "pap.parquet")
    out = pickapic_pairs(tmp_path / "pap.parquet", tmp_path / "pairs.parquet", image_size=32)
    assert out["pairs"] == 2 and out["ties_dropped"] == 1
    rows = read_pairs(tmp_path / "pairs.parquet").to_pylist()
    first, last = rows
    assert first["winner_model"] == "m0" and last["winner_model"] == "m1"
    with Image.open(tmp_path / first["winner_image"]) as a, Image.open(tmp_path / last["winner_image"]) as b:
        assert a.size == (32, 32) and np.asarray(a).mean() < 60 and np.asarray(b).mean() > 150


def test_select_asks_one_pair_a_prompt_the_pairs_farthest_apart(world, tmp_path):
    """``difftrain select``: for each prompt the two candidates farthest apart (the tiny model's autoencoder is a
    pixel unshuffle, so the distance is the images' own), the prompts whose pairs are farthest apart first; a
    candidates folder the rating app imports as one pairwise item a prompt. Hostile rows are refused, nothing
    written."""
    from itertools import combinations

    from difftrain_rate.batches import import_batch
    from difftrain_rate.db import Database, upgrade

    rows = [json.loads(x) for x in (world / "cands" / "candidates.jsonl").read_text().splitlines()]

    def pixels(r):
        return np.concatenate([np.asarray(Image.open(world / "cands" / f).convert("RGB"), np.float64).ravel()
                               for f in (r["frames"] or [r["image"]])]) / 127.5

    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["prompt_id"], []).append(r)
    best = {}
    for pid, cs in by.items():
        d, a, b = max((np.sqrt(np.mean((pixels(x) - pixels(y)) ** 2)), x["id"], y["id"])
                      for x, y in combinations(cs, 2))
        best[pid] = (d, {a, b})
    top = sorted(best, key=lambda p: -best[p][0])[:5]
    out = json.loads(_cli(["select", "cands", "--items", "5", "--rule", "spread", "--out", str(tmp_path / "sel")],
                          world).stdout.splitlines()[-1])
    assert out == {"out": str(tmp_path / "sel"), "rule": "spread", "items": 5, "prompts": 8, "candidates": 10}
    got = [json.loads(x) for x in (tmp_path / "sel" / "candidates.jsonl").read_text().splitlines()]
    chosen: dict[str, set] = {}
    for r in got:
        chosen.setdefault(r["prompt_id"], set()).add(r["id"])
        for f in [r["image"], r["source"], *r["frames"]]:
            assert not f or (tmp_path / "sel" / f).is_file()
    assert set(chosen) == set(top) and all(chosen[p] == best[p][1] for p in top)
    assert sorted(r["k"] for r in got) == [0] * 5 + [1] * 5
    # the copies are the same images
    orig = {r["id"]: r for r in rows}
    for r in got:
        assert np.array_equal(pixels({**r, "frames": [str(tmp_path / "sel" / f) for f in r["frames"]],
                                      "image": str(tmp_path / "sel" / r["image"])}), pixels(orig[r["id"]]))
    manifest = json.loads((tmp_path / "sel" / "manifest.json").read_text())
    assert manifest["k"] == 2 and manifest["selected"]["rule"] == "spread"
    assert manifest["selected"]["spread"] == sorted(manifest["selected"]["spread"], reverse=True)
    db_url = str(tmp_path / "rate.db")
    upgrade(db_url)
    made = import_batch(Database(db_url), "chosen", [str(tmp_path / "sel")], "pairwise", raters=2, seed=0)
    assert made["items"] == 5
    # random: the same layout; hostile input refused naming the file, nothing written
    out = json.loads(_cli(["select", "cands", "--items", "99", "--rule", "random", "--out", str(tmp_path / "rnd")],
                          world).stdout.splitlines()[-1])
    assert out["items"] == 8
    bad = _cli(["select", "cands", "--items", "2", "--out", str(tmp_path / "sel")], world, check=False)
    assert bad.returncode == 2 and "exists and is not empty" in bad.stderr
    bad = _cli(["select", "cands", "--items", "0", "--out", str(tmp_path / "z")], world, check=False)
    assert bad.returncode == 2 and "--items 0" in bad.stderr
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(world / "cands", evil)
    lines = (evil / "candidates.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    for field, value in (("image", "../../../etc/passwd"), ("image", "/etc/hostname"), ("source", "../base.toml")):
        (evil / "candidates.jsonl").write_text("\n".join([json.dumps({**first, field: value, "frames": []})]
                                                         + lines[1:]) + "\n")
        for rule in ("spread", "random"):
            bad = _cli(["select", str(evil), "--items", "99", "--rule", rule, "--out", str(tmp_path / "x")], world,
                       check=False)
            assert bad.returncode == 2 and "candidates.jsonl" in bad.stderr and repr(value) in bad.stderr, bad.stderr
            assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp*"))
    (evil / "manifest.json").write_text("{not json")
    bad = _cli(["select", str(evil), "--items", "1", "--out", str(tmp_path / "x")], world, check=False)
    assert bad.returncode == 2 and "manifest.json: not JSON" in bad.stderr


def test_select_balanced_weighs_tone_and_layout_each_on_its_own_scale(world, tmp_path):
    """The rule ``balanced``: a pair's latent difference split into its global part (each channel's mean
    over the image) and the rest, each divided by its mean over every pair of the round, summed; each prompt's best
    pair, the best prompts first. Computed here from the pixels (the tiny model's autoencoder is a pixel
    unshuffle by ``autoencoder.factor``), against what ``difftrain select`` chose."""
    from itertools import combinations

    f = load_config(str(world / "base.toml"), []).autoencoder.factor
    rows = [json.loads(x) for x in (world / "cands" / "candidates.jsonl").read_text().splitlines()]

    def latent(r):
        out = []
        for name in r["frames"] or [r["image"]]:
            a = np.asarray(Image.open(world / "cands" / name).convert("RGB"), np.float64).transpose(2, 0, 1) / 127.5
            c, h, w = a.shape
            out.append(a.reshape(c, h // f, f, w // f, f).transpose(0, 2, 4, 1, 3).reshape(c * f * f, h // f, w // f))
        return np.stack(out)

    lat = {r["id"]: latent(r) for r in rows}
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["prompt_id"], []).append(r["id"])
    parts = []
    for pid, ids in by.items():
        for a, b in combinations(ids, 2):
            da, db = lat[a].mean(axis=(2, 3)), lat[b].mean(axis=(2, 3))
            spatial = (lat[a] - da[..., None, None]) - (lat[b] - db[..., None, None])
            parts.append((pid, {a, b}, np.sqrt(np.mean((da - db) ** 2)), np.sqrt(np.mean(spatial ** 2))))
    mg, ms = np.mean([p[2] for p in parts]), np.mean([p[3] for p in parts])
    best: dict[str, tuple] = {}
    for pid, pair, g, sp in parts:
        if pid not in best or g / mg + sp / ms > best[pid][0]:
            best[pid] = (g / mg + sp / ms, pair)
    top = sorted(best, key=lambda p: -best[p][0])[:3]
    out = json.loads(_cli(["select", "cands", "--items", "3", "--rule", "balanced", "--out", str(tmp_path / "bal")],
                          world).stdout.splitlines()[-1])
    assert out["rule"] == "balanced" and out["items"] == 3
    got: dict[str, set] = {}
    for r in (json.loads(x) for x in (tmp_path / "bal" / "candidates.jsonl").read_text().splitlines()):
        got.setdefault(r["prompt_id"], set()).add(r["id"])
    assert got == {p: best[p][1] for p in top}
    spread = json.loads((tmp_path / "bal" / "manifest.json").read_text())["selected"]["spread"]
    assert spread == pytest.approx([best[p][0] for p in top], rel=1e-3)


def _dpo_cfg(world: Path, name: str, *extra: str) -> str:
    cfg = load_config(None, TINY + ["train.threads=1", "train.ema_decay=0", "train.steps=6", "train.checkpoint_every=2",
                                    "train.keep_checkpoints=5", "train.lr=3e-4", "train.warmup_steps=0",
                                    "train.schedule=constant", "train.global_batch=4", "dpo.init=base",
                                    "dpo.pairs=pairs/all.parquet", "dpo.beta=200", "dpo.validation_every=3",
                                    *extra])
    (world / f"{name}.toml").write_text(to_toml(cfg))
    return f"{name}.toml"


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run / "export" / "model.safetensors"))


def test_dpo_one_and_two_ranks_and_a_kill_give_the_same_weights(world):
    import torch

    if not (world / "pairs" / "all.parquet").exists():
        pytest.skip("needs the pairs of test_pairs_by_majority_with_agreement_split_by_prompt")
    cfg = _dpo_cfg(world, "dpo")
    _cli(["dpo", cfg, "--run-dir", "d1", "--no-progress"], world)
    rows = [json.loads(x) for x in (world / "d1" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "implicit_acc" in r]
    assert steps[0]["step"] == 1 and abs(steps[0]["loss"] - np.log(2)) < 1e-6          # policy = reference
    assert {"winner_vs_ref", "loser_vs_ref", "beta_delta_p05", "beta_delta_p95"} <= set(steps[-1])
    assert [r["step"] for r in rows if "val_implicit_acc" in r] == [3, 6]
    info = json.loads((world / "d1" / "checkpoints" / "step_00000006" / "trainer.json").read_text())
    assert len(info["dpo"]["reference_digest"]) == 64 and info["loader"]["kind"] == "pairs"
    one = _weights(world / "d1")
    ref = _weights(world / "base")
    assert max(float((one[k] - ref[k]).abs().max()) for k in one) > 0         # DPO moved the weights
    import shutil
    shutil.rmtree(world / "pairs" / "all.parquet.encoded")         # two ranks, no cache: rank 0 encodes it
    _cli(["dpo", cfg, "--run-dir", "d2", "--no-progress"], world, ranks=2)
    assert (world / "pairs" / "all.parquet.encoded" / "index.json").is_file()
    two = _weights(world / "d2")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    # killed before step 5 (after the checkpoint of step 4), restarted by torchrun: the same weights
    _cli(["dpo", cfg, "--run-dir", "dk", "--no-progress"], world, faults="kill@5", restarts=1)
    killed = _weights(world / "dk")
    assert all(torch.equal(one[k], killed[k]) for k in one)
    events = [json.loads(x) for x in (world / "dk" / "events.jsonl").read_text().splitlines()]
    assert any(e.get("event", e.get("kind")) == "resume" for e in events)
    # resuming against another reference is refused: as a config change, and, allowed, by the reference's digest
    other = _dpo_cfg(world, "other", "dpo.init=base/checkpoints/step_00000010", "train.steps=8")
    bad = _cli(["dpo", other, "--run-dir", "d1", "--no-progress"], world, check=False)
    assert bad.returncode == 2 and "dpo.init: 'base' -> 'base/checkpoints/step_00000010'" in bad.stderr
    bad = _cli(["dpo", other, "--run-dir", "d1", "--no-progress", "--allow-config-change", "dpo.init", "train.steps"],
               world, check=False)
    assert bad.returncode == 2 and "resume with the reference it was trained against" in bad.stderr


def test_dpo_with_replay_trains_on_the_base_data_beside_the_pairs_and_a_kill_resumes_it_exactly(world):
    """dpo.replay_weight: each step also draws the base's kind of data (here the shapes world, the base's mixture);
    the weights differ from plain DPO's, the replay loader's state is in the checkpoint and a run killed mid-way
    and restarted by torchrun ends with the unbroken run's weights."""
    import torch

    if not (world / "pairs" / "all.parquet").exists():
        pytest.skip("needs the pairs of test_pairs_by_majority_with_agreement_split_by_prompt")
    if not (world / "d1" / "export").exists():
        pytest.skip("needs the plain DPO run of test_dpo_one_and_two_ranks_and_a_kill_give_the_same_weights")
    cfg = _dpo_cfg(world, "replay", "dpo.replay_weight=50")
    _cli(["dpo", cfg, "--run-dir", "r1", "--no-progress"], world)
    info = json.loads((world / "r1" / "checkpoints" / "step_00000006" / "trainer.json").read_text())
    assert info["loader"]["kind"] == "pairs" and info["loader"]["replay"]["step"] == 6
    replayed, plain = _weights(world / "r1"), _weights(world / "d1")
    assert max(float((replayed[k] - plain[k]).abs().max()) for k in plain) > 1e-6     # the term moved the weights
    _cli(["dpo", cfg, "--run-dir", "rk", "--no-progress"], world, faults="kill@5", restarts=1)
    killed = _weights(world / "rk")
    assert all(torch.equal(replayed[k], killed[k]) for k in replayed)
    # a run checkpointed without replay does not resume with it (its replay draws were never made)
    bad = _cli(["dpo", cfg, "--run-dir", "d1", "--no-progress", "--allow-config-change", "dpo.replay_weight"],
               world, check=False)
    assert bad.returncode == 2 and "error: the checkpoint was trained without dpo.replay_weight" in bad.stderr, \
        bad.stderr[-1500:]


def test_dpo_with_lora_trains_adapters_only_and_exports_merged_or_apart(world):
    import torch
    from safetensors.torch import load_file

    if not (world / "pairs" / "all.parquet").exists():
        pytest.skip("needs the pairs of test_pairs_by_majority_with_agreement_split_by_prompt")
    lora = ["dpo.reference=lora", "dpo.lora_rank=4", "dpo.lora_alpha=8", "train.lr=3e-3"]
    _cli(["dpo", _dpo_cfg(world, "la", *lora, "dpo.lora_export=adapter"), "--run-dir", "la", "--no-progress"], world)
    _cli(["dpo", _dpo_cfg(world, "lm", *lora), "--run-dir", "lm", "--no-progress"], world)
    rows = [r for r in map(json.loads, (world / "la" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert abs(rows[0]["loss"] - np.log(2)) < 1e-6 and len(rows) == 6       # lora_B = 0: the reference at first
    init, base = _weights(world / "base"), _weights(world / "la")
    assert base.keys() == init.keys() and all(torch.equal(base[k], init[k]) for k in base)      # the base: frozen
    adapter = load_file(str(world / "la" / "export" / "adapter" / "model.safetensors"))
    config = json.loads((world / "la" / "export" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and len(adapter) == 2 * len(config["target_modules"])
    merged, folded = _weights(world / "lm"), 0
    for k in base:
        a = f"{k[:-len('.weight')]}.lora_A.default.weight"
        if a in adapter:
            expect = base[k] + 2.0 * adapter[a.replace("lora_A", "lora_B")] @ adapter[a]
            torch.testing.assert_close(merged[k], expect, rtol=1e-5, atol=1e-6)
            folded += int(not torch.equal(merged[k], base[k]))
        else:
            assert torch.equal(merged[k], base[k]), k
    assert folded == len(config["target_modules"])
    # a LoRA run's checkpoint samples as any other (its adapters applied)
    out = json.loads(_cli(["sample", "la", "--prompt", "a red circle", "--num-images", "1"], world).stdout)
    assert len(out["images"]) == 1
    # on an fp8 base too: sampling reads the base from dpo.init, quantized as the run held it
    fp8 = ["adapter.base_precision=fp8", "dpo.lora_export=adapter", "train.steps=2"]
    _cli(["dpo", _dpo_cfg(world, "lq", *lora, *fp8), "--run-dir", "lq", "--no-progress"], world)
    out = json.loads(_cli(["sample", "lq", "--prompt", "a red circle", "--num-images", "1"], world).stdout)
    assert len(out["images"]) == 1


def test_a_lora_dpo_checkpoint_of_the_older_layout_still_resumes_and_samples(world, monkeypatch):
    """DPO with LoRA once checkpointed the whole model (base included) and no adapter record: such a checkpoint
    (written here with that layout) resumes under today's code (the base read from dpo.init, the adapters from
    the checkpoint; its reference digest checked) and samples."""
    if not (world / "pairs" / "all.parquet").exists():
        pytest.skip("needs the pairs of test_pairs_by_majority_with_agreement_split_by_prompt")
    from difftrain.config import load_config
    from difftrain.train.checkpoint import Checkpointer
    from difftrain.train import build_dpo_trainer

    monkeypatch.chdir(world)
    lora = ["dpo.reference=lora", "dpo.lora_rank=4", "dpo.lora_alpha=8", "dpo.validation_every=0"]
    save = Checkpointer.save

    def older(self, step, model, optimizer, ema, extra, blocking=None, keep=None):
        return save(self, step, model, optimizer, ema, {k: v for k, v in extra.items() if not k.startswith("adapter")},
                    blocking, keep=None)

    monkeypatch.setattr(Checkpointer, "save", older)
    tr = build_dpo_trainer(load_config(_dpo_cfg(world, "old", *lora, "train.steps=2")), "old")
    tr.fit()
    tr.close()
    monkeypatch.setattr(Checkpointer, "save", save)
    info = Checkpointer.read_info(world / "old")
    assert "adapter" not in info
    _cli(["dpo", _dpo_cfg(world, "old4", *lora, "train.steps=4"), "--run-dir", "old", "--no-progress",
          "--allow-config-change", "train.steps"], world)
    assert Checkpointer.read_info(world / "old")["step"] == 4
    out = json.loads(_cli(["sample", "old/checkpoints/step_00000002", "--prompt", "a red circle", "--num-images", "1"],
                          world).stdout)
    assert len(out["images"]) == 1


def test_bad_dpo_input_is_refused_before_any_work(world, tmp_path):
    if not (world / "pairs" / "all.parquet").exists():
        pytest.skip("needs the pairs of test_pairs_by_majority_with_agreement_split_by_prompt")
    cases = [
        (["train.global_batch=64"], "fewer than train.global_batch = 64"),
        (["model.hidden=64", "model.heads=4"], "another architecture than this config: model.hidden"),
        (["dpo.pairs=nothing.parquet"], "dpo.pairs = 'nothing.parquet': no such file"),
        (["dpo.init=nowhere"], "nowhere: no such checkpoint"),
        (["dpo.beta=-1"], "dpo.beta"),
        (["dpo.replay_weight=10", "data.source=store", "data.store=somewhere"], "replay draws from the shapes source"),
        (["dpo.replay_weight=-1"], "dpo.replay_weight"),
    ]
    for i, (sets, message) in enumerate(cases):
        try:
            cfg = _dpo_cfg(world, f"bad{i}", *sets)
        except Exception as e:                              # refused by the config itself
            assert message in str(e)
            continue
        bad = _cli(["dpo", cfg, "--run-dir", str(tmp_path / f"r{i}"), "--no-progress"], world, check=False)
        assert bad.returncode == 2 and message in bad.stderr, (sets, bad.stderr[-800:])
        assert not (tmp_path / f"r{i}" / "checkpoints").exists()
    (world / "p_bad.jsonl").write_text(json.dumps({"prompt": "x", "task": "paint"}) + "\n")
    bad = _cli(["candidates", "base", "p_bad.jsonl", "--out", str(tmp_path / "c")], world, check=False)
    assert bad.returncode == 2 and "p_bad.jsonl:1: task 'paint'" in bad.stderr
    (world / "p_src.jsonl").write_text(json.dumps({"prompt": "x", "task": "edit", "source": "gone.png"}) + "\n")
    bad = _cli(["candidates", "base", "p_src.jsonl", "--out", str(tmp_path / "c")], world, check=False)
    assert bad.returncode == 2 and "p_src.jsonl:1: source image" in bad.stderr and "gone.png not found" in bad.stderr
