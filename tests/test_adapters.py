"""Adapters on the flow-matching objective: LoRA and LoKr (peft) on a frozen base read from ``model.init_from``,
under FSDP2 on 2 gloo ranks (torchrun) equal to 1 rank, a resume that is exact, checkpoints that hold the adapters
alone with the base's digest (checked on resume), sampling from them, and each refusal one line naming the key."""

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
from safetensors.torch import load_file, save_file

from difftrain.cli import main
from difftrain.config import load_config, to_toml
from difftrain.errors import UserError
from difftrain.train.metrics import read_metrics

from conftest import TINY

pytestmark = pytest.mark.slow

RUN = TINY + ["train.global_batch=8", "train.ema_decay=0.9", "train.threads=1", "data.caption_dropout=0.3",
              "train.warmup_steps=1", "train.schedule=constant"]
ADAPTED = ["adapter.rank=4", "adapter.alpha=8", "train.lr=3e-3", "train.checkpoint_every=4"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A base model: 20 steps of the tiny config, exported (RUN/export/model.safetensors)."""
    root = tmp_path_factory.mktemp("adapters")
    cfg = root / "base.toml"
    cfg.write_text(to_toml(load_config(None, RUN + ["train.steps=20", "train.lr=3e-3", "train.checkpoint_every=0"])))
    assert main(["train", str(cfg), "--run-dir", str(root / "base"), "--no-progress"]) == 0
    return root / "base" / "export"


def _config(path: Path, base: Path, *sets: str) -> Path:
    path.write_text(to_toml(load_config(None, RUN + ADAPTED + [f"model.init_from={base}", *sets])))
    return path


def _train(config: Path, run_dir: Path, ranks: int = 1, *args: str) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
              if ranks > 1 else [sys.executable])
    proc = subprocess.run(launch + ["-m", "difftrain", "train", str(config), "--run-dir", str(run_dir), "--no-progress",
                                    *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _checkpoint_keys(step_dir: Path) -> list[str]:
    keys = []
    for f in step_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys += list(h.keys())
    return keys


@pytest.fixture(scope="module")
def base128(tmp_path_factory) -> Path:
    """A base whose block linears all hold whole NF4 blocks (64 x 256 values: width 128)."""
    root = tmp_path_factory.mktemp("adapters128")
    cfg = root / "base.toml"
    cfg.write_text(to_toml(load_config(None, RUN + WIDE + ["train.steps=10", "train.lr=3e-3",
                                                           "train.checkpoint_every=0"])))
    assert main(["train", str(cfg), "--run-dir", str(root / "base"), "--no-progress"]) == 0
    return root / "base" / "export"


WIDE = ["model.hidden=128", "model.axes_dims_rope=[16, 24, 24]"]


@pytest.mark.parametrize("kind, precision", [("lora", "bf16"), ("lokr", "fp8"), ("lora", "nf4")])
def test_an_adapter_on_two_ranks_is_one_rank_and_resumes_exactly(base, base128, tmp_path, kind, precision):
    """8 steps on 2 FSDP2 ranks; 4 steps on 1 rank, then resumed to 8: the same losses, on a full-precision and on
    an fp8 and an nf4 base (not sharded: whole on each rank; nf4 under full activation checkpointing). The checkpoints hold the adapters (and the small frozen
    word encoder), their optimizer state and EMA, none of the base; the base's digest is recorded; the export holds
    the adapter apart (the base is model.init_from, the user's own file)."""
    if precision == "nf4":
        base = base128
    sets = [f"adapter.kind={kind}", f"adapter.base_precision={precision}",
            *(WIDE + ["parallel.ac=full"] if precision == "nf4" else []),          # recomputed quantized layers too
            *(["adapter.export=merge"] if precision == "bf16" else [])]
    cfg = _config(tmp_path / "a.toml", base, *sets, "train.steps=8")
    two = _train(cfg, tmp_path / "two", 2)
    assert json.loads(two.stdout.strip().splitlines()[-1])["world_size"] == 2
    short = _config(tmp_path / "short.toml", base, *sets, "train.steps=4")
    _train(short, tmp_path / "one")
    _train(cfg, tmp_path / "one", 1, "--allow-config-change", "train.steps")
    losses = {r: {m["step"]: m["loss"] for m in read_metrics(tmp_path / r)} for r in ("two", "one")}
    assert [losses["one"][s] for s in range(1, 9)] == pytest.approx([losses["two"][s] for s in range(1, 9)], rel=1e-4)

    ckpt = tmp_path / "two" / "checkpoints" / "step_00000008"
    keys = _checkpoint_keys(ckpt)
    marker = "lora_" if kind == "lora" else "lokr_"
    base_keys = [k for k in keys if k.startswith(("model.dit.", "optim.", "ema.")) and marker not in k]
    assert not base_keys, base_keys[:5]
    assert any(k.startswith("optim.") and marker in k for k in keys) and any(k.startswith("ema.") for k in keys)
    info = json.loads((ckpt / "trainer.json").read_text())
    assert info["adapter"]["kind"] == kind and info["adapter_base"]["source"] == str(base / "model.safetensors")
    assert len(info["adapter_base"]["digest"]) == 64
    if precision == "bf16":             # adapter.export = 'merge': a plain model, the targets moved, the rest the base
        merged, plain = load_file(str(tmp_path / "two" / "export" / "model.safetensors")), \
            load_file(str(base / "model.safetensors"))
        assert merged.keys() == plain.keys()
        moved = {k for k in merged if not torch.equal(merged[k], plain[k])}
        assert moved and all(k.endswith((".qkv.weight", ".proj.weight", ".linear1.weight", ".linear2.weight",
                                         "_mlp.0.weight", "_mlp.2.weight")) or k.startswith("text.") for k in moved)
        assert not (tmp_path / "two" / "export" / "adapter").exists()
        return
    zeroed = ".lora_B." if kind == "lora" else ".lokr_w1."          # the factor that starts at zero has moved
    adapter = load_file(str(tmp_path / "two" / "export" / "adapter" / "model.safetensors"))
    assert any(zeroed in k and v.abs().max() > 0 for k, v in adapter.items())
    assert not (tmp_path / "two" / "export" / "model.safetensors").exists()
    assert json.loads((tmp_path / "two" / "export" / "adapter" / "adapter_config.json").read_text())["kind"] == kind


def test_the_sampled_model_is_the_base_with_the_trained_adapter(base, tmp_path):
    """``load_pipeline`` rebuilds an adapter checkpoint from its base (model.init_from) and its adapters (EMA):
    the base layers are the base file's, the adapters the checkpoint's, and the adapted model differs from the
    base."""
    from difftrain.inference import load_pipeline
    from difftrain.models.lora import adapters_disabled, base_name, is_adapter

    cfg = _config(tmp_path / "a.toml", base, "adapter.kind=lora", "train.steps=4")
    _train(cfg, tmp_path / "run")
    pipe, _, info = load_pipeline(tmp_path / "run")
    dit = pipe.model["dit"]
    base_sd = load_file(str(base / "model.safetensors"))
    for k, v in dit.named_parameters():
        if not is_adapter(k):
            assert torch.equal(v.detach(), base_sd[f"dit.{base_name(k)}"].to(v.dtype)), k
    ema = load_file(str(tmp_path / "run" / "export" / "adapter" / "model.safetensors"))
    for k, v in dit.named_parameters():
        if is_adapter(k):
            assert torch.allclose(v.detach(), ema[f"dit.{k}"].float()), k
    x = torch.randn(1, 16, dit.params.in_channels)
    ids = torch.zeros(1, 16, 3, dtype=torch.long)
    ids[0, :, 1], ids[0, :, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    txt, vec = torch.randn(1, 5, dit.params.text_dim), torch.randn(1, dit.params.pooled_dim)
    t = torch.tensor([0.7])
    with torch.no_grad():
        adapted = dit(x, ids, txt, t, vec)
        with adapters_disabled(dit):
            plain = dit(x, ids, txt, t, vec)
    assert (adapted - plain).abs().max() > 1e-4


def test_a_changed_base_is_refused_on_resume(base, tmp_path):
    """The adapters were trained on one base; the file at model.init_from is changed (same size, one weight
    moved): the resume is refused naming both digests, and the checkpoint is left as it was."""
    mine = tmp_path / "base"
    shutil.copytree(base, mine)
    cfg = _config(tmp_path / "a.toml", mine, "adapter.kind=lora", "adapter.dropout=0.1", "train.steps=4")
    _train(cfg, tmp_path / "run")
    sd = load_file(str(mine / "model.safetensors"))
    k = next(k for k in sd if k.endswith("qkv.weight"))
    sd[k] = sd[k] + 0.01
    save_file(sd, str(mine / "model.safetensors"), metadata=safe_open(str(base / "model.safetensors"), "pt").metadata())
    more = _config(tmp_path / "b.toml", mine, "adapter.kind=lora", "adapter.dropout=0.1", "train.steps=6")
    proc = subprocess.run([sys.executable, "-m", "difftrain", "train", str(more), "--run-dir", str(tmp_path / "run"),
                           "--no-progress", "--allow-config-change", "train.steps"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    err = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "adapters were trained on the base" in err[0] and "model.init_from" in err[0], \
        proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_00000004"]


@pytest.mark.parametrize("sets, key", [
    (["adapter.kind=lora", "adapter.targets=['nope']"], "adapter.targets"),
    (["adapter.kind=lora", "model.init_from="], "model.init_from"),
    (["adapter.kind=lokr", "train.fp8=all"], "train.fp8"),
    (["adapter.kind=dora"], "adapter.kind"),
    (["adapter.kind=lora", "adapter.rank=0"], "adapter.rank"),
    (["adapter.kind=lora", "adapter.dropout=1.5"], "adapter.dropout"),
    (["adapter.kind=lora", "adapter.base_precision=nf4", "adapter.export=merge"], "adapter.export"),
    (["adapter.kind=lora", "adapter.base_precision=fp8", "train.compile=true"], "train.compile"),
    (["adapter.kind=lora", "adapter.base_precision=nf4", "parallel.cpu_offload=true"], "cpu_offload"),
])
def test_each_refusal_is_one_line_naming_the_key(base, tmp_path, capsys, sets, key):
    args = [f"--set={s}" for s in RUN + ADAPTED + [f"model.init_from={base}", "train.steps=2", *sets]]
    assert main(["train", "shapes-tiny", "--run-dir", str(tmp_path / "r"), "--no-progress", *args]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and key in err[0], err
    assert not (tmp_path / "r" / "checkpoints").exists() or not any((tmp_path / "r" / "checkpoints").iterdir())


def test_dpo_adapter_kinds_need_the_lora_reference(tmp_path):
    from difftrain.train.adapters import check_adapter_config

    dpo = ["dpo.init=ckpt"]                                 # a DPO config: refused when it is read
    with pytest.raises(UserError, match="dpo.reference"):
        load_config(None, dpo + ["adapter.kind=lokr", "dpo.reference=copy"])
    spec = check_adapter_config(load_config(None, dpo + ["dpo.reference=lora", "dpo.lora_rank=8"]), dpo=True)
    assert (spec.kind, spec.rank, spec.key) == ("lora", 8, "dpo")
    spec = check_adapter_config(load_config(None, dpo + ["dpo.reference=lora", "adapter.kind=lokr"]), dpo=True)
    assert spec.kind == "lokr"


@pytest.fixture(scope="module")
def adapter_run(base, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter_run")
    _train(_config(root / "a.toml", base, "adapter.kind=lora", "train.steps=4"), root / "run")
    return root / "run"


def _dit_out(pipe) -> torch.Tensor:
    dit = pipe.model["dit"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, dit.params.in_channels, generator=g)
    ids = torch.zeros(2, 16, 3, dtype=torch.long)
    ids[:, :, 1], ids[:, :, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    txt, vec = torch.randn(2, 5, dit.params.text_dim, generator=g), torch.randn(2, dit.params.pooled_dim, generator=g)
    with torch.no_grad():
        return dit(x, ids, txt, torch.tensor([0.3, 0.8]), vec)


def test_adapters_folded_at_a_strength_when_sampling(base, adapter_run, tmp_path):
    """``--adapter`` on a base: folded into the weights, it computes what the adapter run itself computes (its
    adapters live in peft layers); its export/adapter folder and its diffusers-format export (``export --adapter``,
    read back into our fused layers) are the same adapter; scale 0 is the base; two adapters add up (the same one
    twice at 1 = once at 2)."""
    from difftrain.adapter_export import export_adapter
    from difftrain.inference import load_pipeline

    base_run = base.parent
    plain = _dit_out(load_pipeline(base_run)[0])
    own = _dit_out(load_pipeline(adapter_run)[0])
    pipe, _, info = load_pipeline(base_run, adapters=[(str(adapter_run), 1.0)])
    assert info["adapters"][0]["kind"] == "lora" and info["adapters"][0]["scale"] == 1.0
    folded = _dit_out(pipe)
    assert (own - plain).abs().max() > 1e-4
    assert torch.allclose(folded, own, atol=1e-5, rtol=0)
    assert torch.allclose(_dit_out(load_pipeline(base_run, adapters=[(str(adapter_run / "export" / "adapter"), 1.0)])[0]),
                          own, atol=1e-5, rtol=0)
    export_adapter(adapter_run, tmp_path / "diffusers")
    pipe, _, info = load_pipeline(base_run, adapters=[(str(tmp_path / "diffusers"), 1.0)])
    assert info["adapters"][0]["layout"] == "diffusers"
    assert torch.allclose(_dit_out(pipe), own, atol=1e-5, rtol=0)
    assert torch.equal(_dit_out(load_pipeline(base_run, adapters=[(str(adapter_run), 0.0)])[0]), plain)
    twice = _dit_out(load_pipeline(base_run, adapters=[(str(adapter_run), 1.0)] * 2)[0])
    double = _dit_out(load_pipeline(base_run, adapters=[(str(adapter_run), 2.0)])[0])
    assert torch.allclose(twice, double, atol=1e-5, rtol=0) and (double - folded).abs().max() > 1e-5


def test_sample_eval_and_candidates_take_adapters_and_refuse_bad_ones(base, adapter_run, tmp_path, capsys):
    base_run = str(base.parent)

    def cli(*args, ok=True):             # the CLI in this process: its exit code, its JSON line or its error line
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        assert (code == 0) == ok, err[-2000:]
        if not ok:
            lines = [x for x in err.splitlines() if x.startswith("error:")]
            assert code == 2 and len(lines) == 1, err[-2000:]
            return lines[0]
        return json.loads(out.strip().splitlines()[-1])

    got = cli("sample", base_run, "--prompt", "a red circle", "--num-images", "1", "--steps", "2", "--out",
              str(tmp_path / "s"), "--adapter", str(adapter_run), "--adapter-scale", "0.5")
    assert got["adapters"][0]["scale"] == 0.5 and Path(got["images"][0]).is_file()
    got = cli("eval", base_run, "--json", "--n", "2", "--steps", "2", "--adapter", str(adapter_run))
    assert got["adapters"][0]["path"] == str(Path(adapter_run, "checkpoints", "step_00000004"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    cli("candidates", base_run, str(prompts), "--k", "1", "--out", str(tmp_path / "c"), "--steps", "2",
        "--no-progress", "--adapter", str(adapter_run))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["adapters"][0]["scale"] == 1.0 and manifest["adapters"][0]["step"] == 4
    # resuming those candidates without the adapter is refused: they would mix two models
    assert "adapters" in cli("candidates", base_run, str(prompts), "--k", "1", "--out", str(tmp_path / "c"),
                             "--steps", "2", "--no-progress", ok=False)
    assert "--adapter-scale" in cli("sample", base_run, "--prompt", "x", "--adapter", str(adapter_run),
                                    "--adapter-scale", "nan", ok=False)
    assert "--adapter-scale" in cli("sample", base_run, "--prompt", "x", "--adapter", str(adapter_run),
                                    "--adapter", str(adapter_run), "--adapter-scale", "1", "--adapter-scale", "1",
                                    "--adapter-scale", "1", ok=False)
    assert "trained no adapter" in cli("sample", base_run, "--prompt", "x", "--adapter", base_run, ok=False)
    assert "--adapter" in cli("sample", base_run, "--prompt", "x", "--adapter", str(tmp_path), ok=False)
    # hostile adapter files: each one line naming the file, never a traceback or a model of NaNs
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    assert "junk.safetensors" in cli("sample", base_run, "--prompt", "x", "--adapter", str(tmp_path / "junk.safetensors"),
                                     ok=False)
    bad = tmp_path / "bad"
    shutil.copytree(adapter_run / "export" / "adapter", bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "rank": 0}))
    assert "rank" in cli("sample", base_run, "--prompt", "x", "--adapter", str(bad), ok=False)
    sd = load_file(str(adapter_run / "export" / "adapter" / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in sd.items()}, str(tmp_path / "nan.safetensors"))
    (tmp_path / "nan").mkdir()
    shutil.copy(tmp_path / "nan.safetensors", tmp_path / "nan" / "model.safetensors")
    shutil.copy(adapter_run / "export" / "adapter" / "adapter_config.json", tmp_path / "nan")
    assert "NaN" in cli("sample", base_run, "--prompt", "x", "--adapter", str(tmp_path / "nan"), ok=False)
    lora = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.full((4, 32), float("nan")),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4)}
    save_file(lora, str(tmp_path / "d_nan.safetensors"))
    assert "finite" in cli("sample", base_run, "--prompt", "x", "--adapter", str(tmp_path / "d_nan.safetensors"),
                           ok=False)
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4)},
              str(tmp_path / "d_shape.safetensors"))
    assert "does not fit 'double_blocks.0.img_attn.qkv'" in cli(
        "sample", base_run, "--prompt", "x", "--adapter", str(tmp_path / "d_shape.safetensors"), ok=False)


@pytest.mark.parametrize("precision, kind", [("fp8", "Float8Tensor"), ("nf4", "NF4Tensor")])
def test_a_quantized_base_holds_every_block_linear_quantized_and_trains_close_to_the_full_one(
        base128, tmp_path, monkeypatch, precision, kind):
    """adapter.base_precision: every frozen block linear (the adapted ones' base layers and the modulation) is held
    quantized, the adapters and the embedders are not; the first loss is the full-precision base's within a few
    percent but not equal to it (the quantization is in effect); the base is read a layer at a time, never allocated
    whole in full precision; sampling rebuilds the same quantized base."""
    from difftrain.inference import load_pipeline
    from difftrain.models.base_quant import stored_bytes
    from difftrain.models import base_quant
    from difftrain.train import build_trainer

    whole = []                  # at each layer's quantization: how many base layers are allocated in full precision
    chosen = []                 # the factory's layers to quantize (the last build's)
    choose, quantize = base_quant.base_layers, base_quant.quantize_layer

    def choosing(dit, precision):
        chosen[:] = [choose(dit, precision)]
        return chosen[0]

    def counting(layer, precision):
        if chosen and any(layer is m for m in chosen[0].values()):     # (not the device trial's small layer)
            whole.append(sum(type(m.weight.data) is torch.Tensor and not m.weight.is_meta
                             for m in chosen[0].values()))
        quantize(layer, precision)

    monkeypatch.setattr(base_quant, "base_layers", choosing)
    monkeypatch.setattr(base_quant, "quantize_layer", counting)

    def first_loss(p, run):
        cfg = load_config(None, RUN + ADAPTED + WIDE + [f"model.init_from={base128}", "adapter.kind=lora",
                                                        f"adapter.base_precision={p}", "train.steps=2"])
        tr = build_trainer(cfg, tmp_path / run)
        layers = {n: type(m.weight.data).__name__ for n, m in tr.dit.named_modules()
                  if isinstance(m, torch.nn.Linear) and n.startswith(("double_blocks", "single_blocks"))
                  and ".lora_" not in n}
        top = type(tr.dit.img_in.weight.data).__name__
        size = stored_bytes(tr.dit)
        tr.fit()
        tr.close()
        return read_metrics(tmp_path / run)[0]["loss"], layers, top, size

    full, _, _, full_bytes = first_loss("bf16", "full")
    q, layers, top, q_bytes = first_loss(precision, "q")
    assert layers and set(layers.values()) == {kind}, layers
    # read layer by layer: the one being quantized is the only one in full precision (never the whole base)
    assert len(whole) == len(layers) and max(whole) == 1, whole
    assert top == "Tensor" and q_bytes < (0.45 if precision == "fp8" else 0.3) * full_bytes
    assert q != full and abs(q - full) < 0.05 * full

    # sampling reads the base the same way: a layer at a time, each quantized once whole
    from difftrain.models.base_quant import base_layers
    from difftrain.parallel import pretrained

    read_through = pretrained.load_pretrained
    alive = []

    def counting_read(dit, path, on_loaded=None, materialize=None, **more):
        base = base_layers(dit, precision)

        def loaded(name):
            if name in base:
                alive.append(sum(type(m.weight.data) is torch.Tensor and not m.weight.is_meta for m in base.values()))
            on_loaded(name)
        return read_through(dit, path, on_loaded=loaded, materialize=materialize, **more)

    monkeypatch.setattr(pretrained, "load_pretrained", counting_read)
    pipe, _, _ = load_pipeline(tmp_path / "q")
    assert {type(m.weight.data).__name__ for n, m in pipe.model["dit"].named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("double_blocks") and ".lora_" not in n} == {kind}
    assert len(alive) == len(layers) and max(alive) == 1, alive


def test_a_quantized_base_without_torchao_or_an_adapter_is_refused(monkeypatch):
    from difftrain.models.base_quant import check_base_precision
    from difftrain.train.adapters import check_adapter_config

    with pytest.raises(UserError, match="adapter.base_precision.*adapter.kind"):
        check_adapter_config(load_config(None, ["adapter.base_precision=nf4"]))
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(UserError, match="adapter.base_precision = 'fp8' needs torchao"):
        check_base_precision("fp8", torch.device("cpu"))


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_a_quantized_layer_dequantized_by_pieces_is_the_whole_layer(monkeypatch, precision):
    """Forward and input gradient of a quantized frozen layer computed a few rows at a time (as the trainer does)
    equal those of the whole dequantized weight, for shapes whose rows split unevenly into NF4's blocks."""
    from difftrain.models import base_quant
    from difftrain.models.base_quant import dequantized, pieces, quantize_layer

    monkeypatch.setattr(base_quant, "CHUNK_ELEMENTS", 40000)
    for out_f, in_f in ((256, 1280), (1792, 256), (384, 128), (576, 192), (192, 960)):   # (the last two: scaler 64)
        layer = torch.nn.Linear(in_f, out_f).requires_grad_(False)
        quantize_layer(layer, precision)
        assert len(pieces(layer.weight)) > 1
        x = torch.randn(5, in_f, requires_grad=True)
        y = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
        w = dequantized(layer.weight, torch.float32)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, layer.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, g @ w, rtol=1e-5, atol=1e-5)


def test_nf4_holds_every_block_linear_of_a_width_192_model():
    """The scales' block is 256 (QLoRA's) where a weight allows, else 128 or 64: the shapes model (width 192), whose
    attention and single-block linears are not whole 64 x 256 blocks, is quantized whole; a size that is not a
    multiple of 64 x 64 is not."""
    from difftrain.models import build_dit, config_dit_params
    from difftrain.models.base_quant import base_layers, nf4_scaler_block

    assert [nf4_scaler_block(s) for s in ((256, 1280), (576, 192), (192, 192), (100, 30))] == [256, 64, 64, None]
    dit = build_dit(config_dit_params(load_config(None, ["model.hidden=192", "model.heads=6"])), device="meta")
    dit.requires_grad_(False)                                          # a frozen base
    blocks = [n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in n]
    assert len(base_layers(dit, "nf4")) == len(blocks) == len(base_layers(dit, "fp8"))


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_previews_show_the_base_the_weights_and_their_ema_side_by_side(base, tmp_path, adapter):
    """Every preview row holds the base's images (an adapter run: adapters disabled; a full fine-tune: its weights
    at step 0, kept for restarts), the current weights' and the EMA's, at fixed seeds; TensorBoard gets the grid."""
    from PIL import Image

    from difftrain.evaluate import preview_rows
    from difftrain.train import build_trainer

    sets = RUN + [f"model.init_from={base}", "train.steps=4", "train.sample_every=2", "train.lr=3e-3",
                  "train.checkpoint_every=2", "sample.steps=2"]
    if adapter == "lora":
        sets += ADAPTED[:2]
    cfg = load_config(None, sets + [f"adapter.kind={adapter}"])
    tr = build_trainer(cfg, tmp_path / "run")
    fresh = build_trainer(load_config(None, sets + [f"adapter.kind={adapter}", "train.sample_every=0"]),
                          tmp_path / "fresh")
    fresh.model.eval()
    want = preview_rows(fresh.pipeline(), cfg, 4, None)             # the base, as a new process reads it
    fresh.close()
    tr.fit()
    assert [len(r[0]) for r in tr.base_preview] == [len(r[0]) for r in want]
    for (got, _), (exp, _) in zip(tr.base_preview, want):
        assert all((g == e).all() for g, e in zip(got, exp))
    grids = sorted((tmp_path / "run" / "samples").glob("step_*.png"))
    assert [g.name for g in grids] == ["step_00000002.png", "step_00000004.png"]
    cell = 32 * 3 + 4                                                  # caption_grid: 3x nearest + padding
    frames = max(len(r[0]) for r in want)                              # the longest row's (a keyframe clip's) images
    with Image.open(grids[-1]) as im:
        assert im.size[0] == 260 + 4 + 3 * frames * cell                # base | now | EMA
    now = preview_rows(tr.pipeline(), cfg, 4, None)
    assert any((a != b).any() for (x, _), (y, _) in zip(now, want) for a, b in zip(x, y))   # it trained
    assert list((tmp_path / "run" / "tb").glob("events.*"))
    tr.close()
    if adapter == "none":            # a restart of a full fine-tune shows the base it kept at step 0
        assert (tmp_path / "run" / "samples" / "base_preview.npz").is_file()
        again = build_trainer(load_config(None, sets + ["train.steps=6", f"adapter.kind={adapter}"]), tmp_path / "run")
        assert again.step == 4
        rows = again._base_rows(4)
        assert all((g == e).all() for (x, _), (y, _) in zip(rows, want) for g, e in zip(x, y))
        again.close()


def test_a_word_encoder_trained_with_the_base_is_carried_by_word(base, tmp_path):
    """The base's export holds its word encoder and vocabulary.json; a run from it starts with the same encoder
    (every word the base knew keeps its vector), and words its data adds get rows of their own."""
    from difftrain.models.text import WordTextEncoder
    from difftrain.parallel.words_init import base_vocabulary, load_word_encoder
    from difftrain.train import build_trainer

    words = base_vocabulary(base)
    assert words and len(words) > 10
    ref = load_file(str(base / "model.safetensors"))
    cfg = load_config(None, RUN + [f"model.init_from={base}", "train.steps=1", "train.checkpoint_every=0"])
    tr = build_trainer(cfg, tmp_path / "full")
    assert tr.text_encoder.vocabulary[2:] == words
    for k, v in tr.model["text"].state_dict().items():
        assert torch.equal(v, ref["text." + k]), k
    tr.close()
    # new words: rows of their own, the base's matched by word wherever they sit
    enc = WordTextEncoder(list(reversed(words[:5])) + ["zebra"] + words[5:], 16, 16, 1)
    before = enc.embed.weight.detach().clone()
    got = load_word_encoder(enc, base, words)
    assert got == {"tensors": len(dict(enc.named_parameters())), "words_kept": len(words), "words_new": 1,
                   "new_rows_trained_apart": False}
    emb = ref["text.embed.weight"]
    for w in words:
        assert torch.equal(enc.embed.weight[enc.index[w]], emb[words.index(w) + 2]), w
    z = enc.index["zebra"]
    assert torch.equal(enc.embed.weight[z], before[z])                       # initialised, not copied
    # hostile: a malformed vocabulary, an encoder of another width
    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    (bad / "vocabulary.json").write_text('{"not": "a list"}')
    with pytest.raises(UserError, match="vocabulary.json: expected a JSON list"):
        base_vocabulary(bad)
    with pytest.raises(UserError, match=r"does not fit this run's text settings.*embed.weight"):
        load_word_encoder(WordTextEncoder(words, 16, 24, 1), base, words)


def _lean_base(base: Path, lean: Path) -> tuple[Path, list[str], int]:
    """A copy of the base export that never saw the word 'red': its row and its vocabulary entry removed."""
    lean.mkdir()
    words = json.loads((base / "vocabulary.json").read_text())
    drop = words.index("red")
    tensors = load_file(str(base / "model.safetensors"))
    emb = tensors["text.embed.weight"]
    tensors["text.embed.weight"] = torch.cat([emb[: drop + 2], emb[drop + 3:]])
    save_file(tensors, str(lean / "model.safetensors"), metadata={"format": "difftrain-weights/1"})
    shutil.copy(base / "config.toml", lean / "config.toml")
    (lean / "vocabulary.json").write_text(json.dumps(words[:drop] + words[drop + 1:]))
    return lean, words, drop


def test_new_words_on_two_fsdp_ranks_are_one_rank(base, tmp_path):
    """The text module holds frozen base rows and a trained new row: sharded by FSDP2 on 2 gloo ranks, the run is
    the 1-rank run (losses, and the learnt row in the adapter's export)."""
    lean, _, _ = _lean_base(base, tmp_path / "lean")
    cfg = _config(tmp_path / "w.toml", lean, "adapter.kind=lora", "train.steps=4", "train.lr=3e-2")
    _train(cfg, tmp_path / "two", 2)
    _train(cfg, tmp_path / "one", 1)
    losses = {r: [m["loss"] for m in read_metrics(tmp_path / r) if "loss" in m] for r in ("two", "one")}
    assert len(losses["one"]) == 4 and losses["one"] == pytest.approx(losses["two"], rel=1e-4)
    rows = {r: load_file(str(tmp_path / r / "export" / "adapter" / "words" / "model.safetensors"))["text.embed.weight"]
            for r in ("two", "one")}
    assert torch.allclose(rows["two"], rows["one"], atol=1e-5)
    lean_rows = load_file(str(lean / "model.safetensors"))["text.embed.weight"]
    assert torch.equal(rows["two"][:-1], lean_rows.to(rows["two"].dtype))          # the base's rows, untouched


def test_an_adapter_learns_a_word_its_base_never_saw_in_a_row_of_its_own(base, tmp_path):
    """A base that never saw a word the data uses: the adapter run gives it a row of its own (``text.new_words``),
    trained with the adapters while every base row and the DiT's base stay as they were; the checkpoint holds it, a
    resume rebuilds the split, and the export carries the word (merged embedding, vocabulary.json, and beside the
    adapter)."""
    from difftrain.train import build_trainer

    lean, words, drop = _lean_base(base, tmp_path / "lean")
    sets = RUN + ADAPTED[:2] + [f"model.init_from={lean}", "adapter.kind=lora", "train.steps=3",
                                "train.checkpoint_every=3", "train.lr=3e-2"]
    tr = build_trainer(load_config(None, sets), tmp_path / "run")
    text = tr.model["text"]
    assert tr.text_encoder.vocabulary[-1] == "red" and text.new_words.shape[0] == 1 and text.new_words.requires_grad
    assert not text.embed.weight.requires_grad
    base_rows, new_before = text.embed.weight.detach().clone(), text.new_words.detach().clone()
    frozen = {k: v.detach().clone() for k, v in tr.dit.named_parameters() if not v.requires_grad}
    tr.fit()
    assert torch.equal(text.embed.weight, base_rows)
    assert not torch.equal(text.new_words.detach(), new_before)              # trained
    assert all(torch.equal(v, dict(tr.dit.named_parameters())[k]) for k, v in frozen.items())
    trained = text.new_words.detach().clone()
    tr.close()
    keys = _checkpoint_keys(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert any("text.new_words" in k for k in keys)
    again = build_trainer(load_config(None, sets + ["train.steps=4"]), tmp_path / "run")
    assert again.step == 3 and torch.equal(again.model["text"].new_words.detach(), trained)
    again.close()
    exp = tmp_path / "run" / "export"
    vocab = json.loads((exp / "adapter" / "words" / "vocabulary.json").read_text())
    merged = load_file(str(exp / "adapter" / "words" / "model.safetensors"))["text.embed.weight"]
    assert vocab[-1] == "red" and merged.shape[0] == len(vocab) + 2
    assert torch.equal(merged[: -1], base_rows.to(merged.dtype))
    # sampling from the run reads the word's trained row
    from difftrain.inference import load_pipeline
    pipe, _, _ = load_pipeline(tmp_path / "run", device=torch.device("cpu"))
    assert pipe.text_encoder.tokenize(["red"])["ids"][0, 0] == len(vocab) + 1
    ema = load_file(str(exp / "adapter" / "words" / "model.safetensors"))["text.embed.weight"][-1]
    got = pipe.text_encoder.new_words.detach()[0]
    assert torch.allclose(got, ema.to(got.dtype))                         # the EMA the export holds
    # --adapter on the lean base reads the word from the adapter's export folder; on another base it is refused
    from difftrain.models.text import WordTextEncoder
    from difftrain.parallel.words_init import adapter_words, load_word_encoder, with_adapter_words
    lean_words = words[:drop] + words[drop + 1:]
    enc = WordTextEncoder(lean_words, 16, 16, 1)
    load_word_encoder(enc, lean, lean_words)
    found = adapter_words(exp / "adapter")
    assert found is not None and found[0][-1] == "red"
    withred = with_adapter_words(enc, exp / "adapter", *found)
    assert withred.tokenize(["red"])["ids"][0, 0] == len(lean_words) + 2
    assert torch.equal(withred.embed.weight[-1], merged[-1].to(withred.embed.weight.dtype))
    assert torch.equal(withred.layers[0].linear1.weight, enc.layers[0].linear1.weight)
    full = WordTextEncoder(words, 16, 16, 1)                          # the base that knew 'red' at another id
    with pytest.raises(UserError, match="do not start with this model's"):
        with_adapter_words(full, exp / "adapter", *found)
    (exp / "adapter" / "words" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="not a readable words folder"):
        adapter_words(exp / "adapter")
