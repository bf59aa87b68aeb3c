"""Does every config that ``difftrain config show`` accepts train? Hypothesis draws configs from the knobs that
decide what a run builds, on top of the tiny shapes preset (tiny widths: seconds a draw), and for each one:

1. ``difftrain config show`` (in-process): a refusal here is fine (``refused_at_config``);
2. accepted: ``difftrain train`` for ``--steps`` steps (in-process on one rank; ``parallel.cp = 2`` under torchrun on
   two CPU ranks). Any refusal or crash now is a failure: a combination the schema should have refused, or a bug.

The knobs: model.double_blocks / single_blocks (one of them may be 0), guidance_embed, hidden/heads (24/2, 32/2,
64/4: 24 is no multiple of 16), parallel.cp 1 or 2, train.ema_decay 0 or 0.9, train.optimizer adamw/muon,
train.global_batch / micro_batch (accumulation), train.fp8, adapter.kind none/lora/lokr with adapter.base_precision
bf16/fp8/nf4 and adapter.export, model.init_from (a base of the drawn architecture, trained once for 1 step and
exported, or none), parallel.cpu_offload, and a DPO section (``dpo.init`` set: a DPO config; config show only, its
training needs a pairs file). ``train.compile`` stays false (compiling is minutes on a CPU) and ``data.source`` shapes.

Failures are shrunk by Hypothesis, one per distinct error (its first line, numbers dropped). Prints one JSON object:
draws (every example run, the shrinking's included), accepted, refused_at_config, trained, config_only (accepted
DPO configs, not trained), refused_by_device (refusals that depend on the machine or the launch, e.g.
parallel.cpu_offload without a GPU: not failures, listed in device_refusals), failures (each the shrunk ``--set``
items and the error), wall_s.

    python bench/config_space.py [--draws 200] [--seed 0] [--steps 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.image_size=32", "data.frames=3", "data.world_size=64", "text.dim=16", "text.max_tokens=16",
        "train.minutes=0", "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=0",
        "train.sample_every=0", "train.threads=1", "sample.steps=2", "eval.n=4", "autoencoder.factor=4"]
# refusals that depend on the machine or the launch, not on the config: what this CPU-only bench cannot tell apart
DEVICE = re.compile(r"this run has no GPU|needs CUDA|compute capability|more than one process|world size|"
                    r"cannot quantize and run a layer on")
WIDTHS = {24: (2, "[4, 4, 4]"), 32: (2, "[4, 6, 6]"), 64: (4, "[4, 6, 6]")}       # hidden -> heads, RoPE axes


@st.composite
def configs(draw) -> dict:
    """One draw: the ``--set`` items by key (the base, when drawn, is named by its architecture: ``base``). The
    choices are weighted (repeated) towards configs that are accepted, so that most draws train."""
    hidden = draw(st.sampled_from(sorted(WIDTHS)))
    heads, axes = WIDTHS[hidden]
    blocks = draw(st.sampled_from([(1, 1), (1, 0), (0, 1), (2, 1)]))
    micro = draw(st.sampled_from([0, 1, 2]))
    c = {"model.hidden": hidden, "model.heads": heads, "model.axes_dims_rope": axes,
         "model.double_blocks": blocks[0], "model.single_blocks": blocks[1],
         "model.guidance_embed": draw(st.booleans()),
         # one draw in four on two context-parallel ranks (each such draw costs a torchrun launch)
         "parallel.cp": draw(st.sampled_from([1, 1, 1, 2])),
         "parallel.cpu_offload": draw(st.sampled_from([False] * 7 + [True])),
         "train.ema_decay": draw(st.sampled_from([0.0, 0.9])),
         "train.optimizer": draw(st.sampled_from(["adamw", "muon"])),
         "train.global_batch": draw(st.sampled_from([4, 2, 6])),
         "train.micro_batch": micro,
         "train.fp8": draw(st.sampled_from(["none", "none", "tensorwise", "rowwise"])),
         "adapter.kind": draw(st.sampled_from(["none", "lora", "lokr"])),
         "adapter.base_precision": draw(st.sampled_from(["bf16", "bf16", "bf16", "fp8", "nf4"])),
         "adapter.export": draw(st.sampled_from(["adapter", "merge"])),
         "base": draw(st.sampled_from([True, True, True, False]))}
    if draw(st.integers(0, 3)) == 3:                      # one draw in four a DPO config
        c.update({"dpo.init": "base", "dpo.reference": draw(st.sampled_from(["copy", "lora"])),
                  "dpo.replay_weight": draw(st.sampled_from([0.0, 1.0]))})
    return c


def quiet_main(args: list[str]) -> tuple[int, str]:
    """``difftrain`` in this process: its exit code and stderr (an exception is a crash: code -1, its line)."""
    from difftrain.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(args)
    except BaseException as e:             # noqa: BLE001 - a crash is what this bench looks for
        return -1, f"{type(e).__name__}: {e}"
    return rc, err.getvalue()


def value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def error_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.startswith("error:")] or text.strip().splitlines()[-1:] or ["?"]
    return re.sub(r"/\S+", "PATH", lines[-1])[:400]


class Bench:
    def __init__(self, root: Path, steps: int):
        self.root, self.steps, self.bases = root, steps, {}
        self.counts = {"draws": 0, "accepted": 0, "refused_at_config": 0, "trained": 0, "config_only": 0,
                       "refused_by_device": 0}
        self.device_refusals: set[str] = set()
        self.failures: dict[str, dict] = {}
        self.kinds: dict[str, type] = {}

    def base(self, c: dict) -> str:
        """A base of the drawn architecture: one step of a plain run, exported (cached by architecture)."""
        arch = tuple(c[k] for k in ("model.hidden", "model.double_blocks", "model.single_blocks",
                                    "model.guidance_embed"))
        if arch not in self.bases:
            run = self.root / ("base_" + "_".join(map(str, arch)))
            sets = TINY + [f"{k}={value(c[k])}" for k in c if k.startswith("model.")] + ["train.steps=1",
                                                                                  "train.global_batch=2"]
            rc, err = quiet_main(["train", "shapes-tiny", "--run-dir", str(run), "--no-progress",
                                  *[f"--set={s}" for s in sets]])
            if rc != 0:
                raise RuntimeError(f"the base {arch} did not train: {error_line(err)}")
            self.bases[arch] = str(run / "export")
        return self.bases[arch]

    def sets(self, c: dict) -> list[str]:
        out = list(TINY)
        for k, v in c.items():
            if k == "base":
                continue
            v = str(Path(self.base(c)).parent) if v == "base" else v      # dpo.init: the base's run
            out.append(f"{k}={value(v)}")
        if c["base"]:
            out.append(f"model.init_from={self.base(c)}")
        return out

    def fail(self, c: dict, sets: list[str], where: str, err: str) -> None:
        line = error_line(err)
        sig = re.sub(r"\d+(\.\d+)?", "N", line)[:160]
        self.failures[sig] = {"config": {k: v for k, v in c.items()}, "set": sets[len(TINY):], "at": where,
                              "error": line}
        # one exception class per distinct error: Hypothesis shrinks each one apart
        if sig not in self.kinds:
            self.kinds[sig] = type(f"Refused{len(self.kinds)}", (AssertionError,), {})
        raise self.kinds[sig](f"{where}: {line}")

    def check(self, c: dict) -> None:
        self.counts["draws"] += 1
        sets = self.sets(c)
        cfg = self.root / "draw.toml"
        cfg.write_text('extends = "shapes-tiny"\n')
        rc, err = quiet_main(["config", "show", str(cfg), *[f"--set={s}" for s in sets]])
        if rc == 2:
            self.counts["refused_at_config"] += 1
            return
        if rc != 0:
            self.fail(c, sets, "config show", err)
        self.counts["accepted"] += 1
        if c.get("dpo.init"):
            self.counts["config_only"] += 1
            return
        run = Path(tempfile.mkdtemp(dir=self.root))
        args = ["train", str(cfg), "--run-dir", str(run), "--no-progress",
                *[f"--set={s}" for s in sets + [f"train.steps={self.steps}"]]]
        if c["parallel.cp"] == 1:
            rc, err = quiet_main(args)
        else:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={c['parallel.cp']}", "-m", "difftrain", *args],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            rc, err = proc.returncode, proc.stderr
        if rc != 0 and DEVICE.search(err):
            self.counts["refused_by_device"] += 1
            self.device_refusals.add(re.sub(r"\d+(\.\d+)?", "N", error_line(err))[:200])
            return
        if rc != 0:
            self.fail(c, sets, "train", err)
        self.counts["trained"] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=200, help="Hypothesis examples (default 200)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed (the same seed draws the same configs)")
    p.add_argument("--steps", type=int, default=1, help="training steps of each accepted config (default 1)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()

    import torch
    torch.set_num_threads(1)
    logging_off()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="config_space_") as tmp:
        bench = Bench(Path(tmp), args.steps)

        @settings(max_examples=args.draws, deadline=None, database=None, print_blob=False,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(configs())
        def prop(c):
            bench.check(c)

        from hypothesis import seed as hseed
        try:
            hseed(args.seed)(prop)()
        except BaseException as e:         # noqa: BLE001 - the failures are collected by Bench.fail
            if not bench.failures:
                bench.failures["bench"] = {"error": f"{type(e).__name__}: {e}"}
        out = {**bench.counts, "device_refusals": sorted(bench.device_refusals),
               "failures": list(bench.failures.values()), "seed": args.seed, "steps": args.steps,
               "wall_s": round(time.perf_counter() - t0, 1)}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def logging_off() -> None:
    import logging
    import warnings
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    main()
