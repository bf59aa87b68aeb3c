"""train.optimizer = "muon": the Newton-Schulz orthogonalisation, which parameters it takes (a repeated batch's
falling loss: tests/test_train.py), a crash and resume that continues the same run bit for bit, two FSDP2 ranks
(gloo) that train what one does, and the owner layout of the sharded step (each matrix orthogonalised on one rank)
against every rank gathering every matrix: the same update on 2 and 4 ranks for 2/N of the bytes or less."""

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
    """The sharded path (each matrix's momentum sent to its owner rank for the iteration, the result's rows sent
    back) against one
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
    assert "one owner rank of the 64" in notes[0] and "receives the whole of the matrices it owns" in notes[0]
    assert main(["plan", "dit-24b", "--gpus", "64", "--gpu-mem", "80", "--nodes", "8", "--json"]) == 0
    assert not [n for n in json.loads(capsys.readouterr().out)["notes"] if "muon" in n]


# rows not divisible by 2 or 4, a matrix with fewer rows than ranks (an empty shard at 4), wide and tall ones
OWNER_SHAPES = [(37, 20), (64, 48), (5, 33), (3, 17), (128, 16), (50, 50), (9, 70), (21, 96)]


def _owner_worker(rank: int, world: int, port: int, out: str) -> None:
    """Two FSDP2-sharded copies of the same matrices, stepped by the owner layout and by the whole-matrix gather on
    the same gradients (several steps, weight decay); the bytes each path moves between ranks, counted by wrapping
    the collectives it calls."""
    import os

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = torch.nn.Sequential(*[torch.nn.Linear(c, r, bias=False) for r, c in OWNER_SHAPES])
        models = {}
        for owner in (True, False):
            m = torch.nn.Sequential(*[torch.nn.Linear(c, r, bias=False) for r, c in OWNER_SHAPES])
            m.load_state_dict(base.state_dict())
            for layer in m:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            opt = MuonAdamW([{"params": list(m.parameters()), "muon": True, "weight_decay": 0.1}], lr=0.02,
                            owner_layout=owner)
            models[owner] = (m, opt)
        traffic = {True: [0, 0], False: [0, 0]}      # bytes sent to and received from other ranks
        a2a, gather = dist.all_to_all_single, funcol.all_gather_single

        def counted_a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            e = input.element_size()
            traffic[True][0] += (input.numel() - input_split_sizes[rank]) * e
            traffic[True][1] += (output.numel() - output_split_sizes[rank]) * e
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def counted_gather(t, gather_dim, group, tag=""):
            result = gather(t, gather_dim, group, tag)
            b = t.numel() * t.element_size()
            traffic[False][0] += (world - 1) * b            # this rank's shard reaches every other rank
            traffic[False][1] += result.numel() * result.element_size() - b
            return result

        dist.all_to_all_single, funcol.all_gather_single = counted_a2a, counted_gather
        try:
            for step in range(3):
                gen = torch.Generator().manual_seed(100 + step)
                grads = [torch.randn(r, c, generator=gen) * (1 + i) for i, (r, c) in enumerate(OWNER_SHAPES)]
                for owner, (m, opt) in models.items():
                    for p, g in zip(m.parameters(), grads):
                        assert p.to_local().shape[0] == -(-g.shape[0] // world) or g.shape[0] % world  # uneven
                        p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
                    opt.step()
        finally:
            dist.all_to_all_single, funcol.all_gather_single = a2a, gather
        full = {owner: [p.full_tensor() for p in m.parameters()] for owner, (m, _) in models.items()}
        buffers = {owner: [opt.state[p]["momentum_buffer"].full_tensor() for p in m.parameters()]
                   for owner, (m, opt) in models.items()}
        moved = max(float((a - b.detach()).abs().max()) for a, b in zip(full[True], base.parameters()))
        torch.save({"diff": max(float((a - b).abs().max()) for a, b in zip(full[True], full[False])),
                    "buffer_diff": max(float((a - b).abs().max()) for a, b in zip(buffers[True], buffers[False])),
                    "moved": moved, "traffic": traffic,
                    "owned": models[True][1].owned_orthogonalized, "whole": models[True][1].whole_orthogonalized,
                    "ref_whole": models[False][1].whole_orthogonalized,
                    "local_rows": [p.to_local().shape[0] for p in models[True][0].parameters()]},
                   f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def muon_traffic(world: int, tmp_path) -> dict:
    """One run of ``_owner_worker`` on ``world`` gloo ranks: every rank's bytes moved by the owner layout over the
    gather's, and the largest difference of their weights (``bench/scale_reads.py`` reports it)."""
    import torch.multiprocessing as mp
    from test_distributed import _free_port
    mp.spawn(_owner_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ratios = [sum(g["traffic"][True]) / sum(g["traffic"][False]) for g in got]
    return {"muon_bytes_ratio": round(max(ratios), 4), "muon_bytes_ratio_by_rank": [round(x, 4) for x in ratios],
            "muon_max_abs_diff": max(g["diff"] for g in got), "muon_ranks": world}


@pytest.mark.parametrize("world", [2, 4])
def test_the_owner_layout_gives_the_gathered_update_for_a_fraction_of_the_bytes(world, tmp_path):
    """Each sharded matrix orthogonalised by one owner rank (its shards sent there, the result's rows sent back)
    against every rank gathering every matrix whole: the same weights and momentum to 1e-6 after 3 steps with weight
    decay, each matrix orthogonalised once a step over all ranks, and at most 2/N of the bytes a rank moves."""
    import torch.multiprocessing as mp
    from test_distributed import _free_port
    mp.spawn(_owner_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    from difftrain.train.muon import shard_rows
    for r, g in enumerate(got):                       # FSDP2's row split, the one the exchange computes
        assert g["local_rows"] == [shard_rows(rows, world)[r] for rows, _ in OWNER_SHAPES]
    assert world != 4 or 0 in got[-1]["local_rows"]  # an empty shard took part
    assert all(g["moved"] > 1e-3 for g in got)
    diff = max(g["diff"] for g in got)
    assert diff <= 1e-6 and max(g["buffer_diff"] for g in got) <= 1e-6, diff
    assert sum(g["owned"] for g in got) == 3 * len(OWNER_SHAPES) and all(g["whole"] == 0 for g in got)
    assert all(g["owned"] > 0 for g in got)           # the work is spread over the ranks
    assert all(g["ref_whole"] == 3 * len(OWNER_SHAPES) for g in got)
    ratios = [sum(g["traffic"][True]) / sum(g["traffic"][False]) for g in got]
    print(f"\nmuon owner layout, {world} gloo ranks: max |owner - gathered| {diff:.3g}; bytes a rank sends and "
          f"receives, owner / gathered: {', '.join(f'{x:.3f}' for x in ratios)} (limit 2/N = {2 / world:.3f})")
    assert all(g["traffic"][False][0] > 0 and g["traffic"][True][0] > 0 for g in got)
    assert max(ratios) <= 2 / world, ratios


def test_owners_are_balanced_and_the_same_for_the_same_order():
    from difftrain.train.muon import assign_owners, shard_rows
    owners = assign_owners(OWNER_SHAPES, 4)
    assert owners == assign_owners(list(OWNER_SHAPES), 4) and set(owners) == {0, 1, 2, 3}
    even = [(64, 8), (64, 8), (32, 8), (32, 8), (16, 8), (16, 8), (16, 8), (16, 8)]     # rows divisible by 4
    load = [sum(r * c for (r, c), o in zip(even, assign_owners(even, 4)) if o == k) for k in range(4)]
    assert load == [512] * 4, load
    assert shard_rows(5, 4) == [2, 2, 1, 0] and shard_rows(3, 4) == [1, 1, 1, 0] and shard_rows(8, 4) == [2] * 4
