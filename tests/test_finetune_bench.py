"""``bench/finetune_shapes.py`` end to end on a tiny base: the user's folders (the concept, its striped copy with
masks, a held-out folder, the base's own samples for prior preservation: text-to-image, edit and keyframe folders)
prepared into stores, fine-tuned (LoRA with the concept's new word, masked and unmasked), judged, and reported with
every key the figures in ``docs/`` are read from. The figures themselves come from the full run (a demo base)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from difftrain.cli import main
from difftrain.config import load_config, to_toml
from difftrain.shapes.concept import CONCEPT

from conftest import TINY

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("finetune_shapes", ROOT / "bench" / "finetune_shapes.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ftbase")
    cfg = root / "base.toml"
    cfg.write_text(to_toml(load_config(None, TINY + ["train.steps=6", "train.checkpoint_every=0", "train.threads=1"])))
    assert main(["train", str(cfg), "--run-dir", str(root / "base"), "--no-progress"]) == 0
    return root / "base"


def test_every_method_writes_a_config_that_loads(base_run, tmp_path):
    args = type("A", (), {"steps": 40, "lr": 2e-3, "lr_lokr": 1e-2, "lr_full": 2e-4, "track_every": 10,
                          "batch": 8})()
    sources = [{"path": str(tmp_path / "c"), "name": "concept"},
               {"path": str(tmp_path / "p"), "name": "prior_edit", "kind": "edit"}]
    for method in bench.METHODS:
        cfg = load_config(bench.write_config(tmp_path / f"{method}.toml", base_run, tmp_path / "store", sources,
                                             bench.ADAPTERS[method], args, validation="concept", size=32))
        assert cfg.adapter.kind == bench.ADAPTERS[method]["kind"]
        assert cfg.adapter.base_precision == bench.ADAPTERS[method].get("base_precision", "bf16")
        assert cfg.train.lr == {"full": 2e-4, "lokr": 1e-2}.get(method, 2e-3) and cfg.train.steps == 40
        assert cfg.model.hidden == 32 and cfg.data.image_size == 32          # the base's architecture, extended
        assert cfg.data.stages[0]["buckets"] == [[32, 32]] and cfg.validation.source == "concept"


def test_the_bench_runs_end_to_end_on_a_tiny_base(base_run, tmp_path, capsys, ray_local):
    out = bench.main(["--base", str(base_run), "--out", str(tmp_path), "--steps", "4", "--batch", "8",
                      "--examples", "16", "--n", "2", "--n-track", "2", "--track-every", "2", "--prior", "3",
                      "--methods", "lora", "--cache", str(tmp_path / "cache")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert out["concept"] == CONCEPT and out["steps"] == 4 and out["n"] == 2
    assert set(out["new_concept_acc"]) == {"lora"} and 0.0 <= out["new_concept_acc"]["lora"] <= 1.0
    assert set(out["old_acc"]["lora"]) == set(out["base_old_acc"]) and len(out["base_old_acc"]) == 10
    assert isinstance(out["old_acc_max_drop_pp"]["lora"], float) and isinstance(out["targets_met_lora"], bool)
    for key in ("masked_background_clean", "unmasked_background_clean", "detector_sees_the_stripe"):
        assert isinstance(out[key], bool)
    for key in ("stripe_rate_base", "stripe_rate_masked", "stripe_rate_unmasked"):
        assert 0.0 <= out[key] <= 1.0
    assert [p["step"] for p in out["points"]] == [2, 4]
    assert all(p["val_loss"] > 0 for p in out["points"])
    assert out["diffusers_max_abs_diff"] < 1e-5 and out["wall_s"] > 0 and not out["base_trained_now"]
    # the concept's word was not the base's: the fine-tunes learnt a row of their own for it
    assert CONCEPT not in json.loads((base_run / "export" / "vocabulary.json").read_text())
    for run in ("lora", "masked", "unmasked"):
        words = json.loads((tmp_path / "runs" / run / "export" / "adapter" / "words" / "vocabulary.json").read_text())
        assert CONCEPT in words, run
    # the prior folders hold the base's own answers for each task, the striped folder its masks
    assert len(list((tmp_path / "prior" / "t2i").glob("*.png"))) == 3
    assert len(list((tmp_path / "prior" / "edit").iterdir())) == 3
    assert len(list((tmp_path / "concept_stripe").glob("*_mask.png"))) == 16


def test_a_quantized_base_is_charged_its_largest_drop_against_lora():
    out = {"new_concept_acc": {"lora": 0.90, "lora_fp8": 0.88, "lora_nf4": 0.80},
           "old_acc": {"lora": {"a": 0.50, "b": 0.60}, "lora_fp8": {"a": 0.45, "b": 0.70},
                       "lora_nf4": {"a": 0.50, "b": 0.60}}}
    cost = bench.quantized_cost(out)
    assert cost["quantized_max_drop_vs_lora_pp"] == {"lora_fp8": 5.0, "lora_nf4": 10.0}
    assert cost["quantized_within_5pp"] == {"lora_fp8": True, "lora_nf4": False}
    assert bench.quantized_cost({"new_concept_acc": {"full": 1.0}, "old_acc": {}}) == {}
