"""Ctrl-C (SIGINT) to ``difftrain train`` saves a checkpoint before it exits (exit code 130, no requeue marker: nobody
is there to requeue), and the same command resumes from it to the end, bit-identical to a run never interrupted. A
second Ctrl-C exits at once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from difftrain.config import load_config, to_toml

from conftest import TINY

STEPS = 30


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(to_toml(load_config(None, TINY + ["train.global_batch=8", "train.threads=1", f"train.steps={STEPS}",
                                                   "train.checkpoint_every=0", "train.ema_decay=0.9",
                                                   "train.schedule=constant"])))
    return p


def _start(config: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "difftrain", "train", str(config), "--run-dir", str(run),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        rows = run / "metrics.jsonl"
        if rows.is_file() and any(json.loads(x).get("step", 0) >= step for x in rows.read_text().splitlines() if x):
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {limit_s} s")


def _final(run: Path) -> dict[str, torch.Tensor]:
    d = run / "checkpoints" / f"step_{STEPS:08d}"
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_ctrl_c_saves_and_the_same_command_resumes_bit_identically(tmp_path):
    config = _config(tmp_path)
    at = random.Random(os.getpid()).randint(4, STEPS - 8)
    run = tmp_path / "run"
    proc = _start(config, run)
    _wait_for_step(run, at, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Ctrl-C: stopping after this step with a checkpoint" in err
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and at <= int(saved[0][5:]) < STEPS, (saved, at)
    assert not (run / "requeue.json").exists()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events if e["kind"] in ("interrupt", "preempt")] == ["interrupt"]
    again = _start(config, run)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    whole = tmp_path / "whole"
    ref = _start(config, whole)
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-2000:]
    got, want = _final(run), _final(whole)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    config = _config(tmp_path)
    run = tmp_path / "run"
    proc = _start(config, run)
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 30, err[-2000:]
    assert "interrupted" in err
