"""Adapters that leave difftrain: ``export --adapter`` writes diffusers' LoRA format for FLUX, and diffusers'
``FluxTransformer2DModel.load_lora_adapter`` loaded with it computes what our adapted model computes.

A tiny FLUX is built here with every weight randomised (test_flux_parity's construction), our MMDiT takes its
weights, an adapter is injected into ours with every factor randomised (so the adapter moves the output by far more
than the tolerance: a zero adapter would prove nothing), and both models are run on the same inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from difftrain.adapter_export import LORA_WEIGHTS, to_diffusers_adapter
from difftrain.errors import UserError
from difftrain.models.lora import AdapterSpec, adapters_disabled, apply_adapter, split_name

from conftest import run_diffusers_flux, run_ours_flux
from test_flux_parity import CONFIGS, _diffusers_model, _inputs, _ours_from

pytest.importorskip("diffusers")

TOL = 1e-5
LORA_TARGETS = ("qkv", "proj", "linear1", "linear2", "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2", "_mod.lin",
                "modulation.lin", "final_layer.adaLN_modulation.1", "final_layer.linear", "img_in", "txt_in")
LOKR_TARGETS = ("qkv", "proj", "linear2", "img_mlp.0", "img_mlp.2", "txt_mlp.2", "img_in")


@torch.no_grad()
def _randomise_adapter(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if split_name(name) is not None:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _factors(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if (split := split_name(name)) is not None:
            out.setdefault(split[0], {})[split[1]] = p.detach().clone()
    return out


def exported_adapter_parity(cfg, kind: str, targets, rank: int, alpha: float) -> dict:
    """A tiny FLUX of ``cfg`` with randomised weights, ours adapted (every factor randomised) against diffusers' with
    our adapter exported and loaded: how far the adapter moves our output (``moved``), how far the bases differ
    (``base``) and the adapted models (``adapted``), and the exported keys (also ``bench/finetune_shapes.py``'s)."""
    ref = _diffusers_model(cfg, seed=0)
    ours, p = _ours_from(ref)
    spec = AdapterSpec(kind, rank, alpha, targets)
    apply_adapter(ours, spec)
    _randomise_adapter(ours, seed=3)
    inp = _inputs(cfg, 2, True, seed=7)
    with adapters_disabled(ours):
        plain = run_ours_flux(ours, *inp)
    want = run_ours_flux(ours, *inp)
    base = float((run_diffusers_flux(ref, *inp) - plain).abs().max())
    sd = to_diffusers_adapter(kind, _factors(ours), spec.scale, p.double_blocks, p.single_blocks, p.hidden)
    ref.load_lora_adapter(sd, prefix="transformer", adapter_name="mine")
    return {"moved": float((want - plain).abs().max()), "base": base, "keys": list(sd),
            "adapted": float((run_diffusers_flux(ref, *inp) - want).abs().max())}


@pytest.mark.parametrize("kind, targets, rank, alpha", [("lora", LORA_TARGETS, 4, 8.0), ("lokr", LOKR_TARGETS, 2, 3.0)])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]])
def test_our_adapted_model_and_diffusers_with_the_exported_adapter_agree(cfg, kind, targets, rank, alpha):
    got = exported_adapter_parity(cfg, kind, targets, rank, alpha)
    assert got["moved"] > 1e-2, "the adapter barely moves the output: the comparison would prove nothing"
    assert got["base"] <= 1e-4                                                   # the bases agree
    assert all(k.startswith("transformer.") for k in got["keys"])
    assert got["adapted"] <= TOL


def test_a_lokr_on_a_single_blocks_fused_linear1_is_refused_with_what_to_do():
    ref = _diffusers_model(CONFIGS[0].values[0], seed=0)
    ours, p = _ours_from(ref)
    apply_adapter(ours, AdapterSpec("lokr", 2, 2.0, ("linear1",)))
    with pytest.raises(UserError, match="linear1.*adapter.targets"):
        to_diffusers_adapter("lokr", _factors(ours), 1.0, p.double_blocks, p.single_blocks, p.hidden)


def test_export_adapter_from_a_trained_checkpoint(tmp_path):
    """Through the CLI: a FLUX-shaped base trained and exported, a LoRA trained on it (2 steps), ``difftrain export
    RUN OUT --adapter``: the file holds every adapted layer's pieces in diffusers' names, the scale folded into B
    (the checkpoint's EMA factors times alpha / rank, cut by rows); a plain export of the adapter checkpoint is
    refused with where to go; a checkpoint without adapter refuses --adapter."""
    from safetensors.torch import load_file

    from difftrain.config import load_config, to_toml
    from difftrain.train.checkpoint import Checkpointer

    from conftest import TINY

    flux = TINY + ["model.abs_pos_embed=false", "model.positions=corner", "diffusion.prediction=v",
                   "diffusion.loss=v", "train.threads=1", "train.checkpoint_every=0"]
    (tmp_path / "base.toml").write_text(to_toml(load_config(None, flux + ["train.steps=4"])))
    env_run = [sys.executable, "-m", "difftrain"]

    def run(*args, ok=True):
        proc = subprocess.run(env_run + list(args), capture_output=True, text=True, timeout=300)
        assert (proc.returncode == 0) == ok, proc.stderr[-2000:]
        return proc

    run("train", str(tmp_path / "base.toml"), "--run-dir", str(tmp_path / "base"), "--no-progress")
    (tmp_path / "a.toml").write_text(to_toml(load_config(None, flux + [
        "train.steps=2", "adapter.kind=lora", "adapter.rank=4", "adapter.alpha=8", "train.ema_decay=0.5",
        f"model.init_from={tmp_path / 'base' / 'export'}"])))
    run("train", str(tmp_path / "a.toml"), "--run-dir", str(tmp_path / "a"), "--no-progress")
    out = json.loads(run("export", str(tmp_path / "a"), str(tmp_path / "lora"), "--adapter").stdout)
    sd = load_file(str(tmp_path / "lora" / LORA_WEIGHTS))
    assert out["kind"] == "lora" and out["tensors"] == len(sd)
    ema = {}
    info = Checkpointer.read_info(tmp_path / "a")
    from difftrain.export import _read_metadata
    for k, md in _read_metadata(info["path"]).state_dict_metadata.items():
        if k.startswith("ema.dit.") and ".lora_" in k:
            ema[k[len("ema."):]] = torch.empty(tuple(md.size))
    Checkpointer.load_tensors(info["path"], "ema", ema)
    h = 32
    b = ema["dit.double_blocks.0.img_attn.qkv.lora_B.default.weight"] * 2.0
    a = ema["dit.double_blocks.0.img_attn.qkv.lora_A.default.weight"]
    for i, piece in enumerate(("to_q", "to_k", "to_v")):
        assert torch.equal(sd[f"transformer.transformer_blocks.0.attn.{piece}.lora_B.weight"], b[i * h:(i + 1) * h])
        assert torch.equal(sd[f"transformer.transformer_blocks.0.attn.{piece}.lora_A.weight"], a)
    assert "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight" in sd
    assert b.abs().max() > 0
    err = run("export", str(tmp_path / "a"), str(tmp_path / "plain"), ok=False).stderr
    assert "--adapter" in err and "Traceback" not in err
    err = run("export", str(tmp_path / "base"), str(tmp_path / "none"), "--adapter", ok=False).stderr
    assert "trained no adapter" in err and "Traceback" not in err
