"""Quantized inference (``difftrain sample|eval --quant``): which layers are quantized and how, that the emulation
quantizes activations as well as weights, the error each format adds, the label, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")

from difftrain.errors import UserError
from difftrain.models.quant import FORMATS, config_for, dequantize_entries, eligible, fake_quant, is_native, \
    quantize_dit

CPU = torch.device("cpu")
QDTYPE = {"fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}   # fp4: 2 a byte
# Relative error of the DiT's output against fp32 on random weights (bf16 alone: ~0.6%).
BOUND = {"fp8": 0.03, "mxfp8": 0.03, "nvfp4": 0.08}


def _dit():
    from difftrain.models import build_dit
    from difftrain.models.dit import DiTParams
    torch.manual_seed(0)
    dit = build_dit(DiTParams(in_channels=16, text_dim=32, pooled_dim=16, hidden=64, heads=4, double_blocks=1,
                              single_blocks=1, axes_dims_rope=(4, 6, 6)))
    for p in dit.parameters():       # zero-initialised layers would hide the error of the ones after them
        p.data.normal_(0, 0.05)
    return dit.eval().requires_grad_(False)


def _inputs():
    from difftrain.tokens import image_ids
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 64, 16, generator=g), image_ids(8, 8)[None].expand(2, -1, -1),
            torch.randn(2, 8, 32, generator=g), torch.rand(2, generator=g), torch.randn(2, 16, generator=g))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_block_linears_are_quantized_and_the_output_stays_close(fmt):
    dit, x = _dit(), _inputs()
    ref = dit(*x)
    bf16 = copy.deepcopy(dit).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        err_bf16 = _rel(bf16(*x), ref)
    want = sorted(n for n, m in dit.named_modules() if eligible(m, n))
    report = quantize_dit(dit, fmt, CPU)
    assert report["format"] == fmt and report["mode"] == "emulated" and report["layers"] == len(want) == 10
    quantized = sorted(n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear)
                       and hasattr(m.weight, "qdata"))
    assert quantized == want
    assert not any(n.endswith(("_mod.lin", "modulation.lin")) or not n.startswith(("double_", "single_"))
                   for n in quantized)                    # modulation, embedders and the final layer kept
    assert all(dict(dit.named_modules())[n].weight.qdata.dtype == QDTYPE[fmt] for n in want)
    b = report["weight_bytes"]
    assert b[fmt] < b["bf16"] * (0.6 if fmt != "nvfp4" else 0.35)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        err = _rel(dit(*x), ref)
    assert err_bf16 < err < BOUND[fmt], (fmt, err_bf16, err)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_emulation_quantizes_activations_as_well_as_weights(fmt):
    dit = _dit()
    quantize_dit(dit, fmt, CPU)
    name = "double_blocks.0.img_mlp.0" if "double_blocks.0.img_mlp.0" in dict(dit.named_modules()) else None
    name = name or next(n for n, m in dit.named_modules() if hasattr(getattr(m, "weight", None), "qdata"))
    layer = dict(dit.named_modules())[name]
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16) * 3
    w = layer.weight.dequantize().to(torch.bfloat16)
    weight_only = F.linear(x, w, layer.bias)
    both = F.linear(fake_quant(fmt)(x), w, layer.bias)
    y = layer(x)
    assert _rel(y, both) < 0.01                  # what a quantized matmul computes: both operands in the format
    assert _rel(weight_only, both) > 0.005       # and the activations' rounding is visible, not a no-op
    assert y.shape == (3, 5, layer.out_features)


def test_fake_quant_keeps_zeros_and_scales_per_row():
    for fmt in FORMATS:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        x[1] = 0
        y = fake_quant(fmt)(x)
        assert not y.isnan().any() and (y[1] == 0).all(), fmt
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    x[1] *= 1e4                                  # a row a thousand times larger does not crush the other (fp8)
    y = fake_quant("fp8")(x)
    assert _rel(y[0], x[0]) < 0.05


def test_refusals(monkeypatch):
    dit = _dit()
    with pytest.raises(UserError, match="--quant 'int3'.*fp8, mxfp8, nvfp4"):
        quantize_dit(dit, "int3", CPU)
    with pytest.raises(UserError, match="inference.*train.fp8"):
        quantize_dit(copy.deepcopy(dit).train(), "fp8", CPU)
    bad = copy.deepcopy(dit)
    next(m for n, m in bad.named_modules() if eligible(m, n)).weight.data[0, 0] = float("nan")
    with pytest.raises(UserError, match="weight gave NaN"):
        quantize_dit(bad, "fp8", CPU)
    from difftrain.models import build_dit
    from difftrain.models.dit import DiTParams
    narrow = build_dit(DiTParams(in_channels=16, text_dim=8, pooled_dim=8, hidden=24, heads=2, double_blocks=1,
                                 single_blocks=1, axes_dims_rope=(4, 4, 4))).eval().requires_grad_(False)
    with pytest.raises(UserError, match="multiples of 32"):
        quantize_dit(narrow, "nvfp4", CPU)


def test_native_where_the_hardware_has_the_format(monkeypatch):
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig, NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig

    assert not any(is_native(f, CPU) for f in FORMATS)
    cuda = torch.device("cuda")
    for cap, native in (((8, 0), ()), ((9, 0), ("fp8",)), ((10, 0), FORMATS)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a, c=cap: c)
        assert tuple(f for f in FORMATS if is_native(f, cuda)) == native
    assert isinstance(config_for("fp8", True), Float8DynamicActivationFloat8WeightConfig)
    assert isinstance(config_for("fp8", False), Float8WeightOnlyConfig)
    assert isinstance(config_for("nvfp4", True), NVFP4DynamicActivationNVFP4WeightConfig)
    assert config_for("mxfp8", False).kernel_preference.value == "emulated"
    assert isinstance(config_for("mxfp8", True), MXDynamicActivationMXWeightConfig)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import TINY
    from difftrain.cli import main
    from difftrain.config import load_config, to_toml
    root = tmp_path_factory.mktemp("quant")
    (root / "tiny.toml").write_text(to_toml(load_config(None, TINY + ["train.steps=2", "train.checkpoint_every=0"])))
    assert main(["train", str(root / "tiny.toml"), "--run-dir", str(root / "run"), "--no-progress"]) == 0
    return root / "run"


def test_sample_and_eval_with_quant_are_labelled(run, tmp_path, capsys, monkeypatch):
    from difftrain.cli import main
    assert main(["sample", str(run), "--prompt", "a red circle", "--num-images", "2", "--steps", "2",
                 "--quant", "nvfp4", "--out", str(tmp_path / "s")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quant"]["format"] == "nvfp4" and out["quant"]["mode"] == "emulated" and len(out["images"]) == 2
    assert main(["eval", str(run), "--json", "--n", "2", "--steps", "2", "--quant", "fp8"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["quant"]["mode"] == "emulated" and ev["quant"]["layers"] > 0 and 0 <= ev["t2i_color_acc"] <= 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    from difftrain.inference import load_pipeline
    with pytest.raises(UserError, match="--quant fp8 samples on one device"):
        load_pipeline(run, quant="fp8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_export_holds_what_sampling_computes_and_training_refuses_it(fmt, run, tmp_path):
    from safetensors import safe_open

    from difftrain.export import export_checkpoint
    from difftrain.inference import load_pipeline
    from difftrain.parallel.pretrained import load_pretrained

    full = export_checkpoint(run, tmp_path / "full")
    rep = export_checkpoint(run, tmp_path / "q", quant=fmt)
    assert rep["quant"]["format"] == fmt and rep["quant"]["layers"] > 0
    assert rep["bytes"] < full["bytes"]
    pipe, _, info = load_pipeline(run, quant=fmt)              # what sample --quant runs, from the same weights
    layers = {n: m for n, m in pipe.dit.named_modules() if hasattr(getattr(m, "weight", None), "qdata")}
    assert len(layers) == rep["quant"]["layers"] == info["quant"]["layers"]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert f.metadata()["quant"] == fmt
        for n, m in layers.items():
            w = m.weight
            assert torch.equal(f.get_tensor(f"dit.{n}.weight").view(torch.uint8), w.qdata.view(torch.uint8)), n
            got = dequantize_entries(f.get_tensor(f"dit.{n}.weight"), f.get_tensor(f"dit.{n}.weight_scale"), fmt,
                                     f.get_tensor(f"dit.{n}.weight_global_scale") if fmt == "nvfp4" else None)
            assert torch.allclose(got, w.dequantize().float(), rtol=2 ** -8, atol=0), n   # the weight sampled with
        kept = [k for k in f.keys() if "modulation" in k or k.startswith(("dit.img_in", "dit.final"))]
        assert kept and all(f.get_tensor(k).dtype == torch.float32 for k in kept)
    cfg_dit = pipe.dit                                         # the same architecture, fresh, full precision
    from difftrain.models import build_dit
    fresh = build_dit(cfg_dit.params)
    with pytest.raises(UserError, match=f"quantized to {fmt} for inference.*without --quant"):
        load_pretrained(fresh, str(tmp_path / "q"))
    load_pretrained(fresh, str(tmp_path / "full"))              # the full-precision export still loads
    with pytest.raises(UserError, match="diffusers.*--layout difftrain"):
        export_checkpoint(run, tmp_path / "d", layout="diffusers", quant=fmt)
