"""Automatic restart under torchrun (2 gloo ranks, one thread each): a rank killed with SIGKILL, and rank 0
killed while sealing a checkpoint. The job restarts with no person involved, resumes from the newest
complete checkpoint, and ends with checkpoint tensors bit-identical to an uninterrupted run's, over a sample
stream with no repeat and no gap. Also: preemption by SIGTERM (all ranks stop at one step, checkpoint,
leave the requeue marker), NaN skip and rollback, config-change refusal, --no-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from difftrain.config import load_config, to_toml
from difftrain.train.metrics import read_events, read_metrics

from conftest import TINY

pytestmark = pytest.mark.slow

BASE = TINY + ["train.global_batch=8", "train.ema_decay=0.9", "train.threads=1", "train.warmup_steps=1",
               "train.schedule=constant", "train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=5",
               "health.hang_seconds=120"]


def _torchrun(config: Path, run_dir: Path, faults: str = "", restarts: int = 0, nproc: int = 2,
              sample_log: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "-m", "difftrain", "train", str(config), "--run-dir", str(run_dir),
           "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FAULTS": faults}
    if sample_log is not None:
        env["DIFFTRAIN_SAMPLE_LOG"] = str(sample_log)
    # A session of its own, so that a timeout kills torchrun's workers too, not only torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {timeout} s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class _Tensors(dict):
    """name -> tensor; equal when the same names hold bit-identical tensors of the same dtype (the safetensors
    headers may list the same tensors in another order)."""

    def __eq__(self, other):
        return self.keys() == other.keys() and all(
            self[k].dtype == other[k].dtype and torch.equal(self[k], other[k]) for k in self)


def _final_files(run_dir: Path, step: int = 12) -> dict[str, _Tensors]:
    from safetensors.torch import load_file
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    return {f.name: _Tensors(load_file(str(f))) for f in sorted(d.glob("*.safetensors"))}


def _stream(log: Path, nproc: int = 2) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> the ids of the last time that step's batch was drawn; replayed steps must have drawn
    the same ids each time."""
    out: dict[tuple[int, int], list[int]] = {}
    for r in range(nproc):
        for line in Path(f"{log}.rank{r}").read_text().splitlines():
            row = json.loads(line)
            key = (r, row["step"])
            assert out.get(key, row["ids"]) == row["ids"], f"rank {r} step {row['step']}: a replay drew other samples"
            out[key] = row["ids"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    cfg = d / "tiny.toml"
    cfg.write_text(to_toml(load_config(None, BASE)))
    proc = _torchrun(cfg, d / "run", sample_log=d / "samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"cfg": cfg, "files": _final_files(d / "run"), "stream": _stream(d / "samples"),
            "losses": {m["step"]: m["loss"] for m in read_metrics(d / "run") if "loss" in m}}


@pytest.mark.parametrize("faults", ["kill@10:1", "killsave@8:0", "corrupt@10:0", "truncate@10:0"])
def test_torchrun_restart_after_kill_is_bit_identical(reference, tmp_path, faults):
    run = tmp_path / "run"
    proc = _torchrun(reference["cfg"], run, faults, restarts=2, sample_log=tmp_path / "samples")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(run)
    resumes = [e for e in events if e["kind"] == "resume"]
    assert len(resumes) == 1, events
    # kill before step 10: the newest complete checkpoint is step 8, or 4 if 8's async write was still in flight
    # (it fails when the peer dies, as it should); kill while sealing step 8: step 4; bytes flipped in step 8's
    # largest file (rank 0's share to checksum): step 8 is set aside by both ranks' verdict, step 4 resumed
    assert resumes[0]["step"] in ((4, 8) if faults.startswith("kill@") else (4,))
    if faults.startswith(("corrupt", "truncate")):
        skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
        # a short file is caught by its size, which every rank checks; a flipped byte by the checksum of the
        # rank whose share the file is
        why = "fails its CRC-32 checksum" if faults.startswith("corrupt") else "bytes, its marker says"
        assert [e["step"] for e in skipped] == [8] and why in skipped[0]["reason"], skipped
        assert faults.startswith("truncate") or "rank 0:" in skipped[0]["reason"], skipped
        assert (run / "checkpoints" / "step_00000008.bad").is_dir()
    assert resumes[0]["restart_count"] == 1
    # the resumed checkpoint was checksummed by both ranks, each its share: together every byte once, neither
    # more than half the bytes plus the largest file
    verified = [e for e in events if e["kind"] == "verify" and e["step"] == resumes[0]["step"]]
    assert len(verified) == 1, events
    v = verified[0]
    marker = json.loads((run / "checkpoints" / f"step_{v['step']:08d}" / "COMPLETE.json").read_text())["files"]
    assert sum(v["bytes_by_rank"]) == v["total_bytes"] == sum(f["bytes"] for f in marker.values())
    assert max(v["bytes_by_rank"]) <= v["total_bytes"] / 2 + max(f["bytes"] for f in marker.values())
    assert min(v["bytes_by_rank"]) > 0
    assert not list((run / "checkpoints").glob("*.partial"))
    got = _final_files(run)
    assert got.keys() == reference["files"].keys()
    for name in got:
        assert got[name] == reference["files"][name], f"{name} differs from the uninterrupted run's"
    stream = _stream(tmp_path / "samples")
    assert stream == reference["stream"]                          # no gap, no repeat, the same samples
    assert sorted({s for _, s in stream}) == list(range(1, 13))
    losses = {m["step"]: m["loss"] for m in read_metrics(run) if "loss" in m}
    assert losses == reference["losses"]


def test_a_disk_that_fills_part_way_through_a_shard_costs_one_checkpoint(reference, tmp_path):
    """ENOSPC after rank 1 wrote half of its shard of step 8's checkpoint: the save fails on every rank, the
    partial directory goes, training goes on, the next checkpoint is complete, the run ends as an uninterrupted
    one does."""
    run = tmp_path / "run"
    proc = _torchrun(reference["cfg"], run, "enospc_partial@8:1", sample_log=tmp_path / "samples")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(run)
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [8] and "No space left on device" in failed[0]["reason"], failed
    assert not [e for e in events if e["kind"] == "resume"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000012"]
    assert _final_files(run) == reference["files"]
    assert _stream(tmp_path / "samples") == reference["stream"]


def test_sigterm_preemption_stops_all_ranks_at_one_step_and_requeues(reference, tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(reference["cfg"], run, "sigterm@5:1", sample_log=tmp_path / "samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = json.loads((run / "requeue.json").read_text())
    stopped = marker["step"]
    # rank 1's signal before step 5: every rank stops after step 5 (rank 0, which writes the marker, heard of it
    # through the step's collective)
    assert stopped == 5 and marker["reason"] == "a signal on another rank"
    assert (run / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE.json").is_file()
    assert [e["step"] for e in read_events(run) if e["kind"] == "preempt"] == [stopped]
    # every rank logged the stop in its own JSON log, under the job's run id
    logs = {r: [json.loads(x) for x in (run / "logs" / f"rank_{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    stops = {r: [x for x in logs[r] if "preempted" in x["msg"]] for r in (0, 1)}
    assert all(len(stops[r]) == 1 and stops[r][0]["rank"] == r and stops[r][0]["step"] == stopped for r in (0, 1))
    assert stops[0][0]["run_id"] == stops[1][0]["run_id"]
    # the requeued job finishes the run, removes the marker and ends where the uninterrupted run ended
    proc = _torchrun(reference["cfg"], run, "sigterm@5:1", sample_log=tmp_path / "samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "requeue.json").exists()
    assert _final_files(run) == reference["files"]
    assert _stream(tmp_path / "samples") == reference["stream"]


def test_a_slow_rank_is_reported_as_a_straggler(reference, tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "slow.toml"
    cfg.write_text(to_toml(load_config(None, BASE + ["train.steps=8", "health.straggler_every=4",
                                                     "health.straggler_factor=1.3"])))
    os.environ["DIFFTRAIN_SLOW_S"] = "0.4"
    try:
        proc = _torchrun(cfg, run, "slow@1:1")
    finally:
        del os.environ["DIFFTRAIN_SLOW_S"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [e for e in read_events(run) if e["kind"] == "straggler"]
    assert [e["step"] for e in found] == [4, 8] and all(e["ranks"] == [1] for e in found)
    rows = [m for m in read_metrics(run) if "stragglers" in m]
    assert rows and rows[-1]["stragglers"] == 1


def _train(cfg_overrides, run_dir, *flags):
    from difftrain.cli import main
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(to_toml(load_config(None, TINY + ["train.threads=1"] + cfg_overrides)))
    return main(["train", str(cfg), "--run-dir", str(run_dir), "--no-progress", *flags])


def test_nan_steps_are_skipped_then_rolled_back_and_skipped_on_replay(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    # steps 6 and 7 non-finite (rollback_after = 2): roll back to step 4, skip the batches of 6 and 7 on replay
    sets = ["train.steps=10", "train.checkpoint_every=4", "health.rollback_after=2", "train.async_checkpoint=false"]
    monkeypatch.setenv("DIFFTRAIN_FAULTS", "nan@6,nan@7")
    assert _train(sets, tmp_path / "a") == 0
    events = read_events(tmp_path / "a")
    kinds = [(e["kind"], e["step"]) for e in events if e["kind"] in ("skip", "rollback")]
    assert kinds == [("skip", 6), ("skip", 7), ("rollback", 4)]
    lr_a = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "a") if "lr" in m}
    info = json.loads((tmp_path / "a" / "checkpoints" / "step_00000010" / "trainer.json").read_text())
    assert info["skip_steps"] == [6, 7] and info["rollbacks"] == 1 and info["skipped_steps"] == 2
    # the reference: a run that meets no NaN and skips the same two batches ends with the same weights
    monkeypatch.delenv("DIFFTRAIN_FAULTS")
    b = tmp_path / "b"
    b.mkdir()
    (b / "skip_steps.json").write_text("[6, 7]")
    assert _train(sets, b) == 0
    wa, wb = load_file(str(tmp_path / "a" / "export" / "model.safetensors")), load_file(str(b / "export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    (tmp_path / "b" / "skip_steps.json").write_text("[]")
    c = tmp_path / "c"
    assert _train(sets, c) == 0                                   # and one that trains on them differs
    wc = load_file(str(c / "export" / "model.safetensors"))
    assert any(not (wa[k] == wc[k]).all() for k in wa)
    # a lower LR after the rollback, when asked for
    monkeypatch.setenv("DIFFTRAIN_FAULTS", "nan@6,nan@7")
    assert _train(sets + ["health.rollback_lr_factor=0.5"], tmp_path / "d") == 0
    lrs = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "d") if "lr" in m}
    assert lrs[10] == pytest.approx(0.5 * lr_a[10]) and lrs[3] == lr_a[3]


def test_nan_with_rollback_off_fails_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTRAIN_FAULTS", "nan@2")
    with pytest.raises(FloatingPointError, match="not finite"):
        _train(["train.steps=4", "health.rollback_after=0"], tmp_path / "a")


def test_config_change_refused_unless_allowed_and_no_resume(tmp_path, capsys):
    sets = ["train.steps=2", "train.checkpoint_every=0"]
    assert _train(sets, tmp_path / "a") == 0
    capsys.readouterr()
    assert _train(sets + ["train.lr=5e-3", "train.steps=3"], tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "another config" in err and "train.lr: 0.001 -> 0.005" in err and "--allow-config-change train.lr" in err
    assert _train(sets + ["train.lr=5e-3", "train.steps=3"], tmp_path / "a", "--allow-config-change", "train.lr") == 0
    assert _train(sets + ["train.lr=5e-3", "train.steps=4", "parallel.timeout_minutes=5"], tmp_path / "a") == 0
    assert json.loads((tmp_path / "a" / "checkpoints" / "step_00000004" / "trainer.json").read_text())["step"] == 4
    capsys.readouterr()
    assert _train(sets, tmp_path / "a", "--no-resume") == 2
    assert "--no-resume" in capsys.readouterr().err
    assert _train(sets, tmp_path / "fresh", "--no-resume") == 0


SBATCH = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "train.sbatch"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sbatch_requeues_after_sigterm_to_the_torchrun_agent(reference, tmp_path):
    """The scheduler's way: deploy/slurm/train.sbatch runs with ``srun`` and ``scontrol`` shims (srun execs the
    real torchrun; ``scontrol requeue`` runs the script again, as a requeued job would), SIGTERM goes to the
    torchrun agent, not to a worker. The agent passes it on and exits non-zero; the script requeues anyway, and
    the requeued run ends with the uninterrupted run's final state over the same sample stream."""
    shims, run = tmp_path / "shims", tmp_path / "run"
    shims.mkdir()
    (shims / "srun").write_text(f"""#!/bin/bash
while [[ $1 == --* ]]; do shift; done            # srun's own options
echo $$ >> {shims}/agent.pids                    # exec keeps the pid: this is the torchrun agent's
printf '%s\\0' "$@" > {shims}/srun.argv.$(wc -l < {shims}/agent.pids)
exec "$@"
""")
    (shims / "scontrol").write_text(f"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then echo 127.0.0.1; exit 0; fi
if [[ $1 == requeue && $2 == "$SLURM_JOB_ID" ]]; then
    echo requeue >> {shims}/requeues
    (( $(wc -l < {shims}/requeues) <= 2 )) || {{ echo "requeued too often" >&2; exit 1; }}
    exec bash {SBATCH}                           # the job again: same id, same environment
fi
echo "scontrol shim: unexpected arguments: $*" >&2; exit 1
""")
    for shim in ("srun", "scontrol"):
        (shims / shim).chmod(0o755)
    env = {"PATH": f"{shims}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "difftrain", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node001", "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "2",
           "SLURM_SUBMIT_DIR": str(tmp_path), "CONFIG": str(reference["cfg"]), "RUN_DIR": str(run),
           "RDZV_PORT": str(_free_port()), "MAX_RESTARTS": "0", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "DIFFTRAIN_SAMPLE_LOG": str(tmp_path / "samples"),
           # every step sleeps 0.3 s on every rank (no effect on what is computed), so the signal lands mid-run
           "DIFFTRAIN_FAULTS": "slow@1:*", "DIFFTRAIN_SLOW_S": "0.3"}
    log = (tmp_path / "job.out").open("w")
    job = subprocess.Popen(["bash", str(SBATCH)], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        first = tmp_path / "samples.rank0"
        deadline = time.monotonic() + 240
        while not (first.exists() and len(first.read_text().splitlines()) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()[-3000:]
            time.sleep(0.05)
        agent = int((shims / "agent.pids").read_text().split()[0])
        os.kill(agent, signal.SIGTERM)
        rc = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    out = (tmp_path / "job.out").read_text()
    assert rc == 0, out[-4000:]
    assert (shims / "requeues").read_text().split() == ["requeue"], out[-3000:]
    stopped = [e["step"] for e in read_events(run) if e["kind"] == "preempt"]
    assert len(stopped) == 1 and 2 <= stopped[0] < 12, stopped
    # the agent itself exited non-zero after its workers stopped: what the script no longer trusts
    agent_status = int(out.split("difftrain: preempted (srun exit ")[1].split(")")[0])
    assert agent_status != 0
    # the first start measured what a preemption needs; the requeued start gave the agent that long
    lead = json.loads((run / "preemption.json").read_text())
    assert lead["lead_needed_s"] >= lead["step_s"] + lead["save_s"] and lead["configured_lead_s"] == 120
    timeouts = []
    for start in (1, 2):
        argv = (shims / f"srun.argv.{start}").read_text().split("\0")
        timeouts.append(int(argv[argv.index("--shutdown-timeout") + 1]))
    assert timeouts[0] == 120 and 15 <= timeouts[1] < 120, timeouts    # the signal's lead, then the measured need
    assert not (run / "requeue.json").exists()
    assert _final_files(run) == reference["files"]
    assert _stream(tmp_path / "samples") == reference["stream"]
