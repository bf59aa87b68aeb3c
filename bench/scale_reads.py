"""Memory and reads at scale, on a CPU: the figures a 64-node job depends on, each against its target.

- ``dpo_nf4_peak_over_plan`` / ``sample_nf4_peak_over_plan``: the peak bytes of building and loading a LoRA DPO
  run's policy (``dpo.init`` read a layer at a time) and a sampler of a LoRA run, on an nf4 base, over the planner's
  figure (``adapter_plan.build_ledger``; torch's ``MemTracker``: ``bench/build_ledger.py``). Target <= 1.0. The steps'
  activations and optimizer state come after the build and are the planner's own model (``tests/test_planner.py``
  checks it against a measured step).
- ``bytes_read_per_node_over_base``: 4 gloo ranks as 2 nodes of 2 (``LOCAL_WORLD_SIZE=2``) train a LoRA on an nf4
  base: the bytes each node reads from the base's files over the files' size. Target <= 1.05 (under 1: the sharded
  rest of the model is read half by each node).
- ``muon_bytes_ratio``: the bytes each rank sends and receives in a Muon step at N = 4 gloo ranks over the all-gather
  of every matrix it replaced (``tests/test_muon.py`` counts them through a wrapped collective). Target <= 0.5.

    python bench/scale_reads.py [--width 128]

prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ledger_ratios(width: int, root: Path) -> dict:
    from difftrain.parallel.adapter_plan import build_ledger

    lb = _bench("build_ledger")
    sets = lb.model_sets(width, 4)
    root.mkdir(parents=True, exist_ok=True)
    runs = lb.prepare(root, sets)
    cpu = torch.device("cpu")
    out = {}
    for key, entry in (("dpo_nf4_peak_over_plan", "dpo"), ("sample_nf4_peak_over_plan", "sample")):
        cfg, role, weights, info, spec = lb.case(runs, sets, entry, "nf4", True)
        peak, _, counts = lb.measure(cfg, role, weights, info, spec, cpu)
        figure = build_ledger(cfg, role, lb.weight_bytes(cfg, role, True, cpu))
        out[key] = round(peak / figure["peak_bytes"], 4)
        out[key.replace("_over_plan", "_mb")] = round(peak / 2 ** 20, 2)
        out[key.replace("peak_over_plan", "max_full_precision_layers")] = max(counts, default=0)
    out["base"] = str(runs["base"])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_worker(rank: int, world: int, port: int, cfg_path: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % 2),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import torch.distributed as dist

    from difftrain.config import load_config
    from difftrain.models import build_autoencoder, build_text_encoder
    from difftrain.parallel.dist import init_distributed, shutdown
    from difftrain.shapes.captions import vocabulary
    from difftrain.train.adapters import check_adapter_config
    from difftrain.train.build import Weights, build_model

    cfg = load_config(cfg_path)
    env = init_distributed(cfg)
    try:
        ae = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor)
        text = build_text_encoder(cfg, vocabulary(), env.device)
        built = build_model(cfg, "policy", device=env.device, text_encoder=text, autoencoder=ae, env=env,
                            weights=Weights.base(cfg.model.init_from), adapter=check_adapter_config(cfg))
        Path(out, f"{rank}.json").write_text(json.dumps(built.report))
        dist.barrier()
    finally:
        shutdown(True)


def node_reads(width: int, root: Path, base: Path) -> dict:
    from difftrain.config import load_config, preset_path, to_toml

    lb = _bench("build_ledger")
    cfg_path = root / "nodes.toml"
    cfg_path.write_text(to_toml(load_config(preset_path("shapes-tiny"), lb.model_sets(width, 4) + lb.LORA + [
        "adapter.base_precision=nf4", f"model.init_from={base}", "train.global_batch=4"])))
    out = root / "ranks"
    out.mkdir()
    mp.spawn(_node_worker, args=(4, _free_port(), str(cfg_path), str(out)), nprocs=4, join=True)
    reports = [json.loads((out / f"{r}.json").read_text()) for r in range(4)]
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    per_node = [sum(reports[r]["bytes_read"] for r in node) for node in ((0, 1), (2, 3))]
    return {"bytes_read_per_node_over_base": round(max(per_node) / size, 4), "bytes_read_per_node": per_node,
            "base_file_bytes": size, "node_bytes_received": [r.get("node_bytes_received", 0) for r in reports]}


def muon_ratio() -> dict:
    """The Muon traffic at N = 4, from ``tests/test_muon.py``'s counting (a real 4-rank gloo run)."""
    sys.path.insert(0, str(ROOT / "tests"))        # spawned ranks import the worker from there
    import test_muon as module
    measure = getattr(module, "muon_traffic", None)
    if measure is None:
        return {"muon_bytes_ratio": "not run (tests/test_muon.py has no muon_traffic)"}
    with tempfile.TemporaryDirectory() as d:
        return measure(4, Path(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        out = ledger_ratios(args.width, root / "ledger")
        out.update(node_reads(args.width, root, Path(out.pop("base"))))
    out.update(muon_ratio())
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
