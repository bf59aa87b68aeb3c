"""Real multi-process training (gloo, one thread per rank) against one process at the same global batch:
FSDP2, DDP, HSDP and context parallelism; world-size-independent initialisation; gradient accumulation
with one reduction per step; checkpoints saved on 2 ranks and resumed on 1 and 4 (under torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from difftrain.config import load_config, to_toml
from difftrain.train.metrics import read_metrics

from conftest import TINY

pytestmark = pytest.mark.slow

# 8 samples a step: divisible by every data-parallel size used below; heads 2 so cp = 2 divides them.
BASE = TINY + ["train.global_batch=8", "train.ema_decay=0.9", "train.checkpoint_every=0", "train.threads=1",
               "data.caption_dropout=0.3", "data.keyframe_cond_prob=0.6", "train.warmup_steps=1",
        "train.schedule=constant"]   # runs of different lengths share the LR of each step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(cfg, run_dir, steps_for_grads=1):
    """Train ``cfg`` in this process (distributed if a process group is up); returns per-step losses, the
    step-1 gradients, the initial parameters and the number of reduce-scatters per step (full tensors)."""
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer

    tr = build_trainer(cfg, run_dir, env=init_distributed(cfg))
    params = dict(tr.model.named_parameters())      # the sharded parameters, as the optimizer holds them
    init = {k: _full(p.detach()).clone() for k, p in params.items()}
    grads, reductions = {}, []
    step = tr.optimizer.step

    def capture(*a, **kw):
        if tr.step < steps_for_grads:
            missing = [k for k, p in params.items() if p.grad is None]
            assert not missing, f"no gradient reached {missing[:3]}"
            grads.update({k: _full(p.grad).clone() for k, p in params.items()})
        return step(*a, **kw)

    tr.optimizer.step = capture
    # FSDP2 reduces gradients with one of these (which one depends on the torch release): count the calls.
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(torch.distributed, n)]
    originals = {n: getattr(torch.distributed, n) for n in names}
    count = [0]

    def counting(fn):
        def wrapped(*a, **kw):
            count[0] += 1
            return fn(*a, **kw)
        return wrapped

    for n in names:
        setattr(torch.distributed, n, counting(originals[n]))
    losses = []

    def on_step(s, total, stats):
        losses.append(stats.loss)
        reductions.append(count[0])
        count[0] = 0
    try:
        tr.fit(on_step)
    finally:
        for n, fn in originals.items():
            setattr(torch.distributed, n, fn)
    return {"losses": losses, "grads": grads, "init": init, "reductions": reductions, "accum": tr.accum}


def _end_group(clean: bool) -> None:
    """End a spawned rank's process group while the interpreter is alive: after a clean run every rank first waits
    for the others, then the last references to the group (a trainer's DTensors, its FSDP state) are collected.
    Gloo threads torn down during interpreter finalisation abort the rank (SIGABRT, "terminate called without an
    active exception") after a run that succeeded."""
    import gc

    from difftrain.parallel.dist import shutdown
    shutdown(clean)
    gc.collect()


def _worker(rank: int, world: int, port: int, scenarios: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results, clean = {}, False
    try:
        for name, overrides in scenarios.items():
            cfg = load_config(None, BASE + overrides)
            results[name] = _run(cfg, Path(out) / name)
            torch.distributed.barrier()
        clean = True
    finally:
        _end_group(clean)
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")


def _spawn(world: int, scenarios: dict, tmp_path: Path) -> dict:
    mp.spawn(_worker, args=(world, _free_port(), scenarios, str(tmp_path)), nprocs=world, join=True)
    return torch.load(tmp_path / "results.pt")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))


def _assert_same_training(got: dict, ref: dict, what: str) -> None:
    steps = len(ref["losses"])
    assert len(got["losses"]) == steps, what
    assert abs(got["losses"][0] - ref["losses"][0]) <= 1e-5 * abs(ref["losses"][0]), (what, got["losses"][0],
                                                                                     ref["losses"][0])
    for s, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-4 * abs(b), (what, s + 1, a, b)
    assert got["grads"].keys() == ref["grads"].keys()
    worst = max((_rel(got["grads"][k], ref["grads"][k]), k) for k in ref["grads"] if ref["grads"][k].norm() > 0)
    assert worst[0] <= 1e-5, (what, worst)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"{what}: {steps} steps, largest relative loss difference {loss_rel:.1e}, "
          f"step-1 gradients {worst[0]:.1e} ({worst[1]})")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch of 8, 20 steps."""
    d = tmp_path_factory.mktemp("ref")
    return {"plain": _run(load_config(None, BASE + ["train.steps=20"]), d / "plain"),
            "accum": _run(load_config(None, BASE + ["train.steps=20", "train.micro_batch=2"]), d / "accum"),
            "dir": d / "plain"}


def test_two_ranks_fsdp_ddp_cp_and_accumulation_match_one_rank(reference, tmp_path):
    scenarios = {
        "fsdp": ["train.steps=20", "parallel.dp_shard=2"],
        "ddp": ["train.steps=20", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
        "cp": ["train.steps=20", "parallel.dp_shard=1", "parallel.cp=2", "train.sample_every=10"],
        "accum": ["train.steps=4", "parallel.dp_shard=2", "train.micro_batch=2"],
        "accum_every": ["train.steps=2", "parallel.dp_shard=2", "train.micro_batch=2", "parallel.grad_sync=every"],
        "ac_full": ["train.steps=2", "parallel.dp_shard=2", "parallel.ac=full"],
        "ac_selective": ["train.steps=2", "parallel.dp_shard=2", "parallel.ac=selective"],
    }
    got = _spawn(2, scenarios, tmp_path)
    ref = reference["plain"]
    _assert_same_training(got["fsdp"], ref, "fsdp")
    _assert_same_training(got["ddp"], ref, "ddp")
    _assert_same_training(got["cp"], ref, "cp")
    for name in ("ac_full", "ac_selective"):        # recomputation inside FSDP units changes nothing
        _assert_same_training(got[name], {**ref, "losses": ref["losses"][:2]}, name)
    acc = got["accum"]
    _assert_same_training(acc, {**reference["accum"], "losses": reference["accum"]["losses"][:4]}, "accum")
    assert acc["accum"] == 2
    # one reduce-scatter per FSDP unit per step, not one per micro-batch
    units = got["fsdp"]["reductions"][0]
    assert units > 0 and acc["reductions"] == [units] * 4, (units, acc["reductions"])
    every = got["accum_every"]        # grad_sync = every: one reduce-scatter per unit per micro-batch
    _assert_same_training(every, {**reference["accum"], "losses": reference["accum"]["losses"][:2]}, "every")
    assert every["reductions"] == [units * 2] * 2, every["reductions"]
    assert (tmp_path / "cp" / "samples" / "step_00000010.png").is_file()   # sampled on both ranks, cp off
    for name in scenarios:                   # the same initial model whatever the mesh
        for k, v in ref["init"].items():
            assert torch.equal(got[name]["init"][k], v), (name, k)


def test_four_ranks_hsdp_and_fsdp_with_cp_match_one_rank(reference, tmp_path):
    got = _spawn(4, {"hsdp": ["train.steps=20", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
                     "fsdp_cp": ["train.steps=20", "parallel.dp_shard=2", "parallel.cp=2"]}, tmp_path)
    ref = reference["plain"]
    _assert_same_training(got["hsdp"], ref, "hsdp")
    _assert_same_training(got["fsdp_cp"], ref, "fsdp_cp")
    for k, v in ref["init"].items():
        assert torch.equal(got["hsdp"]["init"][k], v), k


def _torchrun(nproc: int, config: Path, run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "difftrain", "train", str(config), "--run-dir", str(run_dir), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_torchrun_checkpoint_on_two_ranks_resumes_on_one_and_four(reference, tmp_path):
    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(to_toml(load_config(None, BASE + ["train.steps=20", "train.checkpoint_every=10",
                                                          "train.keep_checkpoints=3", "train.sample_every=20"])))
    a = tmp_path / "two"
    proc = _torchrun(2, cfg_path, a)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["world_size"] == 2
    straight = {m["step"]: m["loss"] for m in read_metrics(a)}
    ref = reference["plain"]["losses"]
    assert [straight[s] for s in range(1, 21)] == pytest.approx(ref, rel=1e-4)
    # each rank wrote its own shard files, and nothing twice: the two ranks' files hold as many bytes as
    # one process's checkpoint of the same state (headers aside); periodic sampling ran on both ranks;
    # the export is whole
    assert len(list((a / "checkpoints" / "step_00000010").glob("*.safetensors"))) >= 2
    two_bytes = sum(f.stat().st_size for f in (a / "checkpoints" / "step_00000020").glob("*.safetensors"))
    one_bytes = sum(f.stat().st_size for f in (reference["dir"] / "checkpoints" / "step_00000020").glob("*.safetensors"))
    assert abs(two_bytes - one_bytes) < 0.05 * one_bytes, (two_bytes, one_bytes)
    assert (a / "samples" / "step_00000020.png").is_file()
    from safetensors.torch import load_file
    weights = load_file(str(a / "export" / "model.safetensors"))
    assert weights["dit.img_in.weight"].shape == (32, 192)
    for world in (1, 4):
        b = tmp_path / f"resume{world}"
        shutil.copytree(a, b)
        shutil.rmtree(b / "checkpoints" / "step_00000020")
        (b / "checkpoints" / "latest").write_text("step_00000010")
        (b / "metrics.jsonl").unlink()
        if world == 1:
            from difftrain.cli import main
            assert main(["train", str(cfg_path), "--run-dir", str(b), "--no-progress"]) == 0
        else:
            _torchrun(world, cfg_path, b, "parallel.dp_shard=4")
        resumed = {m["step"]: m["loss"] for m in read_metrics(b)}
        assert sorted(resumed) == list(range(11, 21)), world
        for s in range(11, 21):
            assert resumed[s] == pytest.approx(straight[s], rel=1e-4), (world, s)


def _share_worker(rank: int, world: int, port: int, out: str) -> None:
    """HSDP (2 replicas x 2 shards): an async save at step 1, the blocking end-of-run save at step 2. Records per
    rank what each save staged, what its writer wrote, and the full state after the run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from difftrain.parallel.dist import init_distributed
    from difftrain.train import build_trainer
    from difftrain.train.checkpoint import StreamingSafetensorsWriter, tensor_bytes

    written = []
    original = StreamingSafetensorsWriter.write_data

    def write_data(self, plan, planner):
        fut = original(self, plan, planner)
        written.append(self.bytes_written)
        return fut

    StreamingSafetensorsWriter.write_data = write_data
    tr, clean = None, False
    try:
        cfg = load_config(None, BASE + ["train.steps=2", "train.checkpoint_every=1", "train.async_checkpoint=true",
                                        "parallel.dp_replicate=2", "parallel.dp_shard=2"])
        tr = build_trainer(cfg, Path(out) / "run", env=init_distributed(cfg))
        tr.fit()
        whole = tensor_bytes(tr.checkpointer._gather(tr.model, tr.optimizer, tr.ema)[0])
        full = {k: _full(v.detach()).clone() for k, v in tr.model.state_dict().items()}
        # The export again, counting all-gathers: only rank 0 may hold full tensors (gathered to it alone).
        from torch.distributed.tensor import DTensor

        gathers, all_gather = [0], DTensor.full_tensor
        DTensor.full_tensor = lambda self, *a, **k: (gathers.__setitem__(0, gathers[0] + 1), all_gather(self, *a, **k))[1]
        try:
            tr.export()
        finally:
            DTensor.full_tensor = all_gather
        ema = {k: _full(v.detach()).clone() for k, v in tr.ema.state_dict().items()}
        result = {"written": written, "staged": tr.checkpointer._stager_obj.staged_bytes,
                  "rank_bytes": [r.rank_bytes for r in tr.checkpointer.completed], "whole": whole,
                  "full": full if rank == 0 else None, "ema": ema if rank == 0 else None,
                  "export_all_gathers": gathers[0]}
        torch.save(result, Path(out) / f"share_{rank}.pt")
        clean = True
    finally:
        StreamingSafetensorsWriter.write_data = original
        tr = None                   # the trainer's DTensors go with the group, while the interpreter is alive
        _end_group(clean)


def test_hsdp_ranks_stage_only_what_their_save_plan_writes_and_the_checkpoint_resumes_whole(tmp_path):
    """Every rank of an HSDP replica group holds the same shard; DCP writes it once, so only its writer copies it
    to host memory. Per rank: bytes staged (async) = bytes its writer wrote = its share; the shares add up to the
    checkpoint (nothing written twice, nothing missing: a 1-process resume gets the 4-rank state back), each is
    about half of the rank's state (2 replicas), and writing is spread over both replicas. The export gathers
    each tensor to rank 0 alone."""
    mp.spawn(_share_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4, join=True)
    ranks = [torch.load(tmp_path / f"share_{r}.pt") for r in range(4)]
    step1 = tmp_path / "run" / "checkpoints" / "step_00000001"
    data = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
               for f in step1.glob("*.safetensors"))
    for r, got in enumerate(ranks):
        assert got["written"][0] == got["staged"] == got["rank_bytes"][0], (r, got)
        assert got["written"][1] == got["rank_bytes"][1] == got["rank_bytes"][0]       # the blocking save too
        assert 0.35 * got["whole"] < got["rank_bytes"][0] < 0.65 * got["whole"], (r, got)
    assert sum(got["written"][0] for got in ranks) == data
    # the end-of-run export: gathered to rank 0 only (no all-gather on any rank), and exactly the EMA weights
    from safetensors.torch import load_file

    assert [got["export_all_gathers"] for got in ranks] == [0, 0, 0, 0]
    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert exported.keys() == ranks[0]["ema"].keys()
    for k, v in ranks[0]["ema"].items():
        assert torch.equal(exported[k], v), k
    # plan's 'stage' column: the largest rank's share, from the inventory alone
    from difftrain.models import config_dit_params
    from difftrain.parallel.memory import inventory
    from difftrain.parallel.planner import Strategy, staging_bytes
    from difftrain.sources import vocabulary_for

    cfg = load_config(None, BASE + ["train.steps=2"])
    hsdp = Strategy("hsdp", "hsdp", 2, 2, 1, "none", False)
    planned = staging_bytes(inventory(config_dit_params(cfg), cfg, vocabulary_for(cfg)), hsdp, 4, True, True)
    largest = max(got["rank_bytes"][0] for got in ranks)
    assert abs(planned - largest) <= 0.05 * largest, (planned, [got["rank_bytes"][0] for got in ranks])
    from difftrain.train import build_trainer

    tr = build_trainer(cfg, tmp_path / "run")               # resumes the step-2 checkpoint on one process
    assert tr.step == 2
    for k, v in ranks[0]["full"].items():
        assert torch.equal(tr.model.state_dict()[k], v), k
