"""GPU checks of training, kernels and precision, for one H200 (or any CUDA GPU), in under 8 minutes.

Writes one JSON object (stdout and ``--out``):
- ``matmul_tflops``: bf16 TFLOP/s of a large GEMM on this GPU: the practical ceiling;
- ``mfu`` / ``step_s`` / ``tflops_per_gpu``: a training step (forward, backward, AdamW) of a ~2B-parameter MMDiT
  at 1024² (4,096 image tokens + 512 text tokens per sample) in bf16 autocast with per-block torch.compile and
  no activation checkpointing; MFU against the dense bf16 peak table (H100/H200 989 TFLOP/s), FLOPs from
  ``parallel.flops`` (real tokens, matmuls + attention, forward + backward);
- ``mfu_full_ac`` (and its step time, peak memory): the same with full activation checkpointing, to show the
  trade-off the planner reports;
- ``planner_error``: (planner estimate - ``torch.cuda.max_memory_allocated``) / measured for the no-AC run;
- ``trainer_step_s``: the same size of model through ``Trainer.train_step``, what ``difftrain train`` runs (FSDP2,
  EMA, per-sample generators, reductions), and ``host_syncs_in_a_step`` (one step under
  ``torch.cuda.set_sync_debug_mode("warn")``; two are listed in docs/distributed.md; "not run" on a CPU);
- ``attention_table``, ``hybrid_speedup``: the attention autotuner on FLUX-sized shapes in bf16 (each eligible
  backend checked against the math kernel, then timed forward and backward; docs/kernels.md);
- ``blocking_save_*``: ``difftrain train`` with ``train.async_checkpoint = false`` (the writer copies the live device
  shards to the host itself), loaded by a fresh ``difftrain sample`` and resumed;
- ``tuned_calls``: a compiled ``difftrain train`` run with ``attention.backend = 'auto'``: its forward attention
  calls on a tuned kernel and on the fallback (the trainer's count from its batches' shapes) against the kernel's
  own eager count (0 where compiled graphs run), and the shapes the tuner missed (none expected);
- ``fp8_train_speedup``, ``fp8_train_loss_delta``: the no-AC step with train.fp8 = tensorwise against bf16, from the
  same weights on the same batch;
- ``quant_sample_speedup_fp8`` and ``quant_rel_error_<fmt>`` (fp8, mxfp8, nvfp4, with their mode): ``sample
  --quant``'s model against bf16 on one forward;
- ``fp8_encoder_cosine``, ``fp8_encoder_memory_saved`` and ms per batch size: text.precision = 'fp8' on a T5 of
  T5-XXL's widths with activation outliers (``bench/fp8_encoder.py``; "not run" without transformers);
- ``dpo_*``: the Diffusion-DPO objective from host batches on the device (a bf16 reference, autocast, the SFT and
  replay terms, the replay samples moved with the pair batch): the first loss, the replay term, gradients.

torchao (the float8/MX/NVFP4 parts) is imported from the machine's Python, else from the wheel ``gpu_suite.sh``
installs out of ``bench/wheels/`` (docs/kernels.md: how to put it there); without it those figures say "not run".

Needs only torch (the GPU machine's preinstalled one) and ``PYTHONPATH=src``; no diffusers, no downloads.
``--smoke`` runs the same code on the CPU with a tiny model and no compilation (a test runs it, so the script
is known to work before it reaches a GPU).

    PYTHONPATH=src python bench/gpu_suite.py [--out gpu_suite.json] [--batch 2] [--steps 8] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from difftrain.models import build_dit
from difftrain.models.dit import DiTParams, num_params
from difftrain.tokens import image_ids
from difftrain.parallel.ac import apply_ac
from difftrain.parallel.compile import compile_blocks
from difftrain.parallel.flops import peak_flops, step_flops

# ~2.2B parameters, FLUX's head size and RoPE layout; 1024^2 images (4,096 tokens) + 512 text tokens.
PARAMS = DiTParams(in_channels=64, text_dim=4096, pooled_dim=768, hidden=2048, heads=16, double_blocks=8,
                   single_blocks=16, axes_dims_rope=(16, 56, 56), guidance_embed=False)
IMG, TXT = 4096, 512
SMOKE = DiTParams(in_channels=16, text_dim=32, pooled_dim=16, hidden=64, heads=4, double_blocks=1, single_blocks=1,
                  axes_dims_rope=(4, 6, 6)), 64, 8
DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def batch(B: int):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    side = int(IMG ** 0.5)
    return dict(img_BLC=torch.randn(B, IMG, PARAMS.in_channels, device=DEVICE, generator=g),
                img_ids_BL3=image_ids(side, side, device=DEVICE)[None].expand(B, -1, -1),
                txt_BTD=torch.randn(B, TXT, PARAMS.text_dim, device=DEVICE, generator=g),
                t_B=torch.rand(B, device=DEVICE, generator=g),
                pooled_BP=torch.randn(B, PARAMS.pooled_dim, device=DEVICE, generator=g))


def train_run(ac: str, B: int, steps: int, warmup: int, compile: bool = True, fp8: str = "none") -> dict:
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)                          # every run starts from the same weights (the fp8 loss delta)
    dit = build_dit(PARAMS, device=DEVICE)
    fp8_layers = []
    if fp8 != "none":
        from difftrain.parallel.fp8 import apply_fp8
        fp8_layers = apply_fp8(dit, fp8, DEVICE)
    apply_ac(dit, ac)
    if compile:
        compile_blocks(dit)
    opt = torch.optim.AdamW(dit.parameters(), lr=1e-5, fused=cuda, foreach=not cuda)
    x = batch(B)
    target = torch.randn(B, IMG, PARAMS.in_channels, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    losses = []

    def step():
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            out = dit(**x)
        loss = (out.float() - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_s = (time.perf_counter() - t0) / steps
    flops = step_flops(PARAMS, [(IMG, TXT)] * B)
    peak, source = peak_flops(DEVICE, torch.bfloat16 if cuda else torch.float32)
    result = {"ac": ac, "batch": B, "step_s": round(step_s, 4), "tflops_per_gpu": round(flops / step_s / 1e12, 1),
              "mfu": round(flops / step_s / peak, 4), "peak": source, "warmup_with_compile_s": round(compile_s, 1),
              "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
              "losses": [round(float(v), 5) for v in losses], "fp8_layers": len(fp8_layers)}
    del dit, opt, x
    gc.collect()
    torch._dynamo.reset()
    return result


def trainer_run(steps: int, warmup: int, smoke: bool) -> dict:
    """The step ``difftrain train`` runs, not a bare loop: ``Trainer.train_step`` (the model as the config
    builds and wraps it, FSDP2 on one rank, bf16 autocast, per-sample noise and timesteps, the loss
    normalizer, gradient clipping, the step's reductions, AdamW and EMA) on one global batch the shapes
    source served, reused. On a GPU, one more step under ``torch.cuda.set_sync_debug_mode("warn")`` counts
    the host syncs it makes (docs/distributed.md lists two)."""
    import tempfile
    import warnings

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    sets = ["train.threads=0", "train.checkpoint_every=0", "train.global_batch=2", "train.ema_decay=0.999"]
    if not smoke:                      # ~2.2B parameters at 1024^2 (4,096 image tokens), compiled blocks
        sets += ["model.hidden=2048", "model.heads=16", "model.double_blocks=8", "model.single_blocks=16",
                 "model.axes_dims_rope=[16, 56, 56]", "data.image_size=1024", "train.compile=true",
                 "data.t2i_weight=1.0", "data.edit_weight=0.0", "data.keyframe_weight=0.0"]
    with tempfile.TemporaryDirectory() as run_dir:
        tr = build_trainer(load_config(preset_path("shapes-tiny"), sets), run_dir)
        try:
            batches = next(tr.loader)
            t0 = time.perf_counter()
            for _ in range(warmup):
                tr.train_step(batches)
            sync()
            warm_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(steps):
                tr.train_step(batches)
            sync()
            step_s = (time.perf_counter() - t0) / steps
            out = {"trainer_step_s": round(step_s, 4), "trainer_warmup_s": round(warm_s, 1),
                   "trainer_params": num_params(tr.dit), "trainer_img_tokens": batches[0].x0_BLC.shape[1]}
            if DEVICE.type == "cuda":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        tr.train_step(batches)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message)]
                out.update(host_syncs_in_a_step=len(syncs), host_sync_messages=syncs[:8])
            else:
                out["host_syncs_in_a_step"] = "not run (no CUDA device)"
        finally:
            tr.close()
    return out


def demo_prefetch(smoke: bool) -> dict:
    """The demo's trainer (``shapes-tiny``) on the device, ``fit`` as ``difftrain demo`` runs it: the next step built in
    a thread during the backward pass (what the trainer does off a CPU: ``demo_built_ahead_by_trainer``) against built
    when asked. The batches are the same, so the weights after the same steps must agree
    (``demo_weights_max_abs_diff``); the seconds a step of each, after 10 warm-up steps."""
    import tempfile

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    steps = 12 if smoke else 150
    sets = ["train.threads=0", "train.checkpoint_every=0", f"train.steps={steps}", "train.log_every=100000"]
    out, weights = {}, {}
    for ahead in (False, True):
        with tempfile.TemporaryDirectory() as run_dir:
            tr = build_trainer(load_config(preset_path("shapes-tiny"), sets), run_dir)
            try:
                if ahead:
                    out["demo_built_ahead_by_trainer"] = tr.prefetch is not None
                tr.prefetch = tr.loader.prefetch if ahead else None
                marks: dict[int, float] = {}

                def mark(step, total, stats):
                    if step in (10, total):
                        sync()
                        marks[step] = time.perf_counter()

                tr.fit(on_step=mark)
                name = "built_ahead" if ahead else "built_when_asked"
                out[f"demo_step_s_{name}"] = round((marks[steps] - marks[10]) / (steps - 10), 4)
                weights[ahead] = {k: v.detach().float().cpu() for k, v in tr.ema.state_dict().items()}
            finally:
                tr.close()
    out["demo_weights_max_abs_diff"] = max((weights[True][k] - weights[False][k]).abs().max().item()
                                           for k in weights[False])
    return out


def muon_run(steps: int, smoke: bool) -> dict:
    """``train.optimizer = "muon"`` on the device. The Newton-Schulz iteration runs in bf16 on an accelerator (fp32
    on a CPU): its singular values on a block-sized matrix (FLUX's MLP, 3072 x 12288; 256 x 1024 in smoke) and its
    distance from the fp32 iteration; then ``Trainer.train_step`` with Muon and with AdamW on one batch of the same
    model (FSDP2 on one rank, bf16 autocast): the step and optimizer times and whether the losses fall, and how many
    matrices the optimizer orthogonalised as an owner rank (the exchange needs 2+ ranks: 0 here) and whole."""
    import tempfile

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer
    from difftrain.train.muon import orthogonalize

    rows = 256 if smoke else 3072
    g = torch.randn(rows, 4 * rows, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    low = orthogonalize(g)                          # the device's own dtype: bf16 on a GPU
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        orthogonalize(g)
    sync()
    ns_s = (time.perf_counter() - t0) / 3
    full = orthogonalize(g, dtype=torch.float32)
    sv = torch.linalg.svdvals(low.float())
    out = {"muon_ns_dtype": "bfloat16" if DEVICE.type == "cuda" else "float32", "muon_ns_ms": round(ns_s * 1e3, 2),
           "muon_ns_sv_min": round(float(sv.min()), 3), "muon_ns_sv_max": round(float(sv.max()), 3),
           "muon_ns_rel_to_fp32": round(float((low.float() - full).norm() / full.norm()), 4)}
    sets = ["train.threads=0", "train.checkpoint_every=0", "train.global_batch=4", "train.ema_decay=0",
            "train.lr=1e-3", "train.warmup_steps=1"]
    if not smoke:                      # ~0.6B parameters at 512^2
        sets += ["model.hidden=1536", "model.heads=12", "model.double_blocks=4", "model.single_blocks=8",
                 "model.axes_dims_rope=[16, 56, 56]", "data.image_size=512",
                 "data.t2i_weight=1.0", "data.edit_weight=0.0", "data.keyframe_weight=0.0"]
    for opt in ("adamw", "muon"):
        with tempfile.TemporaryDirectory() as run_dir:
            tr = build_trainer(load_config(preset_path("shapes-tiny"), sets + [f"train.optimizer={opt}"]), run_dir)
            try:
                batches = next(tr.loader)
                losses, optim = [], []
                tr.train_step(batches)               # warm-up
                sync()
                t0 = time.perf_counter()
                for _ in range(steps + 2):
                    st = tr.train_step(batches)
                    losses.append(st.loss)
                    optim.append(st.optim_s)
                sync()
                out[f"muon_trainer_{opt}_step_s"] = round((time.perf_counter() - t0) / (steps + 2), 4)
                out[f"muon_trainer_{opt}_optim_s"] = round(sum(optim) / len(optim), 4)
                out[f"muon_trainer_{opt}_losses"] = [round(x, 5) for x in losses]
                if opt == "muon":            # one rank: plain tensors, so the whole-matrix path, not the owner one
                    out["muon_trainer_owned_matrices"] = tr.optimizer.owned_orthogonalized
                    out["muon_trainer_whole_matrices"] = tr.optimizer.whole_orthogonalized
            finally:
                tr.close()
    out["muon_trainer_loss_falls"] = out["muon_trainer_muon_losses"][-1] < out["muon_trainer_muon_losses"][0]
    return out


def dpo_objective(smoke: bool) -> dict:
    """The Diffusion-DPO objective on the device from host batches, as ``difftrain dpo`` calls it: a policy and a
    frozen bf16 copy as reference (the trainer's reference on a GPU), bf16 autocast, winners and losers sharing t and
    noise, the SFT and replay terms; the pair batch and the replay samples it carries (``dpo.replay_weight``) start on
    the host and reach the device in one move. Checks: the pair loss alone is log 2 at the start (policy = reference,
    up to the reference's bf16), the replay term adds a positive amount, the gradient reaches the policy and not the
    reference, a step moves the loss."""
    import copy

    from difftrain.data.batch import assemble
    from difftrain.diffusion.flow import FlowSpec
    from difftrain.models.text import WordTextEncoder
    from difftrain.train.objectives import Denoiser, DiffusionDPO

    vocab = ["a", "small", "big", "red", "blue", "circle", "square"]
    prompts = ["a small red circle", "a big blue square", "a red square", "a blue circle"]
    torch.manual_seed(0)
    size = 8 if smoke else 64                      # latents' side: 64 is 1024^2 pixels at FLUX's factor 16 with 2x2
    p = DiTParams(in_channels=16, text_dim=32, pooled_dim=32, hidden=64 if smoke else 1024, heads=4 if smoke else 8,
                  double_blocks=1 if smoke else 2, single_blocks=1 if smoke else 4,
                  axes_dims_rope=(4, 6, 6) if smoke else (16, 56, 56))
    text = WordTextEncoder(vocab, max_tokens=8, dim=32, layers=1)
    policy = torch.nn.ModuleDict({"dit": build_dit(p, init="default", seed=0), "text": text}).to(DEVICE)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if DEVICE.type == "cuda":
        reference.to(torch.bfloat16)
    amp = torch.bfloat16 if DEVICE.type == "cuda" else None
    pol = Denoiser(policy, policy["text"], DEVICE, amp)
    ref = Denoiser(reference, reference["text"], DEVICE, amp)
    obj = DiffusionDPO(FlowSpec(timesteps="uniform"), 2000.0, ref, sft_weight=300.0, replay_weight=300.0)
    plain = DiffusionDPO(FlowSpec(timesteps="uniform"), 2000.0, ref, sft_weight=300.0)
    bare = DiffusionDPO(FlowSpec(timesteps="uniform"), 2000.0, ref)
    g = torch.Generator().manual_seed(1)

    def host_batch(rows: int, pairs: int, ids: list[int]):
        lat = torch.randn(rows, 1, 4, size, size, generator=g)
        ps = (prompts * rows)[:rows]
        b = assemble(lat, [0], torch.ones(rows, 1, dtype=torch.bool), text.tokenize(ps), ps, "t2i")
        b.sample_ids, b.pairs = ids, pairs
        return b

    b = host_batch(4, 2, [100, 101, 100, 101])
    b.replay = host_batch(2, 0, [7, 8])
    assert b.x0_BLC.device.type == "cpu" and b.replay.x0_BLC.device.type == "cpu"
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    with torch.no_grad():
        pair_only = float(bare.loss(pol, b, 0, 0, 2.0).loss)
        without = float(plain.loss(pol, b, 0, 0, 2.0).loss)
    first = obj.loss(pol, b, 0, 0, 2.0)
    first.loss.backward()
    grads = [q.grad for q in policy.parameters() if q.requires_grad]
    out = {"dpo_pair_loss_at_start": round(pair_only, 5), "dpo_first_loss": round(float(first.loss.detach()), 5),
           "dpo_replay_term": round(float(first.loss.detach()) - without, 6),
           "dpo_policy_grad": all(x is not None for x in grads) and float(sum(x.norm() for x in grads)) > 0,
           "dpo_reference_grad_free": all(q.grad is None for q in reference.parameters()),
           "dpo_reference_dtype": str(next(reference.parameters()).dtype).replace("torch.", "")}
    opt.step()
    opt.zero_grad(set_to_none=True)
    after = obj.loss(pol, b, 0, 0, 2.0)
    out["dpo_loss_moves"] = abs(float(after.loss.detach()) - float(first.loss.detach())) > 0
    return out


def blocking_save(smoke: bool) -> dict:
    """The save path only a GPU takes: ``difftrain train`` with ``train.async_checkpoint = false`` (no stager: the
    writer gets the live device shards and must copy them to the host itself), then ``difftrain sample`` loading
    that checkpoint in a fresh process, then the same run resumed for two more steps. Each is its own process, as
    a job would run them."""
    import subprocess
    import tempfile

    steps = 2 if smoke else 6
    sets = ["--set", "train.async_checkpoint=false", "--set", f"train.checkpoint_every={steps // 2}",
            "--set", "train.threads=0", "--set", "train.sample_every=0"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out: dict = {}
    with tempfile.TemporaryDirectory() as run:
        def cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        t0 = time.perf_counter()
        r = cli("train", "shapes-tiny", "--run-dir", run, "--set", f"train.steps={steps}", *sets)
        out["blocking_save_s"] = round(time.perf_counter() - t0, 1)
        def saved(step: int) -> bool:
            return any(int(p.name.split("_")[1]) == step for p in (Path(run) / "checkpoints").glob("step_*")
                       if p.is_dir() and p.name.split("_")[1].isdigit())
        out["blocking_save_ok"] = r.returncode == 0 and saved(steps)
        if not out["blocking_save_ok"]:
            out["blocking_save_log"] = (r.stderr or r.stdout)[-800:]
            return out
        r = cli("sample", run, "--prompt", "a large red circle in the top left", "--num-images", "1", "--steps", "2")
        out["blocking_save_loads_in_a_fresh_process"] = r.returncode == 0
        if r.returncode:
            out["blocking_save_load_log"] = r.stderr[-800:]
        r = cli("train", "shapes-tiny", "--run-dir", run, "--set", f"train.steps={steps + 2}", *sets)
        events = (Path(run) / "events.jsonl").read_text().splitlines() if (Path(run) / "events.jsonl").exists() else []
        resumed = (any(json.loads(e).get("kind") == "resume" and json.loads(e).get("step") == steps for e in events)
                   and saved(steps + 2))
        out["blocking_save_resumes"] = r.returncode == 0 and resumed
        if not out["blocking_save_resumes"]:
            out["blocking_save_resume_log"] = r.stderr[-800:]
    return out


def tuned_calls(smoke: bool) -> dict:
    """``difftrain train`` with ``attention.backend = 'auto'`` and compiled blocks in bf16: the tuner's table, then
    the run's forward attention calls on a tuned kernel and on the fallback as the trainer counts them (from its
    batches' shapes: under torch.compile the kernel itself cannot count), and the kernel's own eager count."""
    import tempfile

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    sets = ["attention.backend=auto", "train.threads=0", "train.checkpoint_every=0", "train.steps=3",
            "train.sample_every=0", f"train.compile={'false' if smoke else 'true'}"]
    with tempfile.TemporaryDirectory() as run_dir:
        tr = build_trainer(load_config(preset_path("shapes-tiny"), sets), run_dir)
        try:
            summary = tr.fit()
            kernel = tr.attention_kernel
            return {"tuned_calls": summary["attention_calls"], "tuned_calls_eager_count": dict(kernel.calls),
                    "tuned_shapes": len(kernel.table), "tuned_shapes_missed": sorted(tr.attention_missing)}
        finally:
            tr.close()


def planner_error(B: int, measured_bytes: int | None) -> dict:
    """The planner's per-GPU total for this model and shape on 1 GPU against the measured peak (None on a
    CPU, where there is no allocator peak to compare with)."""
    from difftrain.parallel.planner import estimate_single_gpu

    est = estimate_single_gpu(PARAMS, img_tokens=IMG, txt_tokens=TXT, micro_batch=B, ac="none")
    out = {"planner_estimate_gb": round(est / 2**30, 3)}
    if measured_bytes:
        out["planner_error"] = round((est - measured_bytes) / measured_bytes, 4)
    return out


def attention_table(smoke: bool) -> dict:
    """The attention autotuner on diffusion shapes (FLUX's 24 heads of 128 at 512^2, 1024^2 and 2048^2 with 512 text
    tokens, masked and not), bf16, forward and backward: each eligible backend's ms, the winner, and the hybrid's
    speed-up over the best single backend and over SDPA's own choice."""
    from difftrain.models.kernels import Shape
    from difftrain.parallel.tune import summary, tune

    if smoke:
        shapes = [Shape(1, 2, n, 16, "fp32", m) for n in (24, 40) for m in (False, True)]
    else:
        shapes = [Shape(1, 24, img + 512, 128, "bf16", m) for img in (1024, 4096, 16384) for m in (False, True)]
    results = tune(shapes, DEVICE, True, None, reps=2 if smoke else 5)
    s = summary(results)
    return {"attention_table": {k: {"winner": r["winner"], "ms": r["ms"]} for k, r in results.items()},
            "hybrid_speedup": s["hybrid_speedup_over_best_single"], "hybrid_speedup_over_sdpa": s["hybrid_speedup_over_sdpa"]}


def fp8_train(bf16: dict, B: int, steps: int, warmup: int, smoke: bool) -> dict:
    """train.fp8 = tensorwise (the blocks' linears in float8, as ``difftrain train`` converts them) on the model,
    batch and initial weights of the bf16 no-AC run: ``fp8_train_speedup`` (bf16 step time / fp8's) and
    ``fp8_train_loss_delta`` (mean |loss_fp8 - loss_bf16| / mean loss_bf16 over the same steps)."""
    r = train_run("none", B, steps, warmup, compile=not smoke, fp8="tensorwise")
    a, b = bf16["losses"], r["losses"]
    return {"fp8_train_step_s": r["step_s"], "fp8_train_speedup": round(bf16["step_s"] / r["step_s"], 3),
            "fp8_train_loss_delta": round(sum(abs(x - y) for x, y in zip(a, b)) / sum(a), 4),
            "fp8_train_losses": b, "fp8_train_layers": r["fp8_layers"], "fp8_train_warmup_with_compile_s": r["warmup_with_compile_s"]}


def quant_sample(smoke: bool, reps: int) -> dict:
    """``sample --quant``'s model (``models.quant.quantize_dit``) against bf16 on one 1024^2 forward (B = 1, 512
    text tokens), eager (no compilation: it fits the suite's time): ``quant_sample_speedup_fp8`` (bf16 ms / fp8 ms; fp8 is native from sm89) and,
    for every format, ``quant_rel_error_<fmt>`` (|out - out_bf16| / |out_bf16|; mxfp8 and nvfp4 are emulated
    before sm100) and its mode."""
    import copy

    from difftrain.models.quant import FORMATS, quantize_dit

    torch.manual_seed(0)
    base = build_dit(PARAMS, device=DEVICE).eval().requires_grad_(False)
    for p in base.parameters():                   # zero-initialised layers (the final one) would output zeros
        if not p.any():
            p.normal_(0, 0.02)
    base.to(torch.bfloat16)
    x = batch(1)

    def timed(model) -> tuple[torch.Tensor, float]:
        with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            for _ in range(2):
                out = model(**x)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                model(**x)
            sync()
        return out.float(), (time.perf_counter() - t0) / reps * 1e3

    ref, ms = timed(copy.deepcopy(base))
    result: dict = {"quant_sample_ms_bf16": round(ms, 2)}
    for fmt in FORMATS:
        model = copy.deepcopy(base)
        info = quantize_dit(model, fmt, DEVICE)
        out, ms = timed(model)
        result[f"quant_rel_error_{fmt}"] = round(float((out - ref).norm() / ref.norm()), 5)
        result[f"quant_mode_{fmt}"] = info["mode"]
        result[f"quant_sample_ms_{fmt}"] = round(ms, 2)
        del model
    result["quant_sample_speedup_fp8"] = round(result["quant_sample_ms_bf16"] / result["quant_sample_ms_fp8"], 3)
    return result


def fp8_encoder(smoke: bool) -> dict:
    """``bench/fp8_encoder.py`` on this device: a T5 v1.1 of T5-XXL's widths (2 layers; 1 tiny layer with
    --smoke) with activation outliers, bf16 against text.precision = 'fp8' on 256 captions: cosine, memory saved,
    ms per batch of 1, 8 and 32."""
    import tempfile

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import fp8_encoder as enc

    dims = (64, 1, 4, 128) if smoke else (4096, 2, 64, 10240)
    with tempfile.TemporaryDirectory() as tmp:
        path = enc.build_t5(*dims, tmp)
        r = enc.measure(path, DEVICE, (1, 8, 32), 2 if smoke else 5, n=32 if smoke else 256)
    return {"fp8_encoder_cosine": r["fp8_encoder_cosine"], "fp8_encoder_cosine_min": r["fp8_encoder_cosine_min"],
            "fp8_encoder_cosine_wo_quantized": r["fp8_encoder_cosine_wo_quantized"],
            "fp8_encoder_memory_saved": r["fp8_encoder_memory_saved"], "fp8_encoder_ms_per_batch": r["ms_per_batch"]}


def adapter_runs(smoke: bool) -> dict:
    """The adapter paths only a GPU takes: a LoRA trained by ``Trainer`` (one process, bf16 autocast) on a
    base read from a difftrain export, with the base held in bf16 (no fp32 master copy: its dtype is reported), fp8
    and nf4 (torchao weight-only, dequantized on the GPU) on a 1.1B-parameter model: losses finite, the DiT's stored
    bytes, the median step time after the first and the peak memory (loading included) of each."""
    import tempfile

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    sets = ["train.threads=0", "train.checkpoint_every=0", "train.global_batch=2", "train.ema_decay=0",
            "train.log_every=1", "model.init=default", "model.axes_dims_rope=[16, 56, 56]"]
    # ~1.1B parameters: the frozen base's weights dominate the peak, as they do for FLUX
    sets += (["model.hidden=128", "model.heads=1"] if smoke else
             ["model.hidden=2048", "model.heads=16", "model.double_blocks=4", "model.single_blocks=8"])
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = build_trainer(load_config(preset_path("shapes-tiny"), sets + ["train.steps=1"]), f"{tmp}/base")
        base.export()
        base.close()
        del base
        for precision in ("bf16", "fp8", "nf4"):
            gc.collect()                          # the previous trainer's tensors freed before the peak is reset
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            tr = build_trainer(load_config(preset_path("shapes-tiny"), sets + [
                "train.steps=6", "adapter.kind=lora", f"adapter.base_precision={precision}",
                f"model.init_from={tmp}/base/export"]), f"{tmp}/{precision}")
            try:
                w = tr.dit.double_blocks[0].img_attn.qkv.base_layer.weight
                t0 = time.perf_counter()
                summary = tr.fit()
                sync()
                rows = [json.loads(x) for x in open(f"{tmp}/{precision}/metrics.jsonl") if '"loss"' in x]
                from difftrain.models.base_quant import stored_bytes
                out[f"adapter_{precision}"] = {
                    "base_weight": f"{type(w.data).__name__}/{w.dtype}", "steps": summary["steps"],
                    "losses_finite": all(math.isfinite(r["loss"]) for r in rows),
                    "dit_stored_gb": round(stored_bytes(tr.dit) / 2**30, 3),
                    "step_s": sorted(r["step_s"] for r in rows[1:])[len(rows[1:]) // 2] if len(rows) > 1 else None,
                    "fit_s": round(time.perf_counter() - t0, 2),
                    "max_memory_allocated_gb": round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)
                    if DEVICE.type == "cuda" else "not run (CPU)",
                    "allocated_before_gb": round(before / 2**30, 3) if DEVICE.type == "cuda" else None}
            finally:
                tr.close()
                del tr
    return out


def finetune_paths(smoke: bool) -> dict:
    """The fine-tuning paths on the device: a full fine-tune from an export (bf16 autocast) with ``[validation]``
    (fixed noise drawn by CUDA generators), previews of base | now | EMA, and a masked batch moved to the device
    (pinned, non-blocking: the loss mask travels with it); figures finite, the grids written."""
    import tempfile

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer
    from difftrain.train.objectives import Denoiser
    from difftrain.train.validation import validation_loss

    sets = ["train.threads=0", "train.checkpoint_every=0", "train.global_batch=4", "train.log_every=1",
            "validation.every=2", "validation.n=4", "validation.timesteps=4", "train.sample_every=2",
            "sample.steps=4", "model.init=default"]
    if smoke:
        sets += ["model.hidden=32", "model.heads=2", "model.axes_dims_rope=[4, 6, 6]", "text.dim=16",
                 "data.image_size=32"]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = build_trainer(load_config(preset_path("shapes-tiny"), sets + ["train.steps=1"]), f"{tmp}/base")
        base.export()
        base.close()
        tr = build_trainer(load_config(preset_path("shapes-tiny"), sets + [
            "train.steps=4", f"model.init_from={tmp}/base/export"]), f"{tmp}/ft")
        try:
            tr.fit()
            sync()
            rows = [json.loads(x) for x in open(f"{tmp}/ft/metrics.jsonl") if '"val_loss"' in x]
            grids = sorted(p.name for p in (tr.run_dir / "samples").glob("step_*.png"))
            b = tr.val_batches[0]
            keep = torch.ones_like(b.loss_mask_BL)
            keep[:, ::2] = False
            b.keep_BL = keep
            if DEVICE.type == "cuda":
                b = b.pin_memory()
            moved = b.to(DEVICE, non_blocking=True)
            den = Denoiser(tr.model, tr.text_encoder, tr.device, tr.amp, 1, 0, tr.cfg.text.padding)
            tr.model.eval()
            dev_loss = validation_loss(den, tr.val_batches, tr.flow, 4, 0)[0]
            out["finetune"] = {
                "val_rows": len(rows), "val_loss_finite": all(math.isfinite(r["val_loss"]) for r in rows),
                "grids": grids, "base_preview": tr.base_preview is not None,
                "mask_on_device": str(moved.keep_BL.device), "counted": int(moved.counted_BL.sum()),
                "val_loss_device": round(dev_loss, 6)}
        finally:
            tr.close()
    return out


def _save(out: dict, path: str) -> None:
    """The figures so far, to ``path`` and stderr: a timeout or a crash in a later section keeps them."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out), file=sys.stderr, flush=True)


def _guarded(out: dict, key: str, fn, *args) -> None:
    """``out`` updated with ``fn(*args)``; a missing library or a refusal (float8 before sm89) is "not run", any
    other failure an error entry."""
    from difftrain.errors import UserError

    try:
        out.update(fn(*args))
    except ImportError as e:
        out[key] = f"not run ({e.name or e} not installed)"
    except UserError as e:
        out[key] = f"not run ({e})"
    except Exception as e:
        out[f"error_{key}"] = "".join(traceback.format_exception_only(e)).strip()[-500:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_suite.json")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, no compilation: checks the script")
    args = ap.parse_args()
    global PARAMS, IMG, TXT, DEVICE
    if args.smoke:
        (PARAMS, IMG, TXT), DEVICE = SMOKE, torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_suite needs a CUDA GPU (--smoke checks the script on a CPU)")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    out: dict = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "torch": torch.__version__,
                 "params": num_params(build_dit(PARAMS, device="meta")), "img_tokens": IMG, "txt_tokens": TXT}
    out["matmul_tflops"] = round(matmul_tflops(256 if args.smoke else 8192, 2 if args.smoke else 20), 3)
    bf16_run = None
    for name, ac in (("", "none"), ("_full_ac", "full")):
        try:
            r = train_run(ac, args.batch, args.steps, args.warmup, compile=not args.smoke)
            bf16_run = r if ac == "none" else bf16_run
            out.update({f"{k}{name}": v for k, v in r.items() if k not in ("ac", "batch", "peak", "losses", "fp8_layers")})
            out["peak"] = r["peak"]
            if ac == "none":
                try:
                    out.update(planner_error(args.batch, r["max_memory_allocated"]))
                except Exception as e:          # the planner must not cost the other figures
                    out["planner_error"] = f"failed: {e!r}"
        except Exception as e:
            out[f"error{name}"] = "".join(traceback.format_exception_only(e)).strip()[-500:]
        _save(out, args.out)
    try:
        out.update(trainer_run(args.steps, args.warmup, args.smoke))
    except Exception as e:
        out["error_trainer"] = "".join(traceback.format_exception_only(e)).strip()[-500:]
    _save(out, args.out)
    try:
        out.update(attention_table(args.smoke))
    except Exception as e:
        out["error_attention"] = "".join(traceback.format_exception_only(e)).strip()[-500:]
    _save(out, args.out)
    _guarded(out, "blocking_save", blocking_save, args.smoke)
    _save(out, args.out)
    _guarded(out, "tuned_calls", tuned_calls, args.smoke)
    _save(out, args.out)
    for key, fn, fargs in (("fp8_train", fp8_train, (bf16_run, args.batch, args.steps, args.warmup, args.smoke)),
                           ("quant_sample", quant_sample, (args.smoke, 2 if args.smoke else 10)),
                           ("fp8_encoder", fp8_encoder, (args.smoke,)), ("adapter", adapter_runs, (args.smoke,)),
                           ("finetune", finetune_paths, (args.smoke,)), ("muon", muon_run, (args.steps, args.smoke)),
                           ("dpo", dpo_objective, (args.smoke,)), ("demo_prefetch", demo_prefetch, (args.smoke,))):
        if key == "fp8_train" and bf16_run is None:
            out["error_fp8_train"] = "no bf16 run to compare with"
            continue
        _guarded(out, key, fn, *fargs)
        _save(out, args.out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
