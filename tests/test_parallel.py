"""The parallel layer in one process: mesh and batch checks, activation checkpointing parity, context-parallel
sequence splitting, compilation counting, init_from through the trainer, and bad launches."""

from __future__ import annotations

import json
import math

import pytest
import torch

from difftrain.cli import main
from difftrain.config import load_config, to_toml
from difftrain.errors import UserError
from difftrain.models import build_dit
from difftrain.models.dit import DiTParams
from difftrain.tokens import image_ids
from difftrain.parallel.ac import apply_ac
from difftrain.parallel.compile import compile_blocks, compile_count
from difftrain.parallel.cp import pad_to_multiple, shard_sequence
from difftrain.parallel.dist import batch_split, check_layout, pick_backend, resolve_mesh

P = DiTParams(in_channels=12, text_dim=8, pooled_dim=6, hidden=32, heads=2, double_blocks=2, single_blocks=2,
              axes_dims_rope=(4, 6, 6))


def _mesh(r, s, c):
    return {"dp_replicate": r, "dp_shard": s, "cp": c}


def test_mesh_resolution_and_its_errors():
    assert resolve_mesh(_mesh(1, -1, 1), 8) == _mesh(1, 8, 1)
    assert resolve_mesh(_mesh(2, -1, 2), 8) == _mesh(2, 2, 2)
    assert resolve_mesh(_mesh(-1, 4, 1), 8) == _mesh(2, 4, 1)
    with pytest.raises(UserError, match=r"= 6 processes, but the world size is 8"):
        resolve_mesh(_mesh(3, 2, 1), 8)
    with pytest.raises(UserError, match="does not divide the world size 8"):
        resolve_mesh(_mesh(3, -1, 1), 8)
    with pytest.raises(UserError, match="both -1"):
        resolve_mesh(_mesh(-1, -1, 1), 8)


def test_a_store_run_is_not_refused_for_its_unused_train_global_batch(tiny_cfg):
    """On 64 ranks a store config whose bucket batches are multiples of 64 runs, whatever train.global_batch
    (unused: a store run batches per bucket); the shapes source still needs it to divide."""
    store = tiny_cfg("data.source=store", "data.store=somewhere", "train.global_batch=32", "parallel.dp_shard=-1")
    assert check_layout(store, 64)["dp_shard"] == 64
    shapes = tiny_cfg("train.global_batch=32", "parallel.dp_shard=-1")
    with pytest.raises(UserError, match="global_batch = 32 is not divisible by the data-parallel size 64"):
        check_layout(shapes, 64)


def test_batch_split_derives_accumulation_and_refuses_what_does_not_divide():
    assert batch_split(32, 0, 4) == (8, 1)
    assert batch_split(32, 2, 4) == (2, 4)
    with pytest.raises(UserError, match=r"global_batch = 30 is not divisible by the data-parallel size 4"):
        batch_split(30, 0, 4)
    with pytest.raises(UserError, match=r"micro_batch = 3 must divide the per-rank share 8"):
        batch_split(32, 3, 4)


def test_backend_choice_and_nccl_without_gpus():
    assert pick_backend("auto", has_cuda=False) == "gloo"
    assert pick_backend("auto", has_cuda=True) == "nccl"
    with pytest.raises(UserError, match="nccl.*needs CUDA GPUs"):
        pick_backend("nccl", has_cuda=False)


def test_config_refuses_bad_parallel_settings():
    with pytest.raises(UserError, match=r"parallel.cp = 3 must divide model.heads = 4.*\[1, 2, 4\]"):
        load_config(None, ["model.heads=4", "model.hidden=128", "model.axes_dims_rope=[8, 12, 12]", "parallel.cp=3"])
    with pytest.raises(UserError, match="parallel.ac = 'some'"):
        load_config(None, ["parallel.ac=some"])
    with pytest.raises(UserError, match="parallel.dp_shard = 0"):
        load_config(None, ["parallel.dp_shard=0"])
    with pytest.raises(UserError, match="train.batch_size: unknown key .replaced by train.global_batch"):
        load_config(None, ["train.batch_size=4"])


@pytest.mark.parametrize("bad, message", [
    ("parallel.backend=nccl", "needs CUDA GPUs"),
    ("parallel.dp_replicate=2", "does not divide the world size 1"),
    ("train.global_batch=0", "train.global_batch = 0"),
    ("parallel.cpu_offload=true", "this run has no GPU"),
])
def test_train_refuses_bad_launches_before_any_work(tiny_cfg, tmp_path, capsys, bad, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(to_toml(tiny_cfg()))
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "run"), "--set", bad]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _inputs(B=2, L=16, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = image_ids(4, L // 4)[None].expand(B, -1, -1)
    return (torch.randn(B, L, P.in_channels, generator=g), ids, torch.randn(B, T, P.text_dim, generator=g),
            torch.rand(B, generator=g), torch.randn(B, P.pooled_dim, generator=g))


@pytest.mark.parametrize("mode, wrapped", [("full", 4), ("every:2", 2), ("selective", 4)])
def test_activation_checkpointing_keeps_names_and_numerics(mode, wrapped):
    ref = build_dit(P, init="default", seed=3)
    ac = build_dit(P, init="default", seed=3)
    assert apply_ac(ac, mode) == wrapped
    assert [n for n, _ in ac.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = _inputs()
    ref(*x).pow(2).mean().backward()
    ac(*x).pow(2).mean().backward()
    for (name, a), b in zip(ref.named_parameters(), ac.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_context_parallel_split_pads_with_masked_tokens():
    x = torch.arange(2 * 7).reshape(2, 7, 1).float()
    assert pad_to_multiple(x, 4).shape == (2, 8, 1)
    parts = [shard_sequence(x, 4, r) for r in range(4)]
    assert [p.shape[1] for p in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat(parts, 1)[:, :7], x)
    mask = [shard_sequence(torch.ones(2, 7, dtype=torch.bool), 4, r, False) for r in range(4)]
    assert torch.cat(mask, 1)[0].tolist() == [True] * 7 + [False]
    assert shard_sequence(x, 1, 0) is x


def test_padded_keys_do_not_change_the_model_output():
    """What context parallelism relies on: masked padding tokens change nothing for the real ones."""
    dit = build_dit(P, init="default", seed=1).eval()
    img, ids, txt, t, pooled = _inputs(L=16, T=5)
    ref = dit(img, ids, txt, t, pooled)
    pad_img = pad_to_multiple(img, 3)                          # 16 -> 18 image tokens
    pad_ids = pad_to_multiple(ids, 3)
    pad_txt = pad_to_multiple(txt, 4)                          # 5 -> 8 text tokens
    out = dit(pad_img, pad_ids, pad_txt, t, pooled, txt_mask_BT=pad_to_multiple(torch.ones(2, 5, dtype=torch.bool), 4, False),
              img_mask_BL=pad_to_multiple(torch.ones(2, 16, dtype=torch.bool), 3, False))
    torch.testing.assert_close(out[:, :16], ref, rtol=1e-5, atol=1e-6)


def test_initialisation_depends_on_seed_and_names_only():
    a, b, c = build_dit(P, seed=5), build_dit(P, seed=5), build_dit(P, seed=6)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y), name
        if name.endswith("qkv.weight"):
            assert not torch.equal(x, z), name
    # blocks of the same shape get different values (the name seeds them)
    assert not torch.equal(a.double_blocks[0].img_attn.qkv.weight, a.double_blocks[1].img_attn.qkv.weight)


def test_compilation_happens_once_per_distinct_shape():
    torch._dynamo.reset()
    dit = build_dit(DiTParams(in_channels=12, text_dim=8, pooled_dim=6, hidden=16, heads=2, double_blocks=1,
                              single_blocks=1, axes_dims_rope=(2, 2, 4)), init="default").eval()
    compile_blocks(dit)
    start = compile_count()
    with torch.no_grad():
        dit(*_inputs(L=16))
        first = compile_count()
        dit(*_inputs(L=16, seed=1))                # same shape: no recompilation
        assert compile_count() == first > start
        dit(*_inputs(L=32))                        # a new bucket shape: one more graph per block
        assert compile_count() == first + (first - start)


def test_init_from_an_export_through_the_trainer(tiny_cfg, tmp_path):
    from difftrain.train import build_trainer

    build_trainer(tiny_cfg("train.steps=3", "train.ema_decay=0"), tmp_path / "a").fit()
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "a" / "export" / "model.safetensors"))
    tr = build_trainer(tiny_cfg("train.steps=3", f"model.init_from={tmp_path / 'a' / 'export'}"), tmp_path / "b")
    for name, p in tr.dit.named_parameters():
        assert torch.equal(p.detach(), exported[f"dit.{name}"]), name
    with pytest.raises(UserError, match="double_blocks|num_layers|shape"):
        build_trainer(tiny_cfg("train.steps=3", "model.double_blocks=2", f"model.init_from={tmp_path / 'a' / 'export'}"),
                tmp_path / "c")


def _reseal(ck):
    """An edited trainer.json no longer matches the checkpoint's marker (which is the point of the marker):
    record its new size and checksum, as a save would have."""
    from difftrain.train.checkpoint import MARKER, file_digest
    marker = json.loads((ck / MARKER).read_text())
    marker["files"]["trainer.json"] = file_digest(ck / "trainer.json")
    (ck / MARKER).write_text(json.dumps(marker))


def test_sample_shift_is_read(tiny_cfg, tmp_path, capsys, monkeypatch):
    import difftrain.diffusion.pipeline as pipeline
    from difftrain.diffusion.flow import flux_mu
    from difftrain.train import build_trainer

    used = []
    real = pipeline.euler_sample

    def spy(velocity, x, mask, steps, shift=1.0, generator=None, noise=None):
        used.append(shift)
        return real(velocity, x, mask, steps, shift, generator, noise)

    monkeypatch.setattr(pipeline, "euler_sample", spy)
    build_trainer(tiny_cfg("train.steps=2", "train.checkpoint_every=0"), tmp_path / "run").fit()
    ck = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    info = json.loads((ck / "trainer.json").read_text())
    for shift in ("none", "fixed", "resolution"):
        info["config"]["sample"].update(shift=shift, shift_value=3.0)
        (ck / "trainer.json").write_text(json.dumps(info))
        _reseal(ck)
        assert main(["sample", str(ck), "--prompt", "a red circle", "--num-images", "1", "--out",
                     str(tmp_path / shift)]) == 0
        capsys.readouterr()
    tokens = (32 // 4 // 2) ** 2                    # tiny: 32 px images, factor 4, 2x2 patches
    assert used == pytest.approx([1.0, 3.0, math.exp(flux_mu(tokens))])


def test_plan_verb_prints_strategies_and_fails_when_nothing_fits(capsys):
    assert main(["plan", "dit-24b", "--gpus", "64", "--gpu-mem", "141", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [s["name"] for s in out["strategies"]]
    assert any(n.startswith("ddp") for n in names) and any(n.startswith("fsdp") for n in names)
    assert any(n.startswith("hsdp") for n in names)                       # 8 nodes: shard within one
    for s in out["strategies"]:
        assert {"name", "fits", "per_gpu_bytes", "recommended"} <= set(s)
        assert {"params", "grads", "optimizer", "activations", "encoders", "total"} <= set(s["per_gpu_bytes"])
    assert sum(s["recommended"] for s in out["strategies"]) == 1
    assert main(["plan", "dit-24b", "--gpus", "1", "--gpu-mem", "16"]) == 2
    err = capsys.readouterr().err
    assert "Nothing fits" in err and "What would fit" in err
    assert main(["plan", "dit-24b", "--gpus", "0", "--gpu-mem", "16"]) == 2


def test_sampling_shards_every_linear_layer_of_the_blocks_and_training_every_block():
    """FSDP units, innermost first: 'block' = blocks then the root; 'layer' adds each block's linear layers before
    their block, so a unit's own parameters are at most one layer (the root keeps its embedders and head)."""
    from torch import nn
    from difftrain.parallel.fsdp import fsdp_units

    dit = build_dit(P, init="default", seed=0)
    blocks = [*dit.double_blocks, *dit.single_blocks]
    assert fsdp_units(dit) == [*blocks, dit]
    units = fsdp_units(nn.ModuleDict({"dit": dit}), "layer")
    linears = [m for b in blocks for m in b.modules() if isinstance(m, nn.Linear)]
    assert len(units) == len(linears) + len(blocks) + 1 and units[-1] is dit
    assert set(map(id, units)) == set(map(id, [*linears, *blocks, dit]))
    for b in blocks:       # each block's linear layers come before the block itself
        assert all(units.index(m) < units.index(b) for m in b.modules() if isinstance(m, nn.Linear))
    # what a block keeps once its linear layers are units of their own: only its QK-norm scales
    own = {n for b in blocks for n, _ in b.named_parameters() if not any(n.startswith(p) for p, m in
           b.named_modules() if isinstance(m, nn.Linear) and p)}
    assert own and all(n.endswith(("query_norm", "key_norm")) for n in own)
    with pytest.raises(ValueError, match="granularity 'tensor'"):
        fsdp_units(dit, "tensor")


def test_clip_grad_norm_scales_every_gradient_by_the_global_norm():
    """One global norm over every gradient (float32 and bf16 alike); clipping scales them all by max_norm / norm, in
    place, and returns the norm before clipping; an infinite max_norm leaves them as they are."""
    from difftrain.parallel.fsdp import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (2, 2, 2))]
    params.append(torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16)))
    grads = [torch.randn(q.shape, generator=g).to(q.dtype) * 3 for q in params]
    for q, gr in zip(params, grads):
        q.grad = gr.clone()
    params.append(torch.nn.Parameter(torch.zeros(2)))          # no gradient: ignored
    norm = torch.sqrt(sum(gr.float().pow(2).sum() for gr in grads))
    assert torch.allclose(clip_grad_norm(params, float("inf")), norm, rtol=1e-3)
    assert all(torch.equal(q.grad, gr) for q, gr in zip(params, grads))
    total = clip_grad_norm(params, 1.0)
    assert torch.allclose(total, norm, rtol=1e-3) and norm > 1
    after = torch.sqrt(sum(q.grad.float().pow(2).sum() for q in params[:-1]))
    assert after == pytest.approx(1.0, rel=1e-2)
    for q, gr in zip(params, grads):
        assert torch.allclose(q.grad.float(), gr.float() / norm, rtol=1e-2, atol=1e-3)
