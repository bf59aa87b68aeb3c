"""What a Diffusion-DPO step costs over a flow-matching step, per image, on the same model and images.

The same DiT (hidden 384, 4 double and 8 single blocks, ~60M parameters), AdamW, and 2P images a step: the flow
step trains on the 2P images, the DPO step on them as P pairs (winners and losers), with a frozen reference copy
that adds one forward without backward (expected ~4/3 of the flow step's time). Each mode runs in a fresh process;
its peak anonymous memory above the process's baseline after imports is sampled every 2 ms (weights, gradients,
optimizer state, the reference, activations), with glibc told to mmap buffers of 1 MiB and more (see
``MMAP_THRESHOLD``; ``--default-malloc`` not).

Prints one JSON object: per reference (``copy``: a full frozen copy; ``lora``: LoRA adapters (rank 16) trained in
both steps, the reference the DiT with adapters disabled) and precision (``fp32``, and ``bf16``: autocast to
bf16 with a copied reference held in bf16, as on GPUs; on a CPU the forced-bf16 run), ``dpo_step_over_flow_step``
(median step seconds per image, target <= 1.5), ``dpo_peak_over_flow_peak`` (targets <= 1.35 with a copy,
<= 1.05 with LoRA), and the raw figures.

    python bench/dpo_step.py [--pairs 8] [--steps 6] [--hidden 384] [--references copy lora] [--default-malloc]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# glibc keeps freed buffers under its (growing) mmap threshold in its heap, so a process's peak depends on the
# order of its allocations more than on what it holds at once (the reference's forward, freed before the policy's,
# leaves holes the policy's activations do not fit); buffers of 1 MiB and more mmapped are returned when freed,
# as a GPU's caching allocator reuses them. --default-malloc measures without this.
MMAP_THRESHOLD = 1 << 20

WORKER = r"""
import copy, json, os, statistics, sys, threading, time
import torch
from torch import nn
mode, precision, pairs, steps, hidden, reference = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                     int(sys.argv[5]), sys.argv[6])
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
from difftrain.data.batch import assemble
from difftrain.diffusion.flow import FlowSpec
from difftrain.models import build_dit
from difftrain.models.dit import DiTParams
from difftrain.models.text import WordTextEncoder
from difftrain.train.objectives import Denoiser, DiffusionDPO, FlowMatching
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
peak, done = [0], threading.Event()
def watch():
    while not done.wait(0.002):
        peak[0] = max(peak[0], anon())
base = anon()
threading.Thread(target=watch, daemon=True).start()
vocab = ["a", "small", "big", "red", "blue", "green", "circle", "square", "triangle", "in", "the", "top", "left"]
text = WordTextEncoder(vocab, max_tokens=16, dim=64, layers=1)
p = DiTParams(in_channels=64, text_dim=64, pooled_dim=64, hidden=hidden, heads=hidden // 64, double_blocks=4,
              single_blocks=8, axes_dims_rope=(16, 24, 24))
model = nn.ModuleDict({"dit": build_dit(p, init="default", seed=0), "text": text})
if reference == "lora":
    from difftrain.models.lora import adapters_disabled, apply_lora
    apply_lora(model["dit"], 16, 16.0, ["qkv", "proj", "linear1", "linear2", "img_mlp.0", "img_mlp.2", "txt_mlp.0",
                                        "txt_mlp.2"])
    text.requires_grad_(False)
amp = torch.bfloat16 if precision == "bf16" else None
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5, foreach=True)
g = torch.Generator().manual_seed(0)
n = 2 * pairs
lat = torch.randn(n, 1, 16, 32, 32, generator=g)
prompts = ["a small red circle in the top left", "a big blue square"] * pairs
batch = assemble(lat, [0], torch.ones(n, 1, dtype=torch.bool), text.tokenize(prompts), prompts, "t2i")
batch.sample_ids = list(range(pairs)) * 2 if mode == "dpo" else list(range(n))
spec = FlowSpec()
pol = Denoiser(model, text, torch.device("cpu"), amp)
class AdaptersOff:
    def embed_text(self, b):
        return pol.embed_text(b)
    def __call__(self, *a):
        with adapters_disabled(pol.dit):
            return pol(*a)
if mode == "dpo" and reference == "lora":
    batch.pairs = pairs
    obj = DiffusionDPO(spec, 2000.0, AdaptersOff())
elif mode == "dpo":
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if precision == "bf16":
        ref.to(torch.bfloat16)
    batch.pairs = pairs
    obj = DiffusionDPO(spec, 2000.0, Denoiser(ref, ref["text"], torch.device("cpu"), amp))
else:
    obj = FlowMatching(spec)
norm = obj.count(batch)
times = []
for step in range(steps):
    t0 = time.perf_counter()
    micro = obj.loss(pol, batch, 0, step, norm)
    micro.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
done.set()
print(json.dumps({"mode": mode, "precision": precision, "reference": reference, "params": sum(x.numel() for x in model.parameters()),
                  "images": n, "step_s": statistics.median(times[1:]), "peak_growth": peak[0] - base}))
"""


def run(mode: str, precision: str, reference: str, args) -> dict:
    env = dict(os.environ)
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    out = subprocess.run([sys.executable, "-c", WORKER, mode, precision, str(args.pairs), str(args.steps),
                          str(args.hidden), reference], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="pairs a step (the flow step trains on twice as many images)")
    ap.add_argument("--steps", type=int, default=6, help="steps timed (the first is a warm-up)")
    ap.add_argument("--hidden", type=int, default=384, help="model width (a multiple of 64)")
    ap.add_argument("--default-malloc", action="store_true", help="glibc's default malloc (see MMAP_THRESHOLD)")
    ap.add_argument("--references", nargs="+", default=["copy", "lora"], choices=("copy", "lora"))
    args = ap.parse_args()
    out: dict = {"pairs": args.pairs, "images_per_step": 2 * args.pairs,
                 "malloc_mmap_threshold": None if args.default_malloc else MMAP_THRESHOLD}
    for reference in args.references:
        for precision in ("fp32", "bf16"):
            flow, dpo = run("flow", precision, reference, args), run("dpo", precision, reference, args)
            out[f"{reference}_{precision}"] = {
                "flow": flow, "dpo": dpo, "dpo_step_over_flow_step": round(dpo["step_s"] / flow["step_s"], 3),
                "dpo_peak_over_flow_peak": round(dpo["peak_growth"] / flow["peak_growth"], 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
