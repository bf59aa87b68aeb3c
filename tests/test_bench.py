"""The GPU benchmark script runs end to end on a CPU in its smoke mode, so it is known to work before a GPU
machine runs it (where it compiles, uses bf16 and measures the allocator's peak)."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_smoke_runs_and_reports_every_figure(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--smoke", "--steps", "1",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert not any(k.startswith("error") for k in result), result
    assert result["host_syncs_in_a_step"] == "not run (no CUDA device)"
    for key in ("matmul_tflops", "mfu", "step_s", "mfu_full_ac", "step_s_full_ac", "planner_estimate_gb",
                "trainer_step_s"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result)
    assert 0 < result["mfu"] < 1
    assert result["attention_table"] and result["hybrid_speedup"] >= 1.0
    # Precision: float8 training from the same weights on the same batch, sample --quant's model, the FP8 encoder.
    assert result["fp8_train_speedup"] > 0 and 0 <= result["fp8_train_loss_delta"] < 0.1
    assert len(result["fp8_train_losses"]) == 2 and result["fp8_train_layers"] == 10   # every block linear
    assert result["quant_sample_speedup_fp8"] > 0
    for fmt in ("fp8", "mxfp8", "nvfp4"):
        assert result[f"quant_mode_{fmt}"] == "emulated" and 0 < result[f"quant_rel_error_{fmt}"] < 0.2
    assert result["quant_rel_error_fp8"] < result["quant_rel_error_nvfp4"]
    assert 0.9 < result["fp8_encoder_cosine"] <= 1 and 0 < result["fp8_encoder_memory_saved"] < 1
    assert set(result["fp8_encoder_ms_per_batch"]) == {"1", "8", "32"}
    # A blocking save (no stager), loaded by a fresh process and resumed: on a GPU, the writer's own device copy.
    assert result["blocking_save_ok"] and result["blocking_save_loads_in_a_fresh_process"], result
    assert result["blocking_save_resumes"], result
    assert result["tuned_calls"]["tuned"] > 0 and result["tuned_calls"]["fallback"] == 0, result
    assert result["tuned_calls_eager_count"] == result["tuned_calls"] and not result["tuned_shapes_missed"], result
    ft = result["finetune"]          # validation loss, previews of base | now | EMA, a masked batch on the device
    assert ft["val_rows"] == 2 and ft["val_loss_finite"] and ft["base_preview"], ft
    assert ft["grids"] == ["step_00000002.png", "step_00000004.png"] and ft["mask_on_device"] == "cpu", ft
    assert 0 < ft["counted"] and math.isfinite(ft["val_loss_device"]), ft
    # Muon: the iteration in the device's dtype (fp32 on a CPU), and the trainer's step with it beside AdamW's
    assert result["muon_ns_dtype"] == "float32" and 0.4 < result["muon_ns_sv_min"] < result["muon_ns_sv_max"] < 1.3
    assert result["muon_trainer_loss_falls"] and result["muon_trainer_muon_optim_s"] > 0, result
    assert len(result["muon_trainer_adamw_losses"]) == len(result["muon_trainer_muon_losses"]) == 3
    # DPO from host batches on the device: log 2 at the start, the replay term, gradients to the policy only
    assert abs(result["dpo_pair_loss_at_start"] - math.log(2)) < 1e-4 and result["dpo_replay_term"] > 0, result
    assert result["dpo_policy_grad"] and result["dpo_reference_grad_free"] and result["dpo_loss_moves"], result
    # The demo's trainer building the next step during the backward pass: the same weights (on a CPU the trainer
    # does not build ahead; the check forces it there to run the path)
    assert result["demo_built_ahead_by_trainer"] is False and result["demo_weights_max_abs_diff"] == 0.0, result
    assert result["demo_step_s_built_ahead"] > 0 and result["demo_step_s_built_when_asked"] > 0


def test_bucket_probe_scores_a_run_at_each_canvas(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    tr = build_trainer(tiny_cfg("train.steps=2", "train.checkpoint_every=0"), tmp_path / "run")
    tr.fit()
    tr.close()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bucket_probe.py"), str(tmp_path / "run"), "32x48",
                           "48x32", "--n", "2"], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert list(result) == ["32x32", "32x48", "48x32"]
    assert all(set(v) == {"color", "position", "shape"} and all(0 <= x <= 1 for x in v.values())
               for v in result.values())
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "bucket_probe.py"), str(tmp_path / "run"), "16x48"],
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and "must hold the 32 x 32 scene" in bad.stderr


def _dpo_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dpo_shapes_bench", ROOT / "bench" / "dpo_shapes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_efficiency_summary_counts_within_the_accuracy_budget_and_leaves_failed_rounds_out():
    """--efficiency's figures of a method: +40 counts only at <= 3 points of accuracy; a round that failed (the
    raters could not finish it) is listed apart and in no figure; with today's own round failed nothing is counted."""
    bench = _dpo_bench()

    def run(j, gain, drop):
        return {"judgements": j, "gain_pp": gain, "acc_drop_pp": drop, "acc_drop_upper95_pp": drop + 3}

    failed = {"label": "x", "failed": "the automatic raters ran out of items", "judgements": None, "gain_pp": None}
    s = bench.summarize_method([run(100, 45.0, 4.0), run(300, 41.0, 2.0), dict(failed), run(1200, 30.0, 1.0)], 1000)
    assert s["answers_fraction_for_40pp"] == 0.3 and s["answers_fraction_for_40pp_any_accuracy"] == 0.1
    # today's answers: the most answers at or under today's (1,200 > 1,000 is past them)
    assert s["gain_pp_at_todays_answers"] == 41.0 and s["answers_fraction_at_todays_answers"] == 0.3
    assert s["acc_drop_pp"] == 2.0 and [r["judgements"] for r in s["runs"]] == [100, 300, 1200]
    assert s["failed_runs"] == [failed]
    none = bench.summarize_method([run(100, 45.0, 1.0)], None)
    assert none["answers_fraction_for_40pp"] is None and none["gain_pp_at_todays_answers"] is None
    err = bench.CliFailed("difftrain align failed", "INFO x\nerror: batch b: the automatic raters ran out of items\n")
    assert isinstance(err, SystemExit) and err.error == "batch b: the automatic raters ran out of items"


def test_a_run_of_two_rounds_spends_the_answers_of_both():
    """A run of several rounds counts every round's judgements (gold too) against today's; the spammer counts as
    flagged only if every round flagged it."""
    bench = _dpo_bench()

    def stage(j, gold, pairs, flagged):
        return {"rated": {"cost": {"judgements": j, "gold": gold, "by_rater": {"a": j}},
                          "raters": {"spammer": {"flagged": flagged}}},
                "pairs": {"pairs": pairs, "ties_dropped": 1}}

    one = bench.spent([stage(95, 12, 29, False)])
    assert one == {"judgements": 95, "gold_judgements": 12, "by_rater": {"a": 95}, "pairs": 29, "ties_dropped": 1,
                   "spammer_flagged": False}
    two = bench.spent([stage(95, 12, 29, True), stage(125, 8, 19, False)])
    assert two["judgements"] == 220 and two["gold_judgements"] == 20 and two["pairs"] == 48
    assert two["by_rater"] == [{"a": 95}, {"a": 125}] and two["ties_dropped"] == 2 and not two["spammer_flagged"]
    assert bench.spent([stage(95, 12, 29, True), stage(125, 8, 19, True)])["spammer_flagged"]


def test_a_failed_run_is_set_aside_with_its_reason_and_tried_again(tmp_path, capsys):
    bench = _dpo_bench()
    run = tmp_path / "active_pairs-3"
    run.mkdir()
    (run / "failed.json").write_text(json.dumps({"failed": "the automatic raters ran out of items"}))
    aside = bench.set_aside(run)
    assert not run.exists() and (aside / "failed.json").is_file() and aside.name.startswith("active_pairs-3.failed-")
    assert "ran out of items" in capsys.readouterr().err
