"""Who checksums a checkpoint on resume: a shapes-tiny run (its own model, optimizer and EMA; FSDP2 over the
ranks) trained to a checkpoint under torchrun on 1 and on 2 ranks (gloo, one thread each), then resumed; the
resume's ``verify`` event gives the bytes each rank checksummed.

Prints one JSON object per rank count: ``verify_bytes_max_rank_over_total`` (bound: 1/N + one piece's share, the
pieces being 64 MiB CRC-32 ranges of the files), ``largest_file_share``, ``total_bytes``, ``verify_s`` (the slowest rank's, the verdicts
gathered) and ``files``.

    python bench/verify_share.py [--ranks 1 2] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from difftrain.train.verification import PIECE

SETS = ["train.steps=4", "train.checkpoint_every=4", "train.threads=1", "train.global_batch=8",
        "train.log_every=1", "train.sample_every=0"]


def train(run: Path, nproc: int, sets: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "difftrain", "train", "shapes-tiny", "--run-dir", str(run), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    out = {}
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            train(run, n, SETS + args.overrides)
            train(run, n, SETS + args.overrides + ["train.steps=5"])        # resumes from step 4
            events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
            v = next(e for e in events if e["kind"] == "verify")
            files = json.loads((run / "checkpoints" / f"step_{v['step']:08d}" / "COMPLETE.json").read_text())["files"]
            largest = max(f["bytes"] for f in files.values())
            out[str(n)] = {"verify_bytes_max_rank_over_total": v["max_rank_over_total"],
                           "bound": round(1 / n + min(PIECE, largest) / v["total_bytes"], 4),
                           "largest_file_share": round(largest / v["total_bytes"], 4), "bytes_by_rank": v["bytes_by_rank"],
                           "total_bytes": v["total_bytes"], "verify_s": v["seconds"], "files": len(files)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
