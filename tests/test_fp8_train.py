"""Float8 training (train.fp8) of the DiT blocks' linears on the CPU's emulated path: the layers converted and
those kept, training close to the full-precision run, checkpoints unchanged (a resumed run reads them)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchao")


def _losses(run) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_the_block_linears_and_trains_like_full_precision(recipe, tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    runs = {}
    for name, fp8 in (("full", "none"), ("fp8", recipe)):
        cfg = tiny_cfg(f"train.fp8={fp8}", "train.steps=12", "train.checkpoint_every=6", "train.threads=1",
                       "train.ema_decay=0")
        tr = build_trainer(cfg, tmp_path / name)
        tr.fit()
        runs[name] = tr
    tr = runs["fp8"]
    kinds = {n: type(m).__name__ for n, m in tr.dit.named_modules() if isinstance(m, torch.nn.Linear)}
    converted = {n for n, k in kinds.items() if k == "Float8Linear"}
    assert converted == set(tr.fp8_layers) and converted
    # On a CPU, torchao's emulation (float8 casts, float32 matmuls), not torch._scaled_mm's slow CPU kernel.
    assert all(dict(tr.dit.named_modules())[n].config.emulate for n in converted)
    assert all(n.startswith(("double_blocks.", "single_blocks.")) for n in converted)
    assert not any(n.endswith(("_mod.lin", "modulation.lin")) or n.startswith(("img_in", "txt_in", "final_layer"))
                   for n in converted)
    full, fp8 = _losses(tmp_path / "full"), _losses(tmp_path / "fp8")
    assert len(full) == len(fp8) == 12 and fp8 != full                     # float8 changed the numerics ...
    assert max(abs(a - b) / a for a, b in zip(full, fp8)) < 0.1            # ... and trains alike
    # The checkpoint holds the same tensors as a full-precision run's (high-precision weights, same names).
    from safetensors import safe_open
    shards = sorted((tmp_path / "fp8" / "checkpoints").glob("step_*/*.safetensors"))
    ref = sorted((tmp_path / "full" / "checkpoints").glob("step_*/*.safetensors"))
    keys = lambda files: sorted(k for f in files for k in safe_open(str(f), "pt").keys())  # noqa: E731
    assert keys(shards) == keys(ref)
    # Resumed with float8 it goes on from the checkpoint.
    cfg = tiny_cfg(f"train.fp8={recipe}", "train.steps=14", "train.checkpoint_every=6", "train.threads=1",
                   "train.ema_decay=0")
    again = build_trainer(cfg, tmp_path / "fp8")
    assert again.step == 12
    again.fit()
    assert again.step == 14
