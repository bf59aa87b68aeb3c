"""The cost of planning a step's sample ids, over stream sizes: ``Stream.take`` of a global batch (2048 ids by
default) for 2,000 consecutive steps of streams of 10^5 to 10^9 ids (the ids themselves are not held: the
epoch order is computed for the positions taken). Prints one JSON object: per size, p50 and max milliseconds
per step, and the growth of p50 from the smallest size to the largest. Not yet ``bench/loader_scale.py``,
which is to time a real StoreLoader over Lance index tables.

    python bench/plan_cost.py [--batch 2048] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from difftrain.data.store_loader import _h64, keyed_order


def plan_ms(n: int, batch: int, steps: int, seed: int = 0) -> list[float]:
    key_base = [seed, 303, 0, _h64(f"stage/bucket/t2i/s{n}")]
    epoch, pos, out = 0, (n - batch * (steps // 2)) % n, []     # an epoch boundary half way (or more often)
    for _ in range(steps):
        t0 = time.perf_counter()
        taken = 0
        while taken < batch:
            k = min(batch - taken, n - pos)
            keyed_order(n, key_base + [epoch], np.arange(pos, pos + k))
            taken, pos = taken + k, pos + k
            if pos == n:
                epoch, pos = epoch + 1, 0
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    sizes = [10**5, 10**6, 10**7, 10**8, 10**9]
    res = {}
    for n in sizes:
        ms = plan_ms(n, args.batch, args.steps)
        res[f"{n:.0e}"] = {"plan_ms_p50": round(float(np.median(ms)), 3), "plan_ms_max": round(max(ms), 3)}
    first, last = res[f"{sizes[0]:.0e}"]["plan_ms_p50"], res[f"{sizes[-1]:.0e}"]["plan_ms_p50"]
    print(json.dumps({"batch": args.batch, "steps": args.steps, "sizes": res,
                      "plan_growth_1e9_over_1e5": round(last / first, 3)}))


if __name__ == "__main__":
    main()
