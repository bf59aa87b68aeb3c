"""A DiT with no single-stream blocks: its last double block's text rows are keys and values only, so the block is
built without text output weights (SD3's ``context_pre_only``). Every parameter then gets a gradient and optimizer
state, so a run saves and resumes in a fresh trainer (it did not: the resume asked for optimizer state the save never
wrote). A checkpoint and an export written while the block still carried those weights (``tests/fixtures/
ckpt_double_only``: the tiny config with 2 double blocks, 0 single, ``run.seed = 3``, two steps) still load: the
extra tensors are ignored, the DiT's output is the same, and the run resumes from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftrain.models import DiTParams, build_dit
from difftrain.train import build_trainer

from conftest import fixed_dit_output

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_double_only"
DOUBLE_ONLY = ("model.double_blocks=2", "model.single_blocks=0")
LEGACY = ("double_blocks.1.txt_attn.proj", "double_blocks.1.txt_mlp")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_the_last_double_block_has_no_text_output_weights():
    p = DiTParams(in_channels=16, text_dim=24, pooled_dim=20, hidden=32, heads=2, double_blocks=2, single_blocks=0,
                  axes_dims_rope=(4, 6, 6))
    names = set(build_dit(p).state_dict())
    assert not any(n.startswith(LEGACY) for n in names)
    assert "double_blocks.0.txt_attn.proj.weight" in names and "double_blocks.0.txt_mlp.0.weight" in names
    assert "double_blocks.1.txt_attn.qkv.weight" in names           # its keys and values are still computed
    with_single = build_dit(DiTParams(**{**p.__dict__, "single_blocks": 1})).state_dict()
    assert "double_blocks.1.txt_attn.proj.weight" in with_single    # not pruned when a single block reads the text


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_double_only_model_resumes_in_a_fresh_trainer_and_equals_an_unbroken_run(tiny_cfg, tmp_path, optimizer):
    """The issue's reproduction: 6 steps with a checkpoint every 3, then the same run directory to step 9 in a new
    trainer. It resumes, and its weights and optimizer state equal a run of 9 steps without the break."""
    base = (*DOUBLE_ONLY, f"train.optimizer={optimizer}", "train.checkpoint_every=3", "train.async_checkpoint=false",
            "train.schedule=constant", "train.warmup_steps=0")
    tr = build_trainer(tiny_cfg(*base, "train.steps=6"), tmp_path / "broken")
    tr.fit()
    tr.close()
    again = build_trainer(tiny_cfg(*base, "train.steps=9"), tmp_path / "broken", allow_config_change=("train.steps",))
    assert again.step == 6
    assert all(again.optimizer.state[q] for q in again.model.parameters() if q.requires_grad)
    again.fit()
    again.close()
    whole = build_trainer(tiny_cfg(*base, "train.steps=9"), tmp_path / "whole")
    whole.fit()
    whole.close()
    got, want = _weights(tmp_path / "broken"), _weights(tmp_path / "whole")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_checkpoint_written_with_the_text_output_weights_loads_and_resumes(tiny_cfg, tmp_path):
    """The fixture holds the last block's txt_attn.proj and txt_mlp (and no optimizer state for them: they never had
    a gradient). It resumes into the pruned block: the same DiT output as when it was written, then two more steps."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "step_00000002", run / "checkpoints" / "step_00000002")
    (run / "checkpoints" / "latest").write_text("step_00000002")
    index = json.loads((FIXTURE / "step_00000002" / "model.safetensors.index.json").read_text())
    assert any(k.startswith("model.dit." + LEGACY[0]) for k in index["weight_map"])     # the old layout indeed
    cfg = tiny_cfg(*DOUBLE_ONLY, "run.seed=3", "train.steps=4", "train.checkpoint_every=0",
                   "train.async_checkpoint=false")
    tr = build_trainer(cfg, run, allow_config_change=("train.steps",))
    assert tr.step == 2
    tr.dit.eval()
    out = fixed_dit_output(tr.dit)
    torch.testing.assert_close(out, load_file(str(FIXTURE / "dit_output.safetensors"))["out"], rtol=0, atol=1e-7)
    assert tr.fit()["steps"] == 4
    tr.close()
    # its export reads the checkpoint of the old layout too, and writes the new one
    from difftrain.export import export_checkpoint
    export_checkpoint(run / "checkpoints" / "step_00000002", tmp_path / "exported")
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert not any(k.startswith(tuple("dit." + n for n in LEGACY)) for k in exported) and "dit.img_in.weight" in exported


def test_an_export_written_with_the_text_output_weights_initialises_a_run(tiny_cfg, tmp_path):
    """``model.init_from`` an export of the old layout: its extra tensors are not read, and the rest are."""
    cfg = tiny_cfg(*DOUBLE_ONLY, "run.seed=3", "train.steps=1", f"model.init_from={FIXTURE / 'export'}",
                   "train.checkpoint_every=0", "train.async_checkpoint=false")
    tr = build_trainer(cfg, tmp_path / "run")
    saved = load_file(str(FIXTURE / "export" / "model.safetensors"))
    for name, value in tr.dit.state_dict().items():
        assert torch.equal(value, saved["dit." + name]), name
    tr.close()
