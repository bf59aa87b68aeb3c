"""The memory planner against the real thing: FSDP2's own shards of the 24B preset on a 64-rank fake process
group (exact bytes), autograd's saved tensors of one block (exact bytes), and the peak of live tensor bytes
of the real Trainer's step on 2 gloo ranks (within 20%), with and without gradient accumulation under both
``parallel.grad_sync`` settings; then the per-strategy grad_sync choice, the recommendation rule, the
nothing-fits message, the JSON fields and input errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from difftrain.config import from_dict, load_config
from difftrain.errors import UserError
from difftrain.parallel.planner import Assumptions, Strategy, block_activation_bytes, estimate_single_gpu, plan
from difftrain.shapes import vocabulary


def _preset(name: str) -> Path:
    try:
        from difftrain.config import preset_path
        return preset_path(name)
    except ImportError:      # presets before they moved into the package
        return Path(__file__).resolve().parents[1] / "configs" / f"{name}.toml"


@pytest.fixture(scope="module")
def dit24b():
    # The preset carries the split the planner recommends; these tests reason from plain FSDP settings.
    return load_config(_preset("dit-24b"), PLAIN_FSDP)


PLAIN_FSDP = ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.cp=1", "parallel.grad_sync=last"]


def _strategy(p, name: str) -> Strategy:
    return next(s for s in p.strategies if s.name == name)


# --- (1) exact per-rank state bytes against FSDP2 on a fake 64-rank process group --------------------------------

_FAKE_PG = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from difftrain.config import load_config
from difftrain.models import build_dit, config_dit_params
from difftrain.parallel.fsdp import apply_fsdp

def local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()

cfg = load_config(sys.argv[1])
out = {}
for world, rank in ((64, 0), (64, 63), (48, 0), (48, 47)):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = build_dit(config_dit_params(cfg), device="meta")
        apply_fsdp(model, init_device_mesh("cpu", (world,)), param_dtype=torch.bfloat16)
        params = list(model.parameters())
        for p in params:             # FSDP2's sharded gradient: a DTensor shaped like the sharded parameter
            p.grad = torch.zeros_like(p)
        # foreach=False: the same state as the trainer's foreach AdamW, built in 2 s instead of 60 on meta DTensors
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        opt.step()
        out[f"{world}/{rank}"] = {
            "params": sum(local(p) for p in params), "grads": sum(local(p.grad) for p in params),
            "optimizer": sum(local(v) for st in opt.state.values() for v in st.values()),
            "dtypes": sorted({str(p.dtype) for p in params})}
    finally:
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_state_bytes_equal_fsdp2_shards_of_the_24b_preset(dit24b):
    proc = subprocess.run([sys.executable, "-c", _FAKE_PG, str(_preset("dit-24b"))], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    for world in (64, 48):
        ranks = [v for k, v in real.items() if k.startswith(f"{world}/")]
        assert all(r["dtypes"] == ["torch.float32"] for r in ranks)   # fp32 master weights
        est = _strategy(plan(dit24b, world, 141, nodes=world // 8), f"fsdp({world})").per_gpu_bytes
        for part in ("params", "grads", "optimizer"):
            largest = max(r[part] for r in ranks)
            assert est[part] == largest == real[f"{world}/0"][part], (world, part, est[part], largest)
    # 48 ranks split some first dims unevenly (64 output channels: 2 rows on ranks 0-31, none on 32-47)
    assert real["48/47"]["params"] < real["48/0"]["params"]


# --- the activation formula against autograd's saved tensors ---------------------------------------------------------

def _saved_bytes(block, args, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in ``block``'s forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            block(*args)
    return sum(saved.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_block_activation_formula_equals_saved_tensors(monkeypatch, autocast):
    import torch.nn.functional as F

    from difftrain.models import layers
    from difftrain.tokens import image_ids
    from difftrain.models.rope import rope_angles

    if autocast:   # CUDA's autocast runs layer_norm in fp32 (CPU's keeps bf16): reproduce CUDA's policy
        monkeypatch.setattr(layers, "_layer_norm", lambda x: F.layer_norm(x.float(), (x.shape[-1],), eps=1e-6))
    D, heads, B, T, side = 128, 2, 2, 8, 6
    dtype = torch.bfloat16 if autocast else torch.float32
    ids = torch.cat([torch.zeros(T, 3, dtype=torch.long), image_ids(side, side)])[None].expand(B, -1, -1)
    rope = rope_angles(ids, (16, 24, 24), 10000.0)
    vec = torch.randn(B, D, dtype=dtype, requires_grad=True)
    N = side * side
    double = layers.DoubleStreamBlock(D, heads, 4.0).to(dtype)
    single = layers.SingleStreamBlock(D, heads, 4.0).to(dtype)
    x = lambda n: torch.randn(B, n, D, dtype=dtype, requires_grad=True)  # noqa: E731
    shared = 2 * B * (N + T) * (D // heads // 2) * 4 + vec.numel() * vec.element_size()   # RoPE cos, sin; vec
    for kind, block, args in (("double", double, (x(N), x(T), vec, rope)), ("single", single, (x(N + T), vec, rope))):
        # CPU's rms_norm is the composite one; the planner assumes CUDA's fused kernel only on CUDA
        est = block_activation_bytes(kind, D, 4 * D, heads, D // heads, N, T, autocast, rms_fused=False, samples=B)
        assert est + shared == _saved_bytes(block, args, autocast), kind


# --- (2) the planner's total against the peak of live tensors of a 2-rank training step -------------------------

MEASURED = {"model": {"hidden": 512, "heads": 8, "double_blocks": 2, "single_blocks": 2,
                      "axes_dims_rope": [16, 24, 24]},
            "text": {"kind": "words", "dim": 64, "max_tokens": 16},
            "autoencoder": {"kind": "pixel-unshuffle", "factor": 4},
            "data": {"image_size": 64, "frames": 4, "t2i_weight": 0.0, "edit_weight": 0.0, "keyframe_weight": 1.0},
            "train": {"global_batch": 8, "micro_batch": 2, "ema_decay": 0.99, "threads": 1}}
# on 2 ranks: "none" / "full" one micro-batch a step; the others 2 micro-batches (accumulation)
CASES = {"none": {"train": {"global_batch": 4}}, "full": {"train": {"global_batch": 4}, "parallel": {"ac": "full"}},
         "last": {"parallel": {"grad_sync": "last"}}, "every": {"parallel": {"grad_sync": "every"}},
         "last-bf16": {"parallel": {"grad_sync": "last"}, "train": {"precision": "bf16"}}}


def _measured_cfg(case: str):
    def merge(a: dict, b: dict) -> dict:
        return {**a, **{k: merge(a.get(k, {}), v) if isinstance(v, dict) else v for k, v in b.items()}}

    return from_dict(merge(MEASURED, CASES[case]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held_unsharded_grads(units) -> dict:
    """Unsharded gradients the FSDP units hold (accumulated over micro-batches without a reduction)."""
    n, dtypes = 0, set()
    for unit in units:
        for fp in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
            g = getattr(fp, "unsharded_accumulated_grad", None)
            if g is None and hasattr(fp, "_unsharded_param"):
                g = fp._unsharded_param.grad
            if g is not None:
                n, dtypes = n + g.numel() * g.element_size(), dtypes | {str(g.dtype)}
    return {"bytes": n, "dtypes": sorted(dtypes)}


def _trainer_worker(rank: int, world: int, port: int, out: str) -> None:
    """Per case, the real Trainer on 2 gloo ranks: one step (creates the optimizer state), then the peak of
    live tensor bytes of the next ``train_step`` under FSDPMemTracker, and what the units hold between its
    micro-batches."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from difftrain.parallel.dist import init_distributed, shutdown
    from difftrain.train import build_trainer

    env, results = None, {}
    try:
        for case in CASES:
            cfg = _measured_cfg(case)
            env = env or init_distributed(cfg)
            trainer = build_trainer(cfg, Path(out) / case, env=env)
            trainer.train_step(next(trainer.loader))
            batches = next(trainer.loader)
            tracker = FSDPMemTracker(trainer.dit, trainer.optimizer)
            # what lives before the step and the tracker does not find itself: the batch, the EMA, the
            # replicated text encoder's parameters
            local = [t.to_local() if hasattr(t, "to_local") else t for t in trainer.ema.shadow.values()]
            tracker.track_inputs((*[t for b in batches for t in (b.x0_BLC, b.ids_BL3, b.loss_mask_BL,
                                                                 *b.tokens.values())],
                                  *local, *trainer.model["text"].parameters()))
            held, forward_loss = [], trainer.objective.loss

            def micro_batch(*args, forward_loss=forward_loss, held=held, tracker=tracker, trainer=trainer):
                held.append(_held_unsharded_grads(trainer.fsdp_units))
                tracker.reset_mod_stats()       # else the tracker refuses the root's second forward in a step
                return forward_loss(*args)

            trainer.objective.loss = micro_batch     # every micro-batch of the step passes through here
            with tracker:
                trainer.train_step(batches)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            results[case] = {"peak": {str(k).split(".")[-1]: v for k, v in peak.items()}, "held": held[-1],
                             "accum": trainer.accum}
            del trainer, tracker
    finally:
        shutdown()
    if rank == 0:
        Path(out, "measured.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("measured")
    mp.spawn(_trainer_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return json.loads((out / "measured.json").read_text())


def _compare(case: str, b: dict, measured: dict) -> str:
    total, peak = b["total"], measured[case]["peak"]["Total"]
    detail = {k: round(v / 2 ** 20, 1) for k, v in measured[case]["peak"].items()}
    msg = (f"{case}: planner {total / 2 ** 20:.1f} MiB ({b['peak_phase']}) vs measured peak "
           f"{peak / 2 ** 20:.1f} MiB ({(total - peak) / peak:+.1%}); measured at the peak: {detail}")
    print(msg)
    assert abs(total - peak) <= 0.2 * peak, msg
    return msg


@pytest.mark.parametrize("case", ["none", "full", "last", "every"])
def test_total_matches_measured_peak_of_a_2_rank_training_step(measured, case):
    assert measured[case]["accum"] == (1 if case in ("none", "full") else 2)
    # fsdp(2), as the config says
    b = plan(_measured_cfg(case), 2, 64, device="cpu", vocabulary=vocabulary()).configured.per_gpu_bytes
    assert b["grad_accum"] == measured[case]["accum"]
    assert 2 * (b["params"] + b["grads"] + b["optimizer"]) >= 200e6   # params + grads + AdamW, both ranks
    _compare(case, b, measured)


def test_grad_sync_last_holds_the_whole_dit_unsharded_in_fp32(measured):
    from difftrain.sources import vocabulary_for
    from difftrain.models import build_text_encoder, num_params

    p = {case: plan(_measured_cfg(case), 2, 64, device="cpu", vocabulary=vocabulary()) for case in ("last", "every")}
    b = {case: q.configured.per_gpu_bytes for case, q in p.items()}
    n_dit, n_text = p["last"].context["model_params"], p["last"].context["text_encoder_params"]
    assert n_text == num_params(build_text_encoder(_measured_cfg("last"), vocabulary_for(_measured_cfg("last"))))
    assert b["last"]["accum_grads"] == 4 * n_dit and b["every"]["accum_grads"] == 0
    # between micro-batches under "last" every rank holds the whole DiT's gradients, unsharded, in fp32: as
    # .grad of fp32 params, and upcast from bf16 (FSDP2's reduce dtype) under bf16 mixed precision
    for case in ("last", "last-bf16"):
        assert measured[case]["held"] == {"bytes": 4 * n_dit, "dtypes": ["torch.float32"]}, case
    assert measured["every"]["held"]["bytes"] == 0
    # the model (28M params) is large against the activations here: "last" costs more, measured and planned
    assert measured["last"]["peak"]["Total"] > measured["every"]["peak"]["Total"]
    assert b["last"]["total"] > b["every"]["total"]
    # bf16 mixed precision (CUDA's semantics; CPU autocast keeps layer_norm in bf16, the composite rms_norm)
    bf16 = plan(_measured_cfg("last-bf16"), 2, 64, assumptions=Assumptions(rms_norm_fused=False),
               vocabulary=vocabulary()).configured
    assert bf16.grad_sync == "last" and bf16.per_gpu_bytes["accum_grads"] == 4 * n_dit
    _compare("last-bf16", bf16.per_gpu_bytes, measured)


def test_single_gpu_estimate_is_ordered():
    """``bench/gpu_suite.py`` compares this with torch.cuda.max_memory_allocated on a GPU; here only its order."""
    from difftrain.models import build_dit, num_params
    from difftrain.models.dit import DiTParams

    p = DiTParams(in_channels=64, text_dim=256, pooled_dim=64, hidden=256, heads=4, double_blocks=2,
                  single_blocks=2, axes_dims_rope=(16, 24, 24))
    none, full = (estimate_single_gpu(p, img_tokens=1024, txt_tokens=64, micro_batch=4, ac=ac)
                  for ac in ("none", "full"))
    assert 16 * num_params(build_dit(p, device="meta")) < full < none     # fp32 params, grads, AdamW: the floor


# --- the recommendation and the report ----------------------------------------------------------------------------

def test_24b_on_64_h200_shards_without_recomputation(dit24b):
    p = plan(dit24b, 64, 141)
    assert p.fits and sum(s.recommended for s in p.strategies) == 1
    best = _strategy(p, p.recommended)
    assert best.fits and best.recommended and best.base in ("fsdp", "hsdp") and best.ac == "none"
    assert not best.cpu_offload
    # the rule: no AC before AC, no offload before offload, then the fastest
    assert best.rank_key() == min(s.rank_key() for s in p.strategies if s.fits)
    assert min(s.step_time_cost["step_s"] for s in p.strategies if s.fits and s.ac == "none"
               and not s.cpu_offload) == best.step_time_cost["step_s"]
    ddp = _strategy(p, "ddp")              # 24.5B x 16 bytes of replicated state: nowhere near
    assert not ddp.fits and ddp.per_gpu_bytes["params"] == 4 * p.to_json()["model_params"]
    assert "Recommended: " + p.recommended in p.message and p.recommended in p.table()
    # 16 micro-batches a rank: holding the whole DiT's unsharded fp32 gradients (91 GiB) would not fit
    assert best.per_gpu_bytes["grad_accum"] == 16 and best.grad_sync == "every"
    assert best.settings["parallel.grad_sync"] == "every" and "parallel.grad_sync=every" in p.message
    assert best.alternative["grad_sync"] == "last" and not best.alternative["fits"]


def test_grad_sync_is_chosen_per_strategy(dit24b):
    """With accumulation every strategy is evaluated both ways: 'last' holds the DiT's unsharded gradients
    but reduces once; the one kept fits if either does, then is the faster, else the smaller."""
    p = plan(dit24b, 64, 141)
    n = p.to_json()["model_params"]
    assert p.configured.grad_sync == "last" and p.configured.per_gpu_bytes["accum_grads"] == 4 * n
    kept = {s.grad_sync for s in p.strategies}
    assert kept == {"last", "every"}
    for s in p.strategies:
        alt = s.alternative
        total = {s.grad_sync: s.per_gpu_bytes["total"], alt["grad_sync"]: alt["total"]}
        step = {s.grad_sync: s.step_time_cost["step_s"], alt["grad_sync"]: alt["step_s"]}
        fits = {s.grad_sync: s.fits, alt["grad_sync"]: alt["fits"]}
        assert s.per_gpu_bytes["accum_grads"] == (4 * n if s.grad_sync == "last" else 0)
        assert step["last"] <= step["every"] + 1e-9, s.name           # fewer reductions: never slower
        if s.base != "ddp":                                             # sharded: the unsharded grads cost
            assert total["last"] > total["every"] + 3 * n, s.name
        if fits["last"] and fits["every"]:
            assert round(step[s.grad_sync], 3) <= round(step[alt["grad_sync"]], 3), s.name
        elif fits["last"] or fits["every"]:
            assert s.fits, s.name
        else:
            assert total[s.grad_sync] <= total[alt["grad_sync"]], s.name
        accum = s.per_gpu_bytes["grad_accum"]
        assert s.step_time_cost["grad_reductions"] == (1 if s.grad_sync == "last" else accum) and accum > 1


def test_nothing_fits_says_what_would(dit24b):
    p = plan(dit24b, 1, 16)
    assert not p.fits and p.recommended is None and not any(s.recommended or s.fits for s in p.strategies)
    kinds = {s["kind"] for s in p.suggestions}
    assert "gpu_mem" in kinds and "more_gpus" in kinds
    assert p.message.startswith("Nothing fits") and "GB" in p.message
    j = p.to_json()
    assert j["fits"] is False and j["recommended"] is None and j["message"] == p.message
    # where more GPUs help, the count the plan names is the first on which that strategy fits
    sets = ["data.edit_weight=0", "data.keyframe_weight=0", "train.global_batch=256", "train.micro_batch=1",
            *PLAIN_FSDP]
    p = plan(load_config(_preset("flux-dev"), sets), 1, 17)
    assert not p.fits
    found = [s for s in p.suggestions if s["kind"] == "more_gpus" and s["min_gpus"]]
    assert found and f">= {found[0]['min_gpus']} GPUs" in p.message
    for s in found:
        sync = [f"parallel.grad_sync={s['grad_sync']}"] if s["grad_sync"] else []
        cfg = load_config(_preset("flux-dev"), sets + [f"parallel.cp={s['cp']}", f"parallel.ac={s['ac']}", *sync])
        n = s["min_gpus"]
        at = plan(cfg, n, 17)
        assert at.configured.per_gpu_bytes["total"] <= at.context["usable_bytes"], s
        below = plan(cfg, n - (8 if n > 8 else s["cp"]), 17)
        assert below.configured.per_gpu_bytes["total"] > below.context["usable_bytes"], s


def test_json_has_the_fields_the_cli_prints(dit24b):
    j = json.loads(json.dumps(plan(dit24b, 16, 141, nodes=2).to_json()))     # plain JSON types
    assert {"strategies", "recommended", "fits", "message", "assumptions", "suggestions"} <= set(j)
    assert {"peak_flops", "mfu", "nvlink_bytes_per_s", "ib_bytes_per_s"} <= set(j["assumptions"])
    names = [s["name"] for s in j["strategies"]]
    assert len(names) == len(set(names)) and any(n.startswith("hsdp(8)") for n in names)
    assert sum(s["recommended"] for s in j["strategies"]) == 1
    for s in j["strategies"]:
        assert {"name", "fits", "per_gpu_bytes", "step_time_cost", "recommended", "settings"} <= set(s)
        b = s["per_gpu_bytes"]
        assert {"params", "grads", "optimizer", "activations", "encoders", "buffers", "total"} <= set(b)
        parts = sum(b[k] for k in ("params", "grads", "accum_grads", "optimizer", "ema", "activations", "encoders",
                                   "buffers"))
        assert 0 < b["total"] <= parts
        assert s["settings"]["parallel.grad_sync"] == s["grad_sync"] in ("last", "every")
        assert (s["alternative"] is not None) == (b["grad_accum"] > 1)
        assert {"compute_s", "recompute_s", "comm_s", "extra_s", "extra_fraction", "step_s"} <= set(s["step_time_cost"])
        assert s["step_time_cost"]["extra_s"] >= 0
        if s["ac"] == "full":
            assert s["step_time_cost"]["recompute_s"] == pytest.approx(s["step_time_cost"]["compute_s"] / 3)


@pytest.mark.parametrize("kwargs, words", [
    ({"gpus": 0, "gpu_mem_gb": 80}, "--gpus"),
    ({"gpus": 8, "gpu_mem_gb": 0}, "--gpu-mem"),
    ({"gpus": 8, "gpu_mem_gb": -80}, "--gpu-mem"),
    ({"gpus": 12, "gpu_mem_gb": 80, "nodes": 5}, "not divisible by --nodes"),
    ({"gpus": 12, "gpu_mem_gb": 80}, "give --nodes"),
    ({"gpus": 8, "gpu_mem_gb": 80, "nodes": 0}, "--nodes"),
])
def test_bad_input_is_a_user_error(kwargs, words):
    with pytest.raises(UserError, match=words):
        plan(load_config(None), **kwargs)


def test_a_store_curriculum_is_planned_at_its_worst_bucket_and_micro_batch():
    """The planner reads the store loader's buckets: each at its own cost-balanced micro-batch; the worst one
    sets the memory, and a bucket whose global batch the data-parallel size does not divide is a problem."""
    from difftrain.config import load_config, preset_path
    from difftrain.parallel.planner import plan

    stages = ('[{name = "a", start_step = 0, buckets = [[512, 512]], global_batch = 64}, '
              '{name = "b", start_step = 100, buckets = [[1024, 1024], [768, 1344]], global_batch = 64, '
              'micro_cost = 4096}]')
    cfg = load_config(preset_path("flux-dev"), ["data.source=store", "data.store=/nowhere", f"data.stages={stages}"])
    p = plan(cfg, 16, 141)
    assert set(p.context["buckets"]) >= {"a/512x512/t2i", "b/1024x1024/t2i", "b/768x1344/edit"}
    best = next(s for s in p.strategies if s.recommended)
    assert best.worst_bucket.startswith(("a/", "b/"))
    # the 1024^2 t2i bucket (4096 tokens) may hold one sample per micro-step: micro_cost 4096 / 4096
    assert p.context["buckets"]["b/1024x1024/t2i"]["img_tokens"] == 4096
    odd = load_config(preset_path("flux-dev"), ["data.source=store", "data.store=/nowhere", "data.stages="
                      '[{name = "a", start_step = 0, buckets = [[512, 512]], global_batch = 24}]'])
    assert all(any("bucket a/512x512" in q for q in s.problems) for s in plan(odd, 16, 141).strategies
               if s.dp_replicate * s.dp_shard == 16)


def test_frozen_encoders_are_counted_only_where_the_run_builds_them():
    """A store holds the text encoders' states, its previews' included: a store-fed run holds only the VAE, previews
    or not, unless preview.text = 'encoders' builds T5 + CLIP for previews; the shapes source encodes every batch; fp8
    stores T5's quantized linears in a byte a weight. The plan's per-GPU 'encoders' part says the same."""
    from difftrain.parallel.memory import (CLIP_L_TEXT_PARAMS, FLUX_VAE_PARAMS, T5_XXL_ENCODER_PARAMS,
                                           T5_XXL_FP8_PARAMS, frozen_encoder_bytes)

    flux = ["text.t5_path=/t5", "text.clip_path=/clip", "autoencoder.kind=diffusers", "autoencoder.path=/vae",
            "text.dtype=bf16"]
    online = load_config(_preset("flux-dev"), flux + ["train.sample_every=0"])
    store = load_config(_preset("flux-dev"), flux + ["data.source=store", "data.store=/s", "train.sample_every=0"])
    previews = load_config(_preset("flux-dev"), flux + ["data.source=store", "data.store=/s",
                                                        "train.sample_every=500"])
    encoded = load_config(_preset("flux-dev"), flux + ["data.source=store", "data.store=/s",
                                                       "train.sample_every=500", "preview.text=encoders"])
    fp8 = load_config(_preset("flux-dev"), flux + ["text.precision=fp8", "train.sample_every=0"])
    text = (T5_XXL_ENCODER_PARAMS + CLIP_L_TEXT_PARAMS) * 2
    assert frozen_encoder_bytes(store, "cuda") == frozen_encoder_bytes(previews, "cuda") == FLUX_VAE_PARAMS * 2
    assert frozen_encoder_bytes(online, "cuda") == frozen_encoder_bytes(encoded, "cuda") == text + FLUX_VAE_PARAMS * 2
    assert frozen_encoder_bytes(fp8, "cuda") == text - T5_XXL_FP8_PARAMS + FLUX_VAE_PARAMS * 2
    assert 9.0e9 < text < 10.0e9 and T5_XXL_FP8_PARAMS / T5_XXL_ENCODER_PARAMS > 0.75
    parts = {name: plan(c, 64, 141).strategies[0].per_gpu_bytes["encoders"]
             for name, c in (("online", online), ("store", store))}
    assert parts == {"online": text + FLUX_VAE_PARAMS * 2, "store": FLUX_VAE_PARAMS * 2}


def test_a_blocking_save_stages_one_piece_of_the_writers_size():
    from difftrain.parallel.planner import STAGING_PIECE_BYTES
    from difftrain.train.verification import CHUNK

    assert STAGING_PIECE_BYTES == CHUNK
    cfg = load_config(_preset("dit-24b"), PLAIN_FSDP + ["train.async_checkpoint=false"])
    assert {s.staging_bytes for s in plan(cfg, 64, 141).strategies} == {CHUNK}


def test_the_adapter_plan_of_flux_dev_per_base_precision():
    """``difftrain plan`` for an adapter run: each base precision on 24/48/80 GB. FLUX.1-dev's LoRA at 1024
    pixels: the base 22 GiB in bf16, half in fp8, about a quarter in nf4 (blocks' linears quantized, the rest
    bf16 and sharded); with full activation checkpointing nf4 fits a 24 GB GPU and bf16 does not; over 8 GPUs
    the bf16 base is sharded and the quantized ones are not."""
    from difftrain.config import load_config, preset_path
    from difftrain.parallel.adapter_plan import adapter_plan, table

    cfg = load_config(preset_path("flux-dev"), ["adapter.kind=lora", "model.init_from=x", "data.edit_weight=0",
                                                "data.keyframe_weight=0"])
    one = adapter_plan(cfg, 1, 24)
    p = one["precisions"]
    assert 21 < p["bf16"]["base_gb"] < 23 and 10.5 < p["fp8"]["base_gb"] < 11.5 and 5.5 < p["nf4"]["base_gb"] < 6.5
    assert p["nf4+ac:full"]["fits_24gb"] and not p["bf16+ac:full"]["fits_24gb"] and p["bf16+ac:full"]["fits_48gb"]
    assert not one["fits"] and p["bf16"]["activations_gb"] > 10 * p["bf16+ac:full"]["activations_gb"]
    eight = adapter_plan(cfg, 8, 24)["precisions"]
    assert eight["bf16"]["base_gb"] < p["bf16"]["base_gb"] / 4 and eight["nf4"]["base_gb"] > 0.9 * p["nf4"]["base_gb"]
    assert "nf4+ac:full" in table(one, 24)
