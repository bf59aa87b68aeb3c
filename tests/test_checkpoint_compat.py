"""A checkpoint written by an earlier release (``tests/fixtures/ckpt_v0``: the tiny config, run.seed = 3, two
steps) still loads: the same parameter names and state dict, the same DiT output on a fixed input and the
same optimizer state. (Its step-3 loss is no longer reproduced: the text rule changed the word encoder.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from difftrain.train.metrics import read_metrics

from conftest import fixed_dit_output

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_v0"


def test_checkpoint_written_before_the_redesign_loads_to_the_same_numbers(tiny_cfg, tmp_path):
    """The same parameter names, weights and optimizer state; resuming it is refused (it was trained before the
    text rule, text.padding, existed: its word encoder attended padding to each batch's longest caption, which
    no rule reproduces) unless the change is allowed, and then it trains on from step 2."""
    import pytest

    from difftrain.errors import UserError
    from difftrain.train import build_trainer
    from difftrain.train.objectives import FlowMatching

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run / "checkpoints", ignore=shutil.ignore_patterns("*output*", "expected.json"))
    index = json.loads((FIXTURE / "step_00000002" / "model.safetensors.index.json").read_text())
    cfg = tiny_cfg("train.steps=3", "train.checkpoint_every=0", "train.async_checkpoint=false", "run.seed=3")
    with pytest.raises(UserError, match=r"text.padding: '\(absent\)' -> 'masked'.*--allow-config-change"):
        build_trainer(cfg, run, allow_config_change=("train.steps",))
    tr = build_trainer(cfg, run, allow_config_change=("train.steps", "text.padding"))
    assert isinstance(tr.objective, FlowMatching) and tr.step == 2
    saved_model_keys = {k[len("model."):] for k in index["weight_map"] if k.startswith("model.")}
    assert saved_model_keys == set(tr.model.state_dict())

    out = fixed_dit_output(tr.dit)
    torch.testing.assert_close(out, load_file(str(FIXTURE / "dit_output.safetensors"))["out"], rtol=0, atol=1e-7)
    saved = load_file(str(FIXTURE / "step_00000002" / "model-00001-of-00001.safetensors"))
    params = dict(tr.model.named_parameters())
    for name in ("dit.img_in.weight", "dit.final_layer.linear.weight"):
        state = tr.optimizer.state[params[name]]
        torch.testing.assert_close(state["exp_avg"], saved[f"optim.state.{name}.exp_avg"], rtol=0, atol=0)

    tr.fit()
    tr.close()
    loss = [m["loss"] for m in read_metrics(run) if m["step"] == 3]
    assert len(loss) == 1 and 0 < loss[0] < 10
