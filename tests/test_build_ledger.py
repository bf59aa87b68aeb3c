"""The device-memory ledger of building and loading: for each entry point (training's policy, DPO's policy and reference,
sampling -- ``sample``, ``eval`` and ``candidates`` share ``load_pipeline``'s build) x base precision (bf16, fp8, nf4)
x adapter (none, LoRA), the bytes alive at the peak of the factory's build and read are within the planner's figure
(``adapter_plan.build_ledger``), and a quantized base is never whole in full precision.

Counted with torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) on the CPU: every storage a torch op
creates under its dispatch mode, alive until it is freed. Its limits: memory outside torch's ops is not seen (a
safetensors file's mapping, glibc's heap), nor are tensors made before the build (the encoders, given to it). On the
device the same cases are measured with ``torch.cuda.max_memory_allocated`` at FLUX width (``bench/build_ledger.py``,
a section of ``bench/gpu_suite.sh``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from difftrain.parallel.adapter_plan import build_ledger

pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_ledger_bench", ROOT / "bench" / "build_ledger.py")
ledger_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ledger_bench)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> dict:
    """Every case at width 128 (whole NF4 blocks; the block linears dominate), 2 double and 2 single blocks."""
    return ledger_bench.run(CPU, 128, tmp_path_factory.mktemp("ledger"), blocks=4)


def test_each_build_stays_within_the_planners_figure(ledger):
    rows = ledger["cases"]
    assert set(rows) == {f"{e}-{p}-{'lora' if a else 'none'}" for e, p, a in ledger_bench.CASES}
    assert not [k for k, r in rows.items() if "error" in r], rows
    assert ledger["all_within"], {k: r for k, r in rows.items() if not r["within"]}
    assert all(r["never_meta"] for r in rows.values()), rows
    for key, r in rows.items():
        if key.endswith(("fp8-lora", "nf4-lora")):
            # every block linear: 2 x 10 in the double blocks (modulations, q/k/v, out, MLP) + 2 x 3 in the single
            assert r["quantized_layers"] == 26, (key, r)
            # never whole in full precision: read and quantized one layer at a time
            assert r["max_full_precision_layers"] == 1, (key, r)
        else:
            assert r["quantized_layers"] == 0 and r["max_full_precision_layers"] == 0, (key, r)


def test_a_build_that_allocates_the_whole_base_first_is_caught(ledger, monkeypatch):
    """The regression the ledger exists for: a quantized base allocated whole in full precision before it is read and
    quantized (``to_empty`` of the whole DiT, as DPO's build once did) exceeds the planner's figure."""
    from difftrain.models import base_quant

    def whole(module, layers, device):
        module.to_empty(device=device)

    runs = {k: Path(v) for k, v in ledger["runs"].items()}
    cfg, role, weights, info, spec = ledger_bench.case(runs, ledger_bench.model_sets(128, 4), "dpo", "nf4", True)
    monkeypatch.setattr(base_quant, "to_empty_but", whole)
    peak, _, counts = ledger_bench.measure(cfg, role, weights, info, spec, CPU)
    figure = build_ledger(cfg, role, ledger_bench.weight_bytes(cfg, role, True, CPU))
    assert peak > figure["peak_bytes"], (peak, figure)
    assert max(counts) == 26, counts            # the whole base in full precision at the first quantization


def test_the_gpu_sections_dpo_step_and_sample_on_an_nf4_base_run_on_a_cpu(tmp_path):
    """The ledger part of bench/gpu_suite.sh also trains a LoRA DPO step and samples on an nf4 base through the CLI and
    compares each peak with the planner's per-GPU figure; here the same commands run (no CUDA peak to read)."""
    got = ledger_bench.steps(CPU, 128, tmp_path)
    assert got["dpo_nf4_step_peak_over_plan"] is None and got["sample_nf4_peak_over_plan"] is None
    assert (tmp_path / "dpo" / "checkpoints" / "step_00000001" / "COMPLETE.json").is_file()
    assert list((tmp_path / "samples").glob("*.png"))
