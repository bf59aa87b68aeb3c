"""The GPU benchmark script runs end to end on a CPU in its smoke mode, so it is known to work before a GPU
machine runs it (where it compiles, uses bf16 and measures the allocator's peak)."""

import json
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
    for key in ("matmul_tflops", "mfu", "step_s", "mfu_full_ac", "step_s_full_ac", "planner_estimate_gb"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result)
    assert 0 < result["mfu"] < 1
