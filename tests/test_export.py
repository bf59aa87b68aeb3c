"""``export_checkpoint``: the EMA / raw weights of a real training checkpoint, read without a process group or
a model, written as a difftrain export (equal to ``Trainer.export``'s) or as a diffusers FLUX transformer;
from one shard file or from the shard files of a 2-rank FSDP run; refusals and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from difftrain.config import load_config, to_dict, to_toml
from difftrain.errors import UserError
from difftrain.export import export_checkpoint
from difftrain.models import build_dit, config_dit_params
from difftrain.models.dit import MMDiT
from difftrain.models.flux_adapter import from_diffusers
from difftrain.parallel.pretrained import load_pretrained
from difftrain.tokens import image_ids
from difftrain.train.checkpoint import Checkpointer
from difftrain.train.ema import EMA
from difftrain.train import build_trainer

from conftest import TINY, run_diffusers_flux, run_ours_flux

# 3 steps: the EMA (decay warm-up 0.1 .. 0.17) is well apart from the raw weights.
RUN = TINY + ["train.steps=3", "train.checkpoint_every=0", "train.ema_decay=0.9", "train.threads=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run: the Trainer (its in-memory EMA and parameters) and its run directory (checkpoint, export)."""
    run = tmp_path_factory.mktemp("export") / "run"
    tr = build_trainer(load_config(None, RUN), run)
    tr.fit()
    tr.close()
    return tr, run


def _saved(tmp_path: Path, *overrides: str, ema: bool = True) -> Path:
    """A checkpoint of an initialised (untrained) DiT, for configs that need no training to test."""
    cfg = load_config(None, TINY + list(overrides))
    model = torch.nn.ModuleDict({"dit": build_dit(config_dit_params(cfg), seed=1)})
    return Checkpointer(tmp_path / "run").save(1, model, None, EMA(model, 0.9) if ema else None,
                                               {"config": to_dict(cfg)}, blocking=True).path


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:4]
    for k, v in want.items():
        assert torch.equal(got[k], v.detach()), k


def test_ema_export_equals_the_trainers_ema_and_its_own_export(trained, tmp_path):
    tr, run = trained
    out = tmp_path / "out"
    res = export_checkpoint(run, out)
    ema = tr.ema.state_dict()
    got = load_file(str(out / "model.safetensors"))
    assert any(k.startswith("text.") for k in got) and any(k.startswith("dit.") for k in got)
    _assert_equal(got, ema)
    _assert_equal(got, load_file(str(run / "export" / "model.safetensors")))      # Trainer.export's file
    assert (out / "config.toml").read_text() == (run / "export" / "config.toml").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "difftrain-weights/1", "step": "3", "weights": "ema"}
    assert res == {"out": str(out), "tensors": len(ema), "bytes": sum(v.numel() * 4 for v in ema.values()),
                   "step": 3, "weights": "ema", "dtype": "fp32", "layout": "difftrain", "shards": 1}
    # model.init_from takes it as it takes the trainer's export
    dit = build_dit(tr.dit.params, seed=7)
    assert load_pretrained(dit, out)["kind"] == "difftrain"
    _assert_equal({f"dit.{k}": v for k, v in dit.named_parameters()},
                  {k: v for k, v in ema.items() if k.startswith("dit.")})


def test_raw_weights_and_bf16(trained, tmp_path):
    tr, run = trained
    res = export_checkpoint(run / "checkpoints" / "latest", tmp_path / "raw", weights="raw")
    raw = load_file(str(tmp_path / "raw" / "model.safetensors"))
    _assert_equal(raw, dict(tr.model.named_parameters()))
    ema = tr.ema.state_dict()
    assert sum(not torch.equal(raw[k], ema[k]) for k in ema) > len(ema) // 2     # a mix-up would show
    assert res["weights"] == "raw" and res["tensors"] == len(raw)

    step_dir = run / "checkpoints" / "step_00000003"
    res = export_checkpoint(step_dir, tmp_path / "bf16", dtype="bf16")
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    _assert_equal(half, {k: v.to(torch.bfloat16) for k, v in ema.items()})
    assert res["bytes"] == sum(v.numel() * 2 for v in ema.values())


def test_small_read_groups_give_the_same_file(trained, tmp_path):
    """Tensors are read and written a few at a time: the file does not depend on the group size."""
    _, run = trained
    export_checkpoint(run, tmp_path / "one")
    export_checkpoint(run, tmp_path / "many", group_bytes=1)
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == \
        (tmp_path / "many" / "model.safetensors").read_bytes()


def test_diffusers_layout_loads_in_diffusers_and_matches_our_model(trained, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    tr, run = trained
    out = tmp_path / "flux"
    res = export_checkpoint(run, out, layout="diffusers", group_bytes=4096)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "transformer", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"]
    p = tr.dit.params
    ema = {k[len("dit."):]: v for k, v in tr.ema.state_dict().items() if k.startswith("dit.")}
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    sd = theirs.state_dict()
    assert res["tensors"] == len(sd) and res["shards"] == 1 and res["layout"] == "diffusers"
    _assert_equal(from_diffusers(sd, p), ema)                   # bit for bit back to our tensors

    ours = MMDiT(p).eval()
    ours.load_state_dict(ema)
    g = torch.Generator().manual_seed(0)
    ids = image_ids(3, 4)
    x, txt = torch.randn(2, 12, p.in_channels, generator=g), torch.randn(2, 5, p.text_dim, generator=g)
    pooled, t = torch.randn(2, p.pooled_dim, generator=g), torch.rand(2, generator=g)
    want, got = run_ours_flux(ours, x, ids, txt, pooled, t, None), run_diffusers_flux(theirs, x, ids, txt, pooled, t, None)
    assert want.abs().max() > 1e-3, "the output is ~0: the comparison would prove nothing"
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    # and our own loader reads it as a diffusers transformer
    dit = build_dit(p, seed=7)
    assert load_pretrained(dit, out)["kind"] == "diffusers"
    _assert_equal(dict(dit.named_parameters()), ema)


@pytest.mark.parametrize("override, reason", [
    ("model.abs_pos_embed=true", "absolute position embedding"),
    ("diffusion.prediction=x", "prediction = 'x'"),
    ("model.qkv_bias=false", "qkv bias"),
])
def test_diffusers_layout_refuses_models_it_cannot_express(tmp_path, override, reason):
    ckpt = _saved(tmp_path, override)
    with pytest.raises(UserError, match=reason):
        export_checkpoint(ckpt, tmp_path / "out", layout="diffusers")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]          # no OUT, no partial folder
    assert export_checkpoint(ckpt, tmp_path / "out")["layout"] == "difftrain"


def test_a_checkpoint_without_ema(tmp_path):
    ckpt = _saved(tmp_path, ema=False)
    with pytest.raises(UserError, match=r"ema_decay = 0.*--weights raw"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert export_checkpoint(ckpt, tmp_path / "out", weights="raw")["tensors"] > 0


def test_bad_input_and_existing_output(trained, tmp_path):
    _, run = trained
    with pytest.raises(UserError, match="no such checkpoint"):
        export_checkpoint(tmp_path / "nope", tmp_path / "a")
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="not a difftrain checkpoint"):
        export_checkpoint(tmp_path / "plain", tmp_path / "a")
    for kwargs in ({"weights": "best"}, {"layout": "onnx"}, {"dtype": "fp16"}):
        with pytest.raises(UserError, match="expected one of"):
            export_checkpoint(run, tmp_path / "a", **kwargs)

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_checkpoint(run, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_checkpoint(run, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "model.safetensors"]
    (tmp_path / "empty").mkdir()
    export_checkpoint(run, tmp_path / "empty")                          # an empty folder is taken
    for target in (run, run / "checkpoints" / "step_00000003"):         # never over the checkpoint itself
        with pytest.raises(UserError, match="holds the checkpoint"):
            export_checkpoint(run, target, overwrite=True)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_two_rank_fsdp_checkpoint_exports_from_its_shard_files(trained, tmp_path):
    """The same run on 2 gloo ranks (FSDP: each rank writes its own shard file) exports from both files to
    what that run's Trainer.export gathered, and to the 1-process run's weights up to reduction order."""
    tr, _ = trained
    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(to_toml(load_config(None, RUN)))
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "difftrain", "train", str(cfg_path), "--run-dir", str(run), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = Checkpointer.read_info(run)["path"]
    assert len(list(Path(ckpt).glob("*.safetensors"))) == 2
    stored = HuggingFaceStorageReader(ckpt).read_metadata().state_dict_metadata
    assert len(stored["ema.dit.img_in.weight"].chunks) == 2                # rows split between the two files

    res = export_checkpoint(run, tmp_path / "ema")
    assert res["shards"] == 2 and res["step"] == 3
    got = load_file(str(tmp_path / "ema" / "model.safetensors"))
    _assert_equal(got, load_file(str(run / "export" / "model.safetensors")))
    for k, v in tr.ema.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)
    export_checkpoint(run, tmp_path / "raw", weights="raw", layout="diffusers")
    raw = from_diffusers(load_file(str(tmp_path / "raw" / "transformer" / "diffusion_pytorch_model.safetensors")),
                         tr.dit.params)
    for k, v in tr.dit.named_parameters():
        torch.testing.assert_close(raw[k], v.detach(), rtol=1e-4, atol=1e-6, msg=k)

    # a lost shard file is an error, not a silently smaller or partly uninitialised tensor: the marker says
    # so; without the marker's list (a foreign copy), the shard headers do
    for lost in sorted(Path(ckpt).glob("*.safetensors")):
        broken = tmp_path / f"without-{lost.stem}"
        shutil.copytree(ckpt, broken)
        (broken / lost.name).unlink()
        with pytest.raises(UserError, match="missing"):
            export_checkpoint(broken, tmp_path / "x")
        marker = json.loads((broken / "COMPLETE.json").read_text())
        del marker["files"][lost.name]
        (broken / "COMPLETE.json").write_text(json.dumps(marker))
        with pytest.raises(UserError, match="incomplete checkpoint|missing shard"):
            export_checkpoint(broken, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_bf16_trained_run_exports_bf16_by_default_on_both_paths(tmp_path):
    """A run that computed in bf16 (train.precision = bf16; 'auto' on a GPU) writes its end-of-run export in bf16,
    and `difftrain export` of its checkpoint defaults to bf16 too (FLUX.1-dev's 24 GB file, not 48 GB of fp32);
    fp32 on request on either path; a run that computed in fp32 keeps fp32."""
    run = tmp_path / "bf16"
    tr = build_trainer(load_config(None, RUN + ["train.precision=bf16"]), run)
    tr.fit()
    ema = {k: v.to(torch.bfloat16) for k, v in tr.ema.state_dict().items()}
    tr.close()
    assert Checkpointer.read_info(run)["compute_dtype"] == "bf16"
    end = load_file(str(run / "export" / "model.safetensors"))
    _assert_equal(end, ema)
    res = export_checkpoint(run, tmp_path / "cli")
    assert res["dtype"] == "bf16" and res["bytes"] == sum(v.numel() * 2 for v in ema.values())
    _assert_equal(load_file(str(tmp_path / "cli" / "model.safetensors")), end)
    assert export_checkpoint(run, tmp_path / "fp32", dtype="fp32")["dtype"] == "fp32"
    assert load_file(str(tmp_path / "fp32" / "model.safetensors"))["dit.img_in.weight"].dtype == torch.float32

    forced = tmp_path / "forced"
    tr = build_trainer(load_config(None, RUN + ["train.precision=bf16", "train.export_dtype=fp32", "train.steps=1"]),
                       forced)
    tr.fit()
    tr.close()
    assert {v.dtype for v in load_file(str(forced / "export" / "model.safetensors")).values()} == {torch.float32}
