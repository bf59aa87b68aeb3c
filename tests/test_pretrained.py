"""Pretrained weights loaded shard by shard (``parallel.pretrained.load_pretrained``).

Tiny random diffusers FLUX transformers are saved sharded (``max_shard_size="50KB"``, with an index), then
loaded into our MMDiT on one process (forward parity with diffusers) and into an FSDP2-sharded MMDiT on two
gloo ranks (the gathered weights equal the one-process load bit for bit; each rank reads only its rows, the
two ranks together read every byte exactly once). Our own export loads back exactly; checkpoints that do not
fit the model are refused, naming the tensor and both shapes, before anything is written.

diffusers is imported lazily so that the spawned ranks (which import this module) do not pay for it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_diffusers_flux, run_ours_flux

from difftrain.errors import UserError
from difftrain.models import build_dit
from difftrain.tokens import image_ids
from difftrain.models.flux_adapter import from_diffusers, params_from_diffusers_config
from difftrain.parallel.pretrained import load_pretrained

if importlib.util.find_spec("diffusers") is None:
    pytest.skip("diffusers is not installed", allow_module_level=True)

TOL = 1e-4
BASE = dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
MODELS = {
    # guidance embedder; loaded through the pipeline folder (transformer/ inside)
    "guid": dict(BASE, guidance_embeds=True, in_channels=16),
    # no guidance; 13 channels: the output head has 13 rows, sharded unevenly (7 + 6) over two ranks
    "plain": dict(BASE, guidance_embeds=False, in_channels=13),
}
TXT_LEN = 5


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Normal(0, 0.15) everywhere, QK-norm scales around 1: no default init can hide a wrong mapping."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.3 * noise if ("norm_q" in name or "norm_k" in name or "norm_added" in name
                                       or "_norm" in name) else 0.15 * noise)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """name -> (transformer folder, path to pass to load_pretrained, the diffusers model)."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("flux")
    out = {}
    for i, (name, cfg) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = FluxTransformer2DModel(patch_size=1, out_channels=None, **cfg).eval()
        _randomise(model, 100 + i)
        folder = root / name / "transformer"
        model.save_pretrained(folder, max_shard_size="50KB")
        shards = sorted(folder.glob("diffusion_pytorch_model-*-of-*.safetensors"))
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file() and len(shards) > 2
        out[name] = (folder, folder.parent if name == "guid" else folder, model)
    return out


def _params(folder: Path):
    return params_from_diffusers_config(json.loads((folder / "config.json").read_text()))


def _inputs(in_channels: int, guidance: bool, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat((image_ids(3, 4, index=0), image_ids(2, 3, index=1)))
    B, L = 2, ids.shape[0]
    return (torch.randn(B, L, in_channels, generator=g), ids, torch.randn(B, TXT_LEN, 32, generator=g),
            torch.randn(B, 24, generator=g), torch.rand(B, generator=g),
            3.5 + torch.rand(B, generator=g) if guidance else None)


# --- 1. one process ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_sharded_loads_with_forward_parity(flux, name):
    folder, path, ref = flux[name]
    p = _params(folder)
    dit = build_dit(p, device="cpu").eval()
    report = load_pretrained(dit, path)
    assert report["kind"] == "diffusers" and report["files"] > 2
    assert report["tensors"] == len(list(dit.parameters()))
    assert report["bytes_read"] == report["bytes_total"] == sum(v.numel() * 4 for v in ref.state_dict().values())
    want = from_diffusers(ref.state_dict(), p)
    got = dit.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    inp = _inputs(p.in_channels, p.guidance_embed)
    ref_out, out = run_diffusers_flux(ref, *inp), run_ours_flux(dit, *inp)
    assert ref_out.abs().max() > 1e-2
    assert (out - ref_out).abs().max().item() <= TOL


# --- 2. two gloo ranks, FSDP2 / HSDP ------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, jobs: list, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from difftrain.parallel.fsdp import apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, path, mesh_shape, params in jobs:
            names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            dit = build_dit(params, device="meta")
            apply_fsdp(dit, mesh)
            dit.to_empty(device="cpu")               # garbage until loaded: no init at all
            report = load_pretrained(dit, path)
            report["local_rows"] = {k: v.to_local().shape[0] for k, v in dit.named_parameters()}
            full = {k: v.full_tensor().contiguous() for k, v in dit.named_parameters()}   # collective
            y = run_ours_flux(dit.eval(), *_inputs(params.in_channels, params.guidance_embed))  # every rank
            Path(out, f"{name}.{rank}.json").write_text(json.dumps(report))
            if rank == 0:
                save_file(dict(full, __out__=y.contiguous()), str(Path(out, f"{name}.safetensors")))
        # Both ranks leave together: a rank tearing gloo down while its peer is still writing can abort the peer
        # ("terminate called without an active exception", seen once on a loaded machine).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_ranks_read_only_their_rows(flux, tmp_path):
    world = 2
    export_dir, export_sd, export_p = _export(tmp_path / "run")
    jobs = [("guid", str(flux["guid"][1]), (2,), _params(flux["guid"][0])),
            ("plain", str(flux["plain"][1]), (1, 2), _params(flux["plain"][0])),   # HSDP placements
            ("export", str(export_dir), (2,), export_p)]
    out = tmp_path / "out"
    out.mkdir()
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), jobs, str(out)), nprocs=world, join=True)

    for name, path, _, p in jobs:
        got = load_file(str(out / f"{name}.safetensors"))
        y = got.pop("__out__")
        if name == "export":
            want = export_sd
        else:
            single = build_dit(p, device="cpu").eval()
            load_pretrained(single, path)
            want = single.state_dict()
            ref = flux[name][2]
            ref_out = run_diffusers_flux(ref, *_inputs(p.in_channels, p.guidance_embed))
            assert (y - ref_out).abs().max().item() <= TOL, name
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)

        reports = [json.loads((out / f"{name}.{r}.json").read_text()) for r in range(world)]
        total = reports[0]["bytes_total"]
        assert sum(r["bytes_read"] for r in reports) == total, name       # every byte read once, by one rank
        for r in reports:
            assert 0.4 * total < r["bytes_read"] < 0.6 * total, (name, r["bytes_read"], total)
        if name == "plain":                                                 # the uneven shard: 7 + 6 rows
            assert [r["local_rows"]["final_layer.linear.weight"] for r in reports] == [7, 6]


# --- 3. our export ------------------------------------------------------------------------------------------
def _export(run: Path):
    """A run folder with export/model.safetensors (dit. and text. keys) and config.toml, as the trainer writes."""
    p = _params_like(in_channels=12)
    dit = build_dit(p, device="cpu")
    _randomise(dit, 5)
    sd = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    (run / "export").mkdir(parents=True)
    tensors = {f"dit.{k}": v for k, v in sd.items()} | {"text.embed.weight": torch.randn(10, 8)}
    save_file(tensors, str(run / "export" / "model.safetensors"), metadata={"format": "difftrain-weights/1"})
    (run / "export" / "config.toml").write_text("# written by the trainer\n")
    return run / "export", sd, p


def _params_like(**kw):
    return params_from_diffusers_config(dict(MODELS["guid"], **kw))


def test_export_round_trip(tmp_path):
    export_dir, sd, p = _export(tmp_path / "run")
    for path in (export_dir / "model.safetensors", export_dir, tmp_path / "run"):
        fresh = build_dit(p, device="cpu")         # its own init first: every tensor is overwritten
        report = load_pretrained(fresh, path)
        assert report["kind"] == "difftrain" and report["bytes_read"] == report["bytes_total"]
        got = fresh.state_dict()
        assert set(got) == set(sd)
        for k in sd:
            assert torch.equal(got[k], sd[k]), k
    half = build_dit(p, device="cpu").to(torch.bfloat16)   # cast to the parameter's dtype
    load_pretrained(half, export_dir)
    for k, v in half.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k].to(torch.bfloat16)), k


def test_export_mismatch_and_foreign_format(tmp_path):
    export_dir, sd, p = _export(tmp_path / "run")
    bigger = dataclasses.replace(p, hidden=64, heads=4)
    with pytest.raises(UserError) as e:
        load_pretrained(build_dit(bigger, device="meta"), export_dir)
    assert "img_in.weight" in str(e.value) and "(64, 12)" in str(e.value) and "(32, 12)" in str(e.value)
    save_file({"dit.x": torch.zeros(1)}, str(tmp_path / "other.safetensors"), metadata={"format": "other/2"})
    with pytest.raises(UserError, match="other/2"):
        load_pretrained(build_dit(p, device="meta"), tmp_path / "other.safetensors")


# --- 4. what does not fit -----------------------------------------------------------------------------------
def _unchanged_after_error(dit, path) -> UserError:
    before = {k: v.clone() for k, v in dit.state_dict().items()}
    with pytest.raises(UserError) as e:
        load_pretrained(dit, path)
    assert all(torch.equal(v, before[k]) for k, v in dit.state_dict().items())
    return e.value


def test_config_with_other_sizes_is_refused(flux):
    folder, _, _ = flux["plain"]
    p = _params(folder)
    msg = str(_unchanged_after_error(build_dit(dataclasses.replace(p, hidden=64, heads=4)), folder))
    assert str(folder) in msg
    assert "hidden is 64 here but 32 there" in msg
    assert "'img_in.weight'" in msg and "'x_embedder.weight'" in msg, msg
    assert "expected shape (64, 13), found (32, 13)" in msg, msg

    msg = str(_unchanged_after_error(build_dit(dataclasses.replace(p, double_blocks=2)), folder))
    assert "(num_layers)" in msg and "missing 32 tensors [transformer_blocks.1.attn.add_k_proj.bias" in msg, msg

    msg = str(_unchanged_after_error(build_dit(dataclasses.replace(p, guidance_embed=True)), folder))
    assert "guidance_embed is True here but False there" in msg, msg
    assert "missing 4 tensors" in msg and "guidance_embedder.linear_1.weight" in msg, msg
    no_guidance = dataclasses.replace(_params(flux["guid"][0]), guidance_embed=False)
    msg = str(_unchanged_after_error(build_dit(no_guidance), flux["guid"][1]))
    assert "unexpected 4 tensors" in msg and "guidance_embedder.linear_2.bias" in msg, msg

    msg = str(_unchanged_after_error(build_dit(dataclasses.replace(p, axes_dims_rope=(8, 4, 4))), folder))
    assert "axes_dims_rope" in msg, msg                          # no shape shows it: the config does


def test_missing_tensor_is_named(flux, tmp_path):
    folder, _, _ = flux["plain"]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    victim = "single_transformer_blocks.1.proj_mlp.bias"
    index = json.loads((broken / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"][victim]                 # the index still lists it
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    msg = str(_unchanged_after_error(build_dit(_params(folder)), broken))
    assert str(broken) in msg and "missing 1 tensors" in msg and victim in msg, msg


def test_not_a_model_folder(tmp_path):
    p = _params_like()
    dit = build_dit(p, device="meta")
    with pytest.raises(UserError, match="no such file"):
        load_pretrained(dit, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match=r"not a pretrained model folder.*config\.json.*model\.safetensors"):
        load_pretrained(dit, empty)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps(MODELS["guid"]))
    with pytest.raises(UserError, match="no diffusion_pytorch_model.safetensors"):
        load_pretrained(dit, config_only)
    (config_only / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UserError, match="pickled"):
        load_pretrained(dit, config_only)
    with pytest.raises(UserError, match="pickled"):
        load_pretrained(dit, config_only / "diffusion_pytorch_model.bin")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(MODELS["guid"]))
    (shards / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x_embedder.weight": "diffusion_pytorch_model-00001-of-00002.safetensors"}}))
    with pytest.raises(UserError, match="shard files that are not there"):
        load_pretrained(dit, shards)
