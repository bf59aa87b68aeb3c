"""``difftrain prepare`` on Ray Data, and the whole path on the exported shapes world:
export -> prepare (filters with reasons, buckets, Lance tables) -> train through a two-stage curriculum
from the store -> eval. One local Ray for the session (conftest)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import lance
import numpy as np
import pytest
import torch

from difftrain.config import load_config, preset_path
from difftrain.data.store import tables as st
from difftrain.data.prepare.curate import read_record
from difftrain.data.prepare.job import prepare, resize_cover_crop
from difftrain.shapes.export import export_shapes
from difftrain.errors import UserError

from conftest import TINY
from test_encoders import tiny, tiny_vae  # noqa: F401 - fixtures: real tiny T5 + CLIP and AutoencoderKL on disk

pytestmark = pytest.mark.slow

STAGES = ('[{name = "low", start_step = 0, buckets = [[32, 32], [32, 48], [48, 32]], global_batch = 8}, '
          '{name = "high", start_step = 6, buckets = [[64, 64], [64, 80], [80, 64]], global_batch = 8, '
          'micro_cost = 64}]')


def shapes_cfg(export: Path, store: Path, *extra: str):
    sources = ("[" + ", ".join([
        f'{{name = "shapes_t2i", kind = "folder", path = "{export}/t2i"}}',
        f'{{name = "shapes_t2i_shards", kind = "webdataset", path = "{export}/shards"}}',
        f'{{name = "shapes_edit", kind = "manifest", task = "edit", path = "{export}/edit/manifest.jsonl"}}',
        f'{{name = "shapes_keyframes", kind = "keyframes", path = "{export}/keyframes"}}']) + "]")
    return load_config(preset_path("shapes-store"), TINY + [
        "autoencoder.factor=8", f"data.sources={sources}", f"data.store={store}", f"data.stages={STAGES}",
        "data.image_size=32", "data.world_size=64", *extra])


MASKED = 6       # t2i images given a loss mask (NAME_mask.png, left half white), and edit rows (a manifest column)


def _left_half_mask(image: Path, to: Path) -> None:
    from PIL import Image
    with Image.open(image) as im:
        w, h = im.size
    a = np.zeros((h, w), np.uint8)
    a[:, : w // 2] = 255
    Image.fromarray(a, "L").save(to)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    export_shapes(root, n=(48, 32, 24), sizes=(32, 64), frames=3)
    # users' loss masks: beside the first folder images, and as the edit manifest's 'mask' column
    for img in sorted((root / "t2i").rglob("*.png"))[:MASKED]:
        _left_half_mask(img, img.with_name(img.stem + "_mask.png"))
    man = root / "edit" / "manifest.jsonl"
    rows = [json.loads(x) for x in man.read_text().splitlines()]
    for r in rows[:MASKED]:
        r["mask"] = r["target"].replace("target.png", "mask.png")
        _left_half_mask(root / "edit" / r["target"], root / "edit" / r["mask"])
    man.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def prepared(ray_local, export, tmp_path_factory):
    store = tmp_path_factory.mktemp("stores") / "full"
    cfg = shapes_cfg(export, store)
    return cfg, prepare(cfg, progress=False, commit_every=16)


def table_content(store: str) -> dict[str, dict[int, bytes]]:
    """Every table on disk (committed versions, whether or not the manifest names them yet), by sample id."""
    out = {}
    root = Path(store) / "tables"
    names = sorted(str(p.relative_to(root))[:-len(".lance")] for p in root.glob("*/*/*.lance")
                   if (p / "_versions").is_dir()) if root.exists() else []     # fragments never committed: nothing
    for name in names:
        ds = lance.dataset(st.table_uri(store, name))
        ids = ds.to_table(columns=["sample_id"])["sample_id"].to_pylist()
        out[name] = {int(i): b.read() for i, b in zip(ids, ds.take_blobs("latents", indices=list(range(len(ids)))))}
    return out


def test_every_input_row_is_in_the_record_with_its_reason(prepared, export):
    cfg, summary = prepared
    rec = read_record(f"{cfg.data.store}/curation.parquet").to_pylist()
    assert len(rec) == summary["inputs"] > 0
    info = json.loads((export / "export.json").read_text())
    assert summary["kept"] == sum(r["outcome"] == "kept" for r in rec)
    reasons = {r["reason"].split(":")[0] for r in rec if r["outcome"] == "dropped"}
    assert {"decode", "score", "size", "exact_dup", "caption"} <= reasons, reasons
    for r in rec:
        assert (r["outcome"] == "kept") == (r["reason"] == ""), r
    assert info                                              # the export described what it planted
    # Ray really ran the work: fragments written in tasks, none in this process (facts: test_prepare_scale.py)
    assert summary["write_pids"] and os.getpid() not in summary["write_pids"]
    assert summary["encoder_actors"] == len(summary["encoder_rows"]) >= 1 and summary["decode_tasks"] >= 1
    assert sum(summary["encoder_rows"]) == summary["encoded"]


def test_dry_run_counts_without_encoding(ray_local, export, tmp_path, prepared):
    cfg = shapes_cfg(export, tmp_path / "dry")
    summary = prepare(cfg, dry_run=True, progress=False)
    assert summary["reasons"] == prepared[1]["reasons"]
    assert not (tmp_path / "dry").exists()


def test_tables_hold_buckets_with_divisible_sides_and_the_crop(prepared, export):
    cfg, summary = prepared
    store = cfg.data.store
    manifest = st.read_manifest(store)
    rec = {r["sample_id"]: r for r in read_record(f"{store}/curation.parquet").to_pylist()}
    kept = {i for i, r in rec.items() if r["outcome"] == "kept"}
    seen: dict[str, set[int]] = {"low": set(), "high": set()}
    for name, info in manifest["tables"].items():
        stage, bucket, task = name.split("/")
        h, w = (int(v) for v in bucket.split("x"))
        assert h % 16 == 0 and w % 16 == 0
        ds = lance.dataset(st.table_uri(store, name))
        t = ds.to_table(columns=["sample_id", "crop"])
        ids = t["sample_id"].to_pylist()
        assert set(ids) <= kept and len(set(ids)) == len(ids)
        seen[stage] |= set(ids)
        assert info["latent_shape"] == [st.task_frames(task, 3), 192, h // 8, w // 8]
        # a t2i row decodes back to the resized, cropped image (pixel-unshuffle is exact; bf16 rounds)
        if task == "t2i":
            from PIL import Image
            from difftrain.data.prepare.refs import read_ref
            import io
            sid, lat = ids[0], np.frombuffer(ds.take_blobs("latents", indices=[0])[0].read(), np.uint16)
            x = st.from_bits(lat, "bf16").reshape(1, (h // 16) * (w // 16), 192 * 4)
            from difftrain.tokens import unpatchify
            img = torch.nn.functional.pixel_shuffle(unpatchify(x, h // 8, w // 8), 8)[0]
            with Image.open(io.BytesIO(read_ref(rec[sid]["refs"][0]))) as im:
                want, box = resize_cover_crop(im, h, w, "center", sid)
            got = ((img.permute(1, 2, 0) + 1) * 127.5).numpy()
            assert np.abs(got - want).max() <= 1.0
            assert t["crop"][0].as_py() == box
    assert seen["low"] == kept and seen["high"] == kept      # every kept sample in one bucket of each stage


def test_loss_masks_reach_the_tables_and_the_batches(prepared, export):
    """Masks given beside folder images and in an edit manifest are stored per token of the target (left half
    kept, right half not, on a square bucket); the loader serves them as ``keep_BL`` on the target frame only, and
    rows without a mask keep every token."""
    from difftrain.data.store.loader import keep_mask

    cfg, _ = prepared
    store = cfg.data.store
    rec = {r["sample_id"]: r for r in read_record(f"{store}/curation.parquet").to_pylist()}
    masked = {i for i, r in rec.items() if r["mask"]}
    assert len(masked) == 2 * MASKED and all(rec[i]["mask"].endswith("mask.png") for i in masked)
    assert not any(k.endswith("_mask") for k in (r["key"] for r in rec.values()))     # no mask became an image
    checked = {"t2i": 0, "edit": 0}
    for name, info in st.read_manifest(store)["tables"].items():
        stage, bucket, task = name.split("/")
        assert info.get("keep") is True
        h, w = (int(v) for v in bucket.split("x"))
        t = lance.dataset(st.table_uri(store, name)).to_table(columns=["sample_id", "keep"])
        for sid, k in zip(t["sample_id"].to_pylist(), t["keep"].to_pylist()):
            assert bool(k) == (sid in masked), (name, sid)
            F = st.task_frames(task, 3)
            L = (h // 16) * (w // 16)
            got = keep_mask([k], F, L)
            if not k:
                assert got is None
                continue
            grid = got[0, :L].reshape(h // 16, w // 16)
            assert got[0, L:].all()                       # an edit's reference frame: no loss there anyway
            if h == w:                                    # the crop is the whole image: left half kept
                assert grid[:, : w // 32].all() and not grid[:, w // 32:].any(), (name, grid)
            checked[task] += 1
    assert checked["t2i"] >= MASKED and checked["edit"] >= MASKED
    # the loader's batches carry them: a masked sample's row in the batch is its stored mask
    from difftrain.data.store.loader import StoreLoader
    loader = StoreLoader(cfg)
    served = 0
    for _ in range(12):
        for b in next(loader):
            for j, sid in enumerate(b.sample_ids):
                if sid in masked:
                    assert b.keep_BL is not None and not b.keep_BL[j].all() and b.keep_BL[j].any()
                    assert b.counted_BL[j].sum() < b.loss_mask_BL[j].sum()
                    served += 1
                elif b.keep_BL is not None:
                    assert b.keep_BL[j].all()
    loader.close()
    assert served


def test_killed_prepare_resumes_to_the_same_content(ray_local, export, tmp_path, prepared):
    cfg = shapes_cfg(export, tmp_path / "resumed")
    partial = prepare(cfg, progress=False, commit_every=8, limit=40)            # stops as a killed run would
    assert 0 < partial["encoded"] < prepared[1]["encoded"]
    # a writer killed between writing its manifest and renaming it into place leaves a temp behind
    (tmp_path / "resumed" / ".store.json.tmp4242").write_text('{"half": ')
    done = prepare(cfg, progress=False, commit_every=8)
    assert done["encoded"] + partial["encoded"] >= prepared[1]["encoded"]
    assert table_content(str(tmp_path / "resumed")) == table_content(prepared[0].data.store)
    assert not (tmp_path / "resumed" / ".store.json.tmp4242").exists()
    again = prepare(cfg, progress=False)
    assert again["encoded"] == 0                                              # nothing left to do


def test_store_with_other_settings_is_refused_and_left_intact(ray_local, export, prepared):
    store = prepared[0].data.store
    before = {n: lance.dataset(st.table_uri(store, n)).version for n in st.read_manifest(store)["tables"]}
    cfg = shapes_cfg(export, Path(store), "data.latent_dtype=fp32")
    with pytest.raises(UserError, match=r"latent_dtype: store has 'bf16', this config has 'fp32'"):
        prepare(cfg, progress=False)
    after = {n: lance.dataset(st.table_uri(store, n)).version for n in st.read_manifest(store)["tables"]}
    assert before == after


def test_error_rate_stops_before_writing(ray_local, export, tmp_path):
    cfg = shapes_cfg(export, tmp_path / "strict", "data.max_error_rate=0.0")
    with pytest.raises(UserError, match=r"could not be read or decoded.*curation.failed.parquet"):
        prepare(cfg, progress=False)
    failed = read_record(tmp_path / "strict" / "curation.failed.parquet").to_pylist()
    assert any(r["reason"].startswith("decode: ") for r in failed)
    assert not (tmp_path / "strict" / "curation.parquet").exists()      # no successful prepare yet
    assert not (tmp_path / "strict" / "tables").exists()


def test_train_from_the_store_through_the_curriculum_then_eval(prepared, tmp_path):
    from difftrain.evaluate import evaluate_buckets
    from difftrain.train import build_trainer

    cfg, _ = prepared
    cfg.train.steps, cfg.train.checkpoint_every, cfg.train.log_every = 10, 0, 1
    trainer = build_trainer(cfg, tmp_path / "run")
    trainer.fit(lambda step, total, stats: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seqs = [(r["step"], r["seq"][0]) for r in rows if "seq" in r]
    low = {s for step, s in seqs if step <= 6}
    high = {s for step, s in seqs if step > 6}
    assert low and high and max(low) < min(high), seqs          # the switch to 64/80-pixel buckets at step 6
    assert trainer.loader.state_dict()["stage"] == "high"
    # The eval is at the buckets the run ended on (the high stage's), and what it scored is what it sampled there.
    metrics, gens = evaluate_buckets(trainer.pipeline(), cfg, cfg.eval.seed, 2, 2, 1.5, tasks=("t2i",), heldout=False)
    assert metrics["stage"] == "high" and sorted(metrics["buckets"]) == ["64x64", "64x80", "80x64"]
    # each bucket's scene is its short side (64), generated on the bucket's canvas and scored there: the low
    # stage's 32-pixel scenes would show here
    assert {g.images[-1].shape[:2] for g in gens} == {(64, 64)} and len(gens) == 6
    assert all(m["t2i_color_acc"] is not None for m in metrics["by_bucket"].values())
    trainer.close()


def test_prepare_killed_with_sigkill_resumes_to_the_same_content(ray_local, export, tmp_path, prepared):
    """A real kill: ``difftrain prepare`` in its own process group (driver and its local Ray) gets SIGKILL once
    its first commit is in the manifest; the committed versions survive and a re-run completes them."""
    import signal
    import subprocess
    import sys
    import time

    store = tmp_path / "killed"
    cfg = shapes_cfg(export, store)
    from difftrain.config import to_toml
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(to_toml(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "difftrain.cli", "prepare", str(cfg_path), "--no-progress",
                             "--commit-every", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            m = st.read_manifest(str(store)) if (store / "store.json").exists() else None
            if m and m["tables"]:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "prepare finished before it could be killed: " + proc.stderr.read().decode()[-500:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    partial = table_content(str(store))
    n_partial = sum(len(v) for v in partial.values())
    assert 0 < n_partial < prepared[1]["encoded"]
    assert not (store / "curation.parquet").exists()                 # a killed run swaps no record in
    done = prepare(cfg, progress=False, commit_every=8)
    assert done["encoded"] == prepared[1]["encoded"] - n_partial     # only what was missing
    assert table_content(str(store)) == table_content(prepared[0].data.store)
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(".")) == []   # the killed run's parts are gone
    assert read_record(store / "curation.parquet").num_rows == prepared[1]["inputs"]


def test_frozen_text_encoders_store_embeddings_the_trainer_reads(ray_local, export, tmp_path, tiny, tiny_vae):
    """text.kind = 'hf' with a diffusers AutoencoderKL: prepare stores T5/CLIP embeddings at their true length;
    the loader serves them (the empty prompt's for caption dropout) and the trainer uses them instead of
    running the encoders."""
    from difftrain.data.store.loader import StoreLoader
    from difftrain.models import build_text_encoder
    from difftrain.train import build_trainer

    store = tmp_path / "hf"
    one_stage = '[{name = "s", start_step = 0, buckets = [[32, 32], [32, 48], [48, 32]], global_batch = 4}]'
    cfg = shapes_cfg(export, store, "text.kind=hf", f"text.t5_path={tiny['t5']}", f"text.clip_path={tiny['clip']}",
                     "text.max_tokens=96", "autoencoder.kind=diffusers", f"autoencoder.path={tiny_vae[1]}",
                     f"data.stages={one_stage}", "train.steps=3", "train.checkpoint_every=0",
                     "data.caption_dropout=0.5")
    summary = prepare(cfg, progress=False)
    assert summary["encoded"] == summary["kept"]
    name = "s/32x32/t2i"
    ds = lance.dataset(st.table_uri(str(store), name))
    t = ds.to_table(columns=["caption", "txt", "txt_len", "pooled"]).slice(0, 3).to_pylist()
    enc = build_text_encoder(cfg, None, "cpu").eval()
    with torch.no_grad():
        emb = enc(enc.tokenize([r["caption"] for r in t]))
    for j, r in enumerate(t):
        n = int(emb.mask_BT[j].sum())
        assert r["txt_len"] == n                       # the true length: no padding is kept
        got = st.from_bits(np.asarray(r["txt"], np.uint16), "bf16").reshape(n, -1)
        assert torch.allclose(got, emb.txt_BTD[j, :n].to(torch.bfloat16).float())
        pooled = st.from_bits(np.asarray(r["pooled"], np.uint16), "bf16")
        assert torch.allclose(pooled, emb.pooled_BP[j].to(torch.bfloat16).float())
    loader = StoreLoader(cfg, None)
    (batch, *_) = next(loader)
    assert batch.text is not None and batch.tokens == {}
    assert batch.text.txt_BTD.shape[:2] == batch.text.mask_BT.shape
    loader.close()
    trainer = build_trainer(cfg, tmp_path / "run")
    assert not trainer.text_encoder.built, "the frozen encoders were built for a run that never encodes"
    calls = []
    original = trainer.text_encoder.forward
    trainer.text_encoder.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.fit()
    assert trainer.step == 3 and not calls, "the trainer ran the frozen encoders instead of reading the store"
    assert not trainer.text_encoder.built                 # no preview asked for them: never built, never read
    trainer.close()


def test_cli_export_and_dry_run(ray_local, tmp_path, capsys):
    from difftrain.cli import main
    from difftrain.config import to_toml

    assert main(["shapes", "export", str(tmp_path / "exp"), "--n", "12", "8", "6"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["counts"] == summary["counts"]
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(to_toml(shapes_cfg(tmp_path / "exp", tmp_path / "store")))
    # the export holds a damaged file: 1 of 28 inputs over data.max_error_rate = 0.01 fails the real run, and the dry
    # run fails the same way (it used to exit 0)
    assert main(["prepare", str(cfg_path), "--dry-run", "--no-progress"]) == 2
    assert "1 of 28 inputs could not be read or decoded" in capsys.readouterr().err
    assert main(["prepare", str(cfg_path), "--dry-run", "--no-progress", "--set", "data.max_error_rate=0.05"]) == 0
    out = capsys.readouterr()
    dry = json.loads(out.out.strip().splitlines()[-1])
    assert dry["inputs"] == sum(dry["reasons"].values()) and dry["kept"] == dry["reasons"]["kept"]
    assert "score: quality < 0.5" in out.err                       # the counts per reason, printed
    assert not (tmp_path / "store").exists()
    assert main(["prepare", str(cfg_path), "--commit-every", "0"]) == 2


def _record_dit_inputs(dit) -> list[dict]:
    """Wrap the DiT's forward to record the text it is given (states, pooled, mask) on every call."""
    calls: list[dict] = []
    original = dit.forward

    def forward(img, ids, txt, t, pooled, *args, txt_mask_BT=None, **kwargs):
        calls.append({"txt": txt.detach().clone(), "pooled": pooled.detach().clone(),
                      "mask": None if txt_mask_BT is None else txt_mask_BT.detach().clone()})
        return original(img, ids, txt, t, pooled, *args, txt_mask_BT=txt_mask_BT, **kwargs)

    dit.forward = forward
    return calls


@pytest.mark.parametrize("rule", ["masked", "padded"])
def test_text_the_dit_gets_in_a_store_fed_step_is_what_sample_feeds_it(ray_local, export, tmp_path, tiny, tiny_vae,
                                                                       rule):
    """One text rule (text.padding) for every path: frozen T5 + CLIP states written by prepare, read by the store
    loader (captions dropped included) and given to the DiT by a training step equal, position for attended
    position, the states 'sample' gives it for the same captions (conditional) and for the dropped ones (CFG's
    unconditional branch), with the same masks; and the DiT's output on them is the same."""
    from difftrain.data.store.loader import StoreLoader
    from difftrain.train import build_trainer

    store = tmp_path / rule
    one_stage = '[{name = "s", start_step = 0, buckets = [[32, 32]], global_batch = 8}]'
    cfg = shapes_cfg(export, store, "text.kind=hf", f"text.t5_path={tiny['t5']}", f"text.clip_path={tiny['clip']}",
                     "text.max_tokens=96", f"text.padding={rule}", "autoencoder.kind=diffusers",
                     f"autoencoder.path={tiny_vae[1]}", f"data.stages={one_stage}", "data.latent_dtype=fp32",
                     "data.caption_dropout=0.4", "train.steps=1", "train.checkpoint_every=0", "train.ema_decay=0",
                     "train.precision=fp32")
    prepare(cfg, progress=False)
    assert st.read_manifest(str(store))["tables"]["s/32x32/t2i"]["key"]["text"]["padding"] == rule
    loader = StoreLoader(cfg, None)
    for _ in range(20):                      # a step with captions both kept and dropped
        batches = next(loader)
        prompts = [p for b in batches for p in b.prompts]
        if "" in prompts and any(prompts):
            break
    loader.close()
    assert "" in prompts and any(prompts)
    batch = batches[0]
    tr = build_trainer(cfg, tmp_path / "run")
    with torch.no_grad():                     # a DiT whose output depends on its text (not adaLN-zero's zeros)
        g = torch.Generator().manual_seed(0)
        for p in tr.dit.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    calls = _record_dit_inputs(tr.dit)
    b = tr.denoiser.on_device(batch)
    B, L, C = b.x0_BLC.shape
    x = torch.randn(B, L, C, generator=g)
    t = torch.full((B,), 0.5)
    with torch.no_grad():
        out_train, _ = tr.denoiser(b, x, t, tr.denoiser.embed_text(b))
    train_in = calls.pop()

    pipe = tr.pipeline()
    side = pipe.blank_batch([p or "a caption" for p in batch.prompts], 32, 32)
    with torch.no_grad():
        pipe.sample(side, steps=1, cfg_scale=3.0, seed=0)          # CFG: conditional and unconditional rows
    sample_in = calls.pop()
    assert sample_in["txt"].shape[0] == 2 * B
    rows = [j if p else B + j for j, p in enumerate(batch.prompts)]  # dropped: the unconditional row
    s_txt, s_pooled = sample_in["txt"][rows], sample_in["pooled"][rows]
    s_mask = sample_in["mask"][rows] if sample_in["mask"] is not None else None
    if rule == "padded":
        assert train_in["mask"] is None and s_mask is None            # nothing masked: all max_tokens attended
        assert train_in["txt"].shape[1] == s_txt.shape[1] == 96
        torch.testing.assert_close(train_in["txt"], s_txt, rtol=0, atol=1e-5)
    else:
        n_train, n_sample = train_in["mask"].sum(1), s_mask.sum(1)
        assert torch.equal(n_train, n_sample)                      # the same attended positions
        assert bool((n_train < train_in["txt"].shape[1]).any())     # and some padding to mask
        for j in range(B):
            n = int(n_train[j])
            assert train_in["mask"][j, :n].all() and s_mask[j, :n].all()
            torch.testing.assert_close(train_in["txt"][j, :n], s_txt[j, :n], rtol=0, atol=1e-5)
        assert train_in["txt"].shape[1] in (8, 16, 32, 64, 96)     # a rung of the ladder
    torch.testing.assert_close(train_in["pooled"], s_pooled, rtol=0, atol=1e-5)
    with torch.no_grad():
        out_sample = tr.dit(x, b.ids_BL3, s_txt, t, s_pooled, txt_mask_BT=s_mask)
        other = tr.dit(x, b.ids_BL3, s_txt.roll(1, 0), t, s_pooled.roll(1, 0),
                       txt_mask_BT=None if s_mask is None else s_mask.roll(1, 0))
    torch.testing.assert_close(out_train, out_sample, rtol=0, atol=1e-4)
    assert (other - out_sample).abs().max() > 1e-3                 # the text reaches the output
    tr.close()


def test_store_run_tunes_attention_at_the_micro_batches_the_loader_cuts(prepared, tmp_path, monkeypatch):
    """attention.backend = 'auto' with the store source: every (shape, micro-batch size) the run's attention meets
    was timed by the tuner (the loader cuts each bucket's share into cost-balanced micro-batches: 'low' takes a
    rank's whole share of 8, 'high' has micro_cost 64, so 4, 3 or 2, or 1 samples), no call falls back, and the trainer's per-row counts (taken from
    the batches' shapes, so that a compiled model is counted too) equal the calls the kernel saw."""
    from difftrain.models.kernels import HybridKernel, Shape
    from difftrain.train import build_trainer

    cfg, _ = prepared
    cfg = copy.deepcopy(cfg)
    cfg.train.steps, cfg.train.checkpoint_every, cfg.train.log_every = 10, 0, 1
    cfg.attention.backend = "auto"
    met = set()
    original = HybridKernel.__call__

    def recording(self, q, k, v, mask):
        met.add((Shape.of(q, mask).key, q.shape[0]))
        return original(self, q, k, v, mask)

    monkeypatch.setattr(HybridKernel, "__call__", recording)
    trainer = build_trainer(cfg, tmp_path / "run")
    summary = trainer.fit()
    table = json.loads((tmp_path / "run" / "attention_tune.json").read_text())["shapes"]
    tuned = {(key, b) for key, r in table.items() for b in r["batches"]}
    assert met and met <= tuned, sorted(met - tuned)
    assert len({b for _, b in met}) > 1, met          # micro-batches of several sizes were met, and tuned as met
    kernel = trainer.attention_kernel
    assert not kernel.unknown and kernel.calls["fallback"] == 0
    assert summary["attention_calls"] == kernel.calls and kernel.calls["tuned"] > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("attention_tuned_calls", 0) for r in rows) == kernel.calls["tuned"]
    assert all(r.get("attention_fallback_calls") == 0 for r in rows if "loss" in r)
    trainer.close()


def test_a_folder_of_images_with_txt_captions_trains_from_a_two_line_config(ray_local, tmp_path, monkeypatch,
                                                                           capsys):
    """The first recipe of docs/fine-tuning.md, as a newcomer writes it: ``extends`` a preset and one source line
    naming a folder of images with ``.txt`` captions (kind and name default); prepare, then train from the store."""
    from PIL import Image

    from difftrain.cli import main
    from difftrain.shapes.world import ShapesWorld

    photos = tmp_path / "my-images"
    photos.mkdir()
    world = ShapesWorld(5, 48, 3)
    for i in range(36):
        img, caption, _ = world.t2i(i)
        Image.fromarray(img).save(photos / f"img_{i:03d}.png")
        (photos / f"img_{i:03d}.txt").write_text(caption + "\n")
    (tmp_path / "run.toml").write_text('extends = "shapes-folder"\ndata.sources = [{path = "my-images"}]\n')
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "run.toml", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kept"] == summary["inputs"] == 36
    rec = read_record("shapes-folder-store/curation.parquet").to_pylist()
    assert {r["source"] for r in rec} == {"my-images"} and rec[0]["caption"] == open(
        photos / f"{rec[0]['key']}.txt").read().strip()
    assert main(["train", "run.toml", "--run-dir", "runs/mine", "--no-progress", "--set", "train.steps=2", "--set",
                 "train.checkpoint_every=0", "--set", "train.log_every=1"]) == 0
    rows = [json.loads(x) for x in Path("runs/mine/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(r["task"] == "t2i" for r in rows if "task" in r)
    assert (tmp_path / "runs" / "mine" / "export" / "model.safetensors").is_file()
