"""Checkpoint figures on a training state of >= 1 GB, one JSON object.

The state: a stack of Linear layers (fp32) with its AdamW moments and an EMA copy, trained by real steps.

1. ``sync_save_s``: a blocking save (DCP safetensors shards, trainer.json, SHA-256 of every file with
   fsync, the marker, the rename).
2. ``async_stall_ratio``: an async save issued at a step; training continues while the background thread
   copies and writes. The extra step time over the whole save window (the window's step times minus the
   same number of baseline steps, stalls included) over ``sync_save_s``; mean of ``--repeats`` saves.
   Baseline: the median step time of the 4 steps before and the 4 after each window. ``--threads``: torch
   threads of the training steps (on a GPU node the CPU is mostly free for the writer; on a CPU-only box,
   training on every core leaves the writer's copying and the kernel's I/O nothing to hide in).
3. ``restore_vs_raw_read_ratio``: finding the newest checkpoint (which checksums every file), loading model,
   optimizer and EMA, over the time to read the same files sequentially; the page cache is dropped before
   each (``page_cache`` says how); ``--repeats`` alternating pairs, medians.

    python bench/checkpoint.py [--gb 1.2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader import drop_cache  # noqa: E402

from difftrain.train.checkpoint import Checkpointer  # noqa: E402
from difftrain.train.ema import EMA  # noqa: E402


def build(gb: float, width: int = 2048) -> nn.Module:
    # params x 4 bytes x 4 (weights, 2 AdamW moments, EMA) = gb
    layers = max(1, round(gb * 2**30 / 16 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def step(model, opt, ema, x, ck=None) -> float:
    t0 = time.perf_counter()
    model(x).pow(2).mean().backward()
    if ck is not None:
        ck.wait_staged()           # as the trainer does: the save's copy is complete before weights change
    opt.step()
    opt.zero_grad(set_to_none=True)
    ema.update()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.2, help="training state size (weights + AdamW + EMA), GiB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for the training steps (0 = default)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="async saves measured (the figures are means)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.gb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ema = EMA(model, 0.999)
    x = torch.randn(args.batch, model[0].in_features)
    for _ in range(3):                                   # AdamW state exists, allocator warm
        step(model, opt, ema, x)
    base = [step(model, opt, ema, x) for _ in range(8)]
    t_base = statistics.median(base)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        sync = Checkpointer(root / "sync", keep=1)
        t0 = time.perf_counter()
        res = sync.save(1, model, opt, ema, {"loader": {}}, blocking=True)
        sync_s = time.perf_counter() - t0
        state_bytes = res.bytes

        ck = Checkpointer(root / "async", keep=1, async_save=True)
        extras, windows, stalls, counts = [], [], [], []
        for rep in range(args.repeats):
            # baseline: the median step time over steps just before and just after the save window
            before = [step(model, opt, ema, x) for _ in range(4)]
            t0 = time.perf_counter()
            res = ck.save(2 + rep, model, opt, ema, {"loader": {}})
            times = [time.perf_counter() - t0]           # the step that saves: its planning stall
            times[0] += step(model, opt, ema, x, ck)
            while not ck._pending.future.done():
                times.append(step(model, opt, ema, x, ck))
            windows.append(time.perf_counter() - t0)
            done = ck.wait()
            assert done.error is None, done.error
            after = [step(model, opt, ema, x) for _ in range(4)]
            t_ref = statistics.median(before + after)
            extras.append(sum(times) - len(times) * t_ref)
            stalls.append(done.stall_s)
            counts.append(len(times))
        extra = statistics.mean(extras)
        ck.close()

        # restore: checksum verification + DCP load into live model/optimizer/EMA, vs a raw read of the files
        files = sorted((root / "async" / "checkpoints").rglob("*"))
        files = [f for f in files if f.is_file()]
        raws, restores = [], []
        for _ in range(args.repeats):        # alternate, page cache dropped before each; medians reported
            page_cache = drop_cache(root)
            t0 = time.perf_counter()
            n = 0
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    while chunk := fh.read(8 << 20):
                        n += len(chunk)
            raws.append(time.perf_counter() - t0)
            drop_cache(root)
            t0 = time.perf_counter()
            latest = Checkpointer(root / "async").latest()
            Checkpointer.load(latest, model, opt, ema)
            restores.append(time.perf_counter() - t0)
        raw_s, restore_s = statistics.median(raws), statistics.median(restores)

        # resume verification shared by N ranks: each checks every size and the CRC-32s of its share of the pieces
        # (run here one share after another, page cache dropped before each; bench/verify_share.py runs it on
        # real ranks under torchrun)
        from difftrain.train.verification import PIECE, marker_files, share_bytes, verify, verify_shares
        latest = Checkpointer(root / "async").latest(checksums=False)
        marked = marker_files(latest)
        total = sum(int(f["bytes"]) for f in marked.values())
        largest = max(int(f["bytes"]) for f in marked.values())
        shares_out = {}
        for world in (1, 2):
            shares = verify_shares(marked, world)
            secs = []
            for share in shares:
                drop_cache(root)
                t0 = time.perf_counter()
                assert verify(latest, True, set(share)) is None
                secs.append(round(time.perf_counter() - t0, 3))
            shares_out[str(world)] = {
                "verify_bytes_max_rank_over_total": round(max(share_bytes(marked, s) for s in shares) / total, 4),
                "bound": round(1 / world + min(PIECE, largest) / total, 4), "verify_s_by_rank": secs}

    print(json.dumps({
        "state_bytes": state_bytes, "threads": torch.get_num_threads(),
        "step_s": round(t_base, 4), "sync_save_s": round(sync_s, 3),
        "async_stall_s": round(statistics.mean(stalls), 4), "async_window_s": round(statistics.mean(windows), 3),
        "async_window_steps": counts, "async_extra_s": [round(e, 3) for e in extras],
        "async_stall_ratio": round(max(0.0, extra) / sync_s, 4),
        "raw_read_s": round(raw_s, 3), "raw_read_mb_s": round(n / raw_s / 1e6, 1), "restore_s": round(restore_s, 3),
        "restore_vs_raw_read_ratio": round(restore_s / raw_s, 3), "page_cache": page_cache,
        "raw_read_runs_s": [round(x, 3) for x in raws], "restore_runs_s": [round(x, 3) for x in restores],
        "verify_shares": shares_out, "checkpoint_files": len(marked), "largest_file_share": round(largest / total, 4),
    }))


if __name__ == "__main__":
    main()
