"""Adapter dropout (peft's LoRA input dropout; LoKr's module dropout) draws from the global generator. Each rank now
draws its own stream, seeded by (run.seed, step, rank, micro-batch): the masks differ between data-parallel ranks (they
were the same: every rank seeded the generator alike) and a resume draws the masks an unbroken run draws (they started
over: the generator was never saved), so a resumed run with dropout is bit-identical to an unbroken one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftrain.config import load_config
from difftrain.train import build_trainer

from conftest import TINY
from test_rare_events import _two_ranks

RUN = TINY + ["train.global_batch=8", "train.ema_decay=0.9", "train.threads=1", "train.warmup_steps=1",
              "train.schedule=constant", "train.async_checkpoint=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dropout")
    tr = build_trainer(load_config(None, RUN + ["train.steps=4", "train.checkpoint_every=0"]), root / "base")
    tr.fit()
    tr.close()
    return root / "base" / "export"


def _cfg(base: Path, kind: str, steps: int):
    return load_config(None, RUN + [f"model.init_from={base}", f"adapter.kind={kind}", "adapter.rank=4",
                                    "adapter.alpha=8", "adapter.dropout=0.5", "train.lr=3e-3", f"train.steps={steps}",
                                    "train.checkpoint_every=2"])


def _tensors(run: Path) -> dict[str, torch.Tensor]:
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("kind", ["lora", "lokr"])
def test_a_resume_with_adapter_dropout_is_bit_identical(base, tmp_path, kind):
    broken = build_trainer(_cfg(base, kind, 2), tmp_path / "broken")
    broken.fit()
    broken.close()
    again = build_trainer(_cfg(base, kind, 4), tmp_path / "broken", allow_config_change=("train.steps",))
    assert again.step == 2
    again.fit()
    again.close()
    whole = build_trainer(_cfg(base, kind, 4), tmp_path / "whole")
    whole.fit()
    whole.close()
    got, want = _tensors(tmp_path / "broken"), _tensors(tmp_path / "whole")
    assert got.keys() == want.keys() and any(".lora_" in k or ".lokr_" in k for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _mask_worker(rank: int, world: int, port: int, base: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from difftrain.parallel.dist import init_distributed

    cfg = _cfg(Path(base), "lora", 1)
    cfg.parallel.dp_shard = 2
    tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
    masks = []
    for name, m in tr.dit.named_modules():
        if isinstance(m, torch.nn.Dropout) and name.endswith("lora_dropout.default"):
            m.register_forward_hook(lambda mod, inp, outp: masks.append((outp == 0).flatten()[:4096].tolist()))
            break
    tr.fit()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"masks": masks}))
    tr.close()
    os._exit(0)


def test_ranks_draw_different_dropout_masks(base, tmp_path):
    _two_ranks(_mask_worker, (str(base), str(tmp_path)), 180, "a rank was left waiting")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text())["masks"] for r in range(2)]
    assert got[0] and got[1] and len(got[0]) == len(got[1])
    zeros = sum(map(sum, got[0])) / sum(map(len, got[0]))
    assert 0.3 < zeros < 0.7                                      # dropout 0.5 indeed drew
    assert got[0] != got[1]
