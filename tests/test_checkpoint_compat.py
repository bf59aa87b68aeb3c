"""A checkpoint written by an earlier release (``tests/fixtures/ckpt_v0``: the tiny config, run.seed = 3, two
steps) still loads: the same parameter names and state dict, the same DiT output on a fixed input, and the
same loss on the step after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from difftrain.train.metrics import read_metrics

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_v0"


def test_checkpoint_written_before_the_redesign_resumes_to_the_same_numbers(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer
    from difftrain.train.objectives import FlowMatching

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run / "checkpoints", ignore=shutil.ignore_patterns("*output*", "expected.json"))
    index = json.loads((FIXTURE / "step_00000002" / "model.safetensors.index.json").read_text())
    cfg = tiny_cfg("train.steps=3", "train.checkpoint_every=0", "train.async_checkpoint=false", "run.seed=3")
    tr = build_trainer(cfg, run, allow_config_change=("train.steps",))
    assert isinstance(tr.objective, FlowMatching) and tr.step == 2
    saved_model_keys = {k[len("model."):] for k in index["weight_map"] if k.startswith("model.")}
    assert saved_model_keys == set(tr.model.state_dict())

    g = torch.Generator().manual_seed(0)
    p = tr.dit.params
    x = torch.randn(2, 16, p.in_channels, generator=g)
    ids = torch.randint(0, 4, (2, 16, 3), generator=g)
    txt = torch.randn(2, 5, p.text_dim, generator=g)
    pooled = torch.randn(2, p.pooled_dim, generator=g)
    t = torch.rand(2, generator=g)
    with torch.no_grad():
        out = tr.dit(x, ids, txt, t, pooled)
    torch.testing.assert_close(out, load_file(str(FIXTURE / "dit_output.safetensors"))["out"], rtol=0, atol=1e-7)

    tr.fit()
    tr.close()
    loss = [m["loss"] for m in read_metrics(run) if m["step"] == 3]
    assert loss == [json.loads((FIXTURE / "expected.json").read_text())["loss_step_3"]]
