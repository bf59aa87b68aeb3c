"""Metrics endpoint, events, per-rank JSON logs, the loss-spike detector, the hang watchdog and straggler
detection."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from difftrain.train.health import HANG_EXIT_CODE, SpikeDetector, stragglers
from difftrain.train.metrics import MetricsLogger, read_events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_endpoint_serves_metrics_and_event_counters(tmp_path):
    port = _free_port()
    m = MetricsLogger(tmp_path, tensorboard=False, port=port)
    try:
        m.log(7, {"loss": 0.25, "samples_per_s": 12.5, "task": "t2i"})
        m.event("checkpoint", 7, bytes=10)
        m.event("checkpoint", 14, bytes=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        m.close()
    assert 'difftrain_loss{rank="0"} 0.25' in text
    assert 'difftrain_samples_per_s{rank="0"} 12.5' in text
    assert 'difftrain_step{rank="0"} 7.0' in text
    assert 'difftrain_events_checkpoint_total{rank="0"} 2.0' in text
    assert "task" not in text.split("difftrain_step")[0].split("difftrain_loss")[-1]   # strings are not gauges
    assert [e["step"] for e in read_events(tmp_path)] == [7, 14]


def test_each_process_of_a_node_serves_port_plus_its_local_rank(tiny_cfg, tmp_path, monkeypatch):
    """Local rank, not global rank: rank 9 of a job is local rank 1 of its node and serves port + 1, as local
    rank 1 does on every node (one scrape config for all nodes)."""
    from difftrain.train import build_trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    monkeypatch.setenv("LOCAL_RANK", "1")
    tr = build_trainer(tiny_cfg("train.steps=1", "train.checkpoint_every=0", f"train.metrics_port={base - 1}"),
                       tmp_path / "run")
    try:
        tr.fit()
        text = urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10).read().decode()
    finally:
        tr.close()
    assert 'difftrain_step{rank="0"} 1.0' in text


def test_port_in_use_is_a_clear_error(tmp_path):
    from difftrain.errors import UserError
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        with pytest.raises(UserError, match="metrics_port"):
            MetricsLogger(tmp_path, tensorboard=False, port=s.getsockname()[1])


def test_training_writes_per_rank_json_logs_events_and_the_step_breakdown(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    tr = build_trainer(tiny_cfg("train.steps=4", "train.checkpoint_every=2"), tmp_path / "run")
    try:
        tr.fit()
    finally:
        tr.close()
    logs = [json.loads(line) for line in (tmp_path / "run" / "logs" / "rank_0.jsonl").read_text().splitlines()]
    assert logs and all(r["rank"] == 0 and r["run_id"] == tr.run_id for r in logs)
    assert any(r["step"] is not None for r in logs)
    kinds = [e["kind"] for e in read_events(tmp_path / "run")]
    assert kinds[0] == "start" and kinds.count("checkpoint") == 2
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("time", "fwd_bwd_s", "optim_s", "data_s", "mem_gb", "skipped_steps", "restarts", "samples_seen"):
        assert key in row, key
    assert row["samples_seen"] == 4 * 4 and row[f"loss_{row['task']}"] == row["loss"]


def test_spike_detector_flags_outliers_only():
    d = SpikeDetector(window=50, threshold=8.0, min_count=20)
    flagged = [d.update(1.0 + 0.01 * ((i * 7) % 5)) for i in range(60)]
    assert not any(flagged)
    assert d.update(5.0) is not None          # far outside the window's spread
    assert d.update(1.02) is None
    assert d.update(float("nan")) is None     # a NaN is the skip logic's business, not a spike


def test_stragglers():
    assert stragglers([1.0, 1.1, 0.9, 2.0], 1.5) == [3]
    assert stragglers([1.0, 1.2], 1.5) == []
    assert stragglers([3.0], 1.5) == []


@pytest.mark.slow
@pytest.mark.parametrize("pause_at, fires", [(1, False), (2, True)])
def test_the_first_step_runs_under_the_start_up_allowance_and_later_ones_under_hang_seconds(tmp_path, pause_at,
                                                                                          fires):
    """A 12 s pause before step 1 (a long first compilation) is inside the 60 s start-up allowance; the same
    pause before step 2 is a hang (limit 4 s): stacks written, exit 86 for the launcher to restart."""
    from conftest import TINY
    from difftrain.config import load_config, to_toml

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(to_toml(load_config(None, TINY + ["train.steps=3", "train.checkpoint_every=0", "train.threads=1",
                                                     "health.hang_seconds=4", "health.hang_startup_seconds=60"])))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FAULTS": f"pause@{pause_at}", "DIFFTRAIN_SLOW_S": "12"}
    proc = subprocess.run([sys.executable, "-m", "difftrain", "train", str(cfg), "--run-dir", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    dump = tmp_path / "run" / "hang" / "rank_0.txt"
    if fires:
        assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-2000:]
        assert "(limit 4 s) after step 1 (training)" in dump.read_text()
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not dump.exists()


def test_the_watchdog_watches_the_build_before_any_step(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    tr = build_trainer(tiny_cfg("train.steps=1", "train.checkpoint_every=0", "health.hang_startup_seconds=30"),
                       tmp_path / "run")
    try:
        assert tr.watchdog._thread.is_alive() and not tr.watchdog.steady and tr.watchdog._limit() == 30
        tr.fit()
        assert tr.watchdog.steady
    finally:
        tr.close()
    assert not tr.watchdog._thread.is_alive() or tr.watchdog._stop.is_set()


def test_watchdog_dumps_stacks_and_exits_for_the_launcher(tmp_path):
    code = textwrap.dedent(f"""
        import time
        from difftrain.train.health import Watchdog
        w = Watchdog({str(tmp_path)!r}, 3, timeout=1.0, startup_timeout=1.0).start()
        w.beat(5)
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    dump = (tmp_path / "hang" / "rank_3.txt").read_text()
    assert "no progress" in dump and "after step 5" in dump and "stuck_in_a_collective" in dump
