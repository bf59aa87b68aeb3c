"""train.optimizer = "muon": the Newton-Schulz orthogonalisation, which parameters it takes (a repeated batch's
falling loss: tests/test_train.py), a crash and resume that continues the same run bit for bit, and two FSDP2 ranks (gloo) that train what one does."""

from __future__ import annotations

import pytest
import torch

from difftrain.config import load_config
from difftrain.train import build_trainer
from difftrain.train.metrics import read_metrics
from difftrain.train.muon import MuonAdamW, is_hidden_matrix, orthogonalize


@pytest.mark.parametrize("shape", [(48, 200), (300, 64), (96, 96)])
def test_orthogonalize_gives_the_singular_vectors_with_singular_values_near_one(shape):
    gen = torch.Generator().manual_seed(0)
    k = min(shape)
    u0, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=gen))
    v0, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=gen))
    g = u0 @ torch.diag(torch.logspace(-1, 1, k)) @ v0.T       # singular values over two decades
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == g.dtype
    s = torch.linalg.svdvals(o)
    assert 0.4 < float(s.min()) and float(s.max()) < 1.3, (float(s.min()), float(s.max()))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh                                   # the exact orthogonal factor the iteration approximates
    cos = float((o * polar).sum() / (o.norm() * polar.norm()))
    assert cos > 0.9, cos
    # a badly conditioned direction moves as fast as a dominant one (AdamW's scaling would not do this)
    assert float(s.max() / s.min()) < 3
    with pytest.raises(ValueError, match="2-D"):
        orthogonalize(torch.randn(3, 4, 5))


def test_muon_groups_take_the_block_matrices_and_adamw_the_rest(tiny_cfg, tmp_path):
    tr = build_trainer(tiny_cfg("train.optimizer=muon", "train.steps=3", "train.checkpoint_every=0"), tmp_path / "r")
    assert isinstance(tr.optimizer, MuonAdamW)
    names = {id(p): n for n, p in tr.model.named_parameters()}
    muon = [names[id(p)] for g in tr.optimizer.param_groups if g["muon"] for p in g["params"]]
    adam = [names[id(p)] for g in tr.optimizer.param_groups if not g["muon"] for p in g["params"]]
    assert muon and all("blocks." in n and n.endswith("weight") for n in muon), muon
    assert any("qkv" in n for n in muon) and any("mlp" in n or "linear1" in n for n in muon)
    assert not any("blocks." in n and tr.model.get_parameter(n).ndim == 2 for n in adam), adam
    assert any("img_in" in n for n in adam) and any("final_layer.linear" in n for n in adam)
    assert len(muon) + len(adam) == sum(1 for p in tr.model.parameters() if p.requires_grad)
    tr.fit()
    state = tr.optimizer.state
    for g in tr.optimizer.param_groups:
        for p in g["params"]:
            assert set(state[p]) == ({"momentum_buffer"} if g["muon"] else {"step", "exp_avg", "exp_avg_sq"})
    with pytest.raises(ValueError, match="2-D matrices only"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "muon": True}])
    assert not is_hidden_matrix("double_blocks.0.img_attn.qkv.lora_A.weight", torch.zeros(2, 2))


def test_a_muon_run_resumes_its_momentum_and_continues_the_same_run(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.steps=12", "train.checkpoint_every=4", "train.lr=1e-2", "train.optimizer=muon")
    straight = build_trainer(cfg, tmp_path / "a")
    straight.fit()
    final = {k: v.detach().clone() for k, v in straight.model.state_dict().items()}
    from test_train import crash_at
    crash_at(cfg, tmp_path / "b", 7)
    import shutil
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = build_trainer(cfg, tmp_path / "b")
    assert resumed.step == 4
    buffers = [resumed.optimizer.state[p]["momentum_buffer"]
               for g in resumed.optimizer.param_groups if g["muon"] for p in g["params"]]
    assert buffers and all(float(b.abs().sum()) > 0 for b in buffers)
    resumed.fit()
    for k, v in resumed.model.state_dict().items():       # bit for bit the run that never stopped
        assert torch.equal(v, final[k]), k
    # the same resume with the momentum lost trains other weights: the comparison above can fail
    amnesic = build_trainer(cfg, tmp_path / "c")
    for g in amnesic.optimizer.param_groups:
        for p in g["params"] if g["muon"] else ():
            amnesic.optimizer.state[p]["momentum_buffer"].zero_()
    amnesic.fit()
    assert any(not torch.equal(v, final[k]) for k, v in amnesic.model.state_dict().items() if "blocks." in k)


MUON = ["train.steps=8", "train.optimizer=muon", "train.lr=1e-2"]


def _final_weights(cfg, run_dir) -> dict:
    from test_distributed import _full

    from difftrain.parallel.dist import init_distributed
    tr = build_trainer(cfg, run_dir, env=init_distributed(cfg))
    tr.fit()
    return {k: _full(p.detach()).clone() for k, p in tr.model.named_parameters()}


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    from test_distributed import BASE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from test_distributed import _end_group
    torch.set_num_threads(1)
    clean = False
    try:
        weights = _final_weights(load_config(None, BASE + MUON + ["parallel.dp_shard=2"]), f"{out}/two")
        clean = True
    finally:
        _end_group(clean)
    if rank == 0:
        torch.save(weights, f"{out}/two.pt")


@pytest.mark.slow
def test_two_fsdp_ranks_train_the_weights_one_does_under_muon(tmp_path):
    """The sharded path (a DTensor momentum gathered whole for the iteration, the result re-sharded) against one
    process at the same global batch: the final weights of 8 steps, which a shard orthogonalised on its own
    (rows of the matrix apart) would not give."""
    import torch.multiprocessing as mp
    from test_distributed import BASE, _free_port, _rel
    one = _final_weights(load_config(None, BASE + MUON), tmp_path / "one")
    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "two.pt")
    assert two.keys() == one.keys()
    moved = [k for k in one if "blocks." in k and one[k].ndim == 2]
    assert moved
    worst = max((_rel(two[k], one[k]), k) for k in one)
    assert worst[0] <= 1e-4, worst


def test_the_planner_says_what_planning_muon_as_adamw_gets_wrong(capsys):
    import json

    from difftrain.cli import main, resolve_config
    from difftrain.models import build_dit, config_dit_params
    assert main(["plan", "dit-24b", "--gpus", "64", "--gpu-mem", "80", "--nodes", "8", "--json",
                 "--set", "train.optimizer=muon"]) == 0
    notes = [n for n in json.loads(capsys.readouterr().out)["notes"] if "muon" in n]
    dit = build_dit(config_dit_params(load_config(resolve_config("dit-24b"))), device="meta")
    hidden = [p.numel() for n, p in dit.named_parameters() if is_hidden_matrix(n, p)]
    assert len(notes) == 1 and f"{sum(hidden):,} matrix parameters" in notes[0] and f"{max(hidden):,} elements" in notes[0]
    assert main(["plan", "dit-24b", "--gpus", "64", "--gpu-mem", "80", "--nodes", "8", "--json"]) == 0
    assert not [n for n in json.loads(capsys.readouterr().out)["notes"] if "muon" in n]
