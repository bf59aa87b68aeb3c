"""Muon for a transformer's hidden matrices, AdamW for every other parameter, in one optimizer.

Muon (momentum orthogonalised by a Newton-Schulz iteration) updates each hidden 2-D weight by an approximately
orthogonal matrix: every direction of the momentum moves at the same rate, where AdamW's per-element scaling lets a
few directions dominate. Embeddings, the output layer, norms and biases keep AdamW, as the method prescribes.

One ``torch.optim.Optimizer`` holds both kinds of group (``group["muon"]``), so the trainer's LR schedule, gradient
clipping, checkpoints (DCP's flattened optimizer state: ``momentum_buffer`` for a Muon parameter, ``exp_avg`` /
``exp_avg_sq`` / ``step`` for an AdamW one) and resumption treat it like AdamW.

The update's scale follows Moonlight ("Muon is scalable for LLM training"): the orthogonalised matrix times
``0.2 * sqrt(max(rows, cols))``, the RMS of an AdamW update, so that Muon and AdamW groups share one learning rate
and one schedule. The iteration runs in float32 on a CPU (this kind of CPU multiplies bfloat16 matrices five times
slower than float32 ones) and in bfloat16 on an accelerator.

A sharded matrix (a DTensor, FSDP2's Shard(0) over the data-parallel mesh) has one owner rank, assigned from the
group's parameter order by size (largest first, each to the rank that then moves the fewest bytes), so every rank
agrees without talking. Each rank sends its shard of every matrix's update to that matrix's owner and receives the
other ranks' shards of the matrices it owns; the owner runs the iteration on the whole matrix and sends each rank its
rows of the result back: two ``all_to_all_single`` a step for all the matrices of a group (gloo and NCCL both have it,
with uneven splits), in float32 (the update's precision, or wider). Per step a rank sends its shards once and
receives the whole of the matrices it owns, then the reverse: about 4 (N-1)/N^2 of the matrices' bytes a rank on N
ranks, where gathering every matrix whole to every rank moves about 2 (N-1)/N, and each rank runs the iteration on
about 1/N of the matrices. The update is the one a single device computes. The step holds every matrix's update
shard at once, and an owner its matrices whole. A plain tensor, a mesh of one rank and other layouts (a shard over
another dimension, tensor parallelism) keep the iteration on the matrix gathered whole on every rank
(``_orthogonalize_gathered``). ``difftrain plan`` plans a Muon run as AdamW and says by how much that overstates the
state and what the exchange moves.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim.adamw import adamw

# the quintic iteration's coefficients (K. Jordan, "Muon: an optimizer for hidden layers in neural networks", 2024)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> Tensor:
    """An approximately orthogonal matrix with ``g``'s singular vectors (singular values near 1, within about
    0.5–1.5 after 5 steps), by the quintic Newton-Schulz iteration; returned in ``g``'s dtype."""
    if g.ndim != 2:
        raise ValueError(f"orthogonalize: expected a 2-D matrix, got shape {tuple(g.shape)}")
    if dtype is None:
        dtype = torch.float32 if g.device.type == "cpu" else torch.bfloat16
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)             # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.T).to(g.dtype)


def is_hidden_matrix(name: str, p: Tensor) -> bool:
    """A 2-D weight inside a transformer block (attention, MLP, modulation), the parameters Muon is for; the
    input and output projections, embeddings, norms and biases are not."""
    return p.ndim == 2 and ("double_blocks." in name or "single_blocks." in name) and "lora" not in name


class MuonAdamW(torch.optim.Optimizer):
    """Muon for groups with ``muon=True``, AdamW for the others; hyper-parameters per group as torch's optimizers'
    (``lr``, ``weight_decay``; ``momentum``, ``nesterov``, ``ns_steps`` for Muon; ``betas``, ``eps`` for AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 owner_layout: bool = True):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 1 <= ns_steps <= 20:
            raise ValueError(f"ns_steps must be in [1, 20], got {ns_steps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, muon=False))
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.ndim != 2:
                        raise ValueError(f"a Muon group holds a parameter of shape {tuple(p.shape)}: Muon updates "
                                         "2-D matrices only (put the others in an AdamW group)")
        # False: every sharded matrix gathered whole on every rank (the reference the owner layout must equal)
        self.owner_layout = owner_layout
        # matrices this rank orthogonalised as their owner, and matrices orthogonalised gathered or unsharded
        self.owned_orthogonalized = 0
        self.whole_orthogonalized = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
        params, updates = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            params.append(p)
            updates.append(g.lerp(buf, mu) if group["nesterov"] else buf)
        out: list[Tensor | None] = [None] * len(updates)
        exchanges: dict[tuple, list[int]] = {}       # (mesh, mesh dim) -> the matrices sharded over it
        for i, u in enumerate(updates):
            where = _owner_layout(u) if self.owner_layout else None
            if where is None:
                out[i] = _orthogonalize_gathered(u, group["ns_steps"])
                self.whole_orthogonalized += 1
            else:
                exchanges.setdefault(where, []).append(i)
        for (mesh, dim), idx in exchanges.items():
            done, owned = _orthogonalize_owned([updates[i] for i in idx], mesh, dim, group["ns_steps"])
            self.owned_orthogonalized += owned
            for i, o in zip(idx, done):
                out[i] = o
        for p, o in zip(params, out):
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, group: dict) -> None:
        # fused (one vectorised kernel a tensor) where every parameter is a plain tensor, as the trainer's AdamW
        live = [p for p in group["params"] if p.grad is not None]
        fused = all(type(p) is Tensor and p.device.type in ("cpu", "cuda") for p in live)
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in live:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        adamw(params, grads, avgs, sqs, [], steps, foreach=not fused, fused=fused or None, amsgrad=False,
              beta1=group["betas"][0], beta2=group["betas"][1], lr=float(group["lr"]),
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def _orthogonalize_gathered(update: Tensor, steps: int) -> Tensor:
    """``orthogonalize`` of a plain tensor, or of a DTensor gathered whole on every rank and redistributed as it was
    sharded."""
    if isinstance(update, DTensor):
        whole = orthogonalize(update.full_tensor(), steps)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return orthogonalize(update, steps)


def _owner_layout(update: Tensor) -> tuple | None:
    """(mesh, mesh dim) for a DTensor sharded by rows over one dimension of a mesh of 2+ ranks and replicated over
    any other (FSDP2, HSDP); None for anything else."""
    if not isinstance(update, DTensor):
        return None
    mesh, placements = update.device_mesh, update.placements
    sharded = [d for d, q in enumerate(placements) if not q.is_replicate()]
    if len(sharded) != 1:
        return None
    d = sharded[0]
    q = placements[d]
    if type(q) is not Shard or q.dim != 0 or mesh.size(d) < 2:    # _StridedShard (TP under FSDP) is a Shard too
        return None
    return mesh, d


def shard_rows(rows: int, n: int) -> list[int]:
    """Rows of each of ``n`` Shard(0) shards of a ``rows``-row matrix: torch.chunk's split (ceil(rows / n) a rank,
    the last ones short or empty), which DTensor and FSDP2 use."""
    c = -(-rows // n)
    return [max(0, min(c, rows - i * c)) for i in range(n)]


def assign_owners(shapes: list[tuple[int, int]], n: int) -> list[int]:
    """An owner rank for each matrix of ``shapes`` (row-sharded over ``n`` ranks): the largest first, each to the
    rank that then moves the fewest bytes (it receives the matrix less its own rows and no longer sends those; the
    lowest such rank), so every rank computes the same owners from the same order. With rows divisible by ``n``
    this is the rank owning the fewest elements so far: the ranks' iteration work is balanced too."""
    rows = [shard_rows(r, n) for r, _ in shapes]
    load = [sum(rs[k] * c for rs, (_, c) in zip(rows, shapes)) for k in range(n)]    # every shard sent away
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        r, c = shapes[i]
        k = min(range(n), key=lambda k: (load[k] + r * c - 2 * rows[i][k] * c, k))
        owners[i] = k
        load[k] += r * c - 2 * rows[i][k] * c
    return owners


def _orthogonalize_owned(updates: list[DTensor], mesh, dim: int, steps: int) -> tuple[list[DTensor], int]:
    """``orthogonalize`` of each DTensor of ``updates`` (row shards over ``mesh``'s dimension ``dim``) on its owner
    rank: one all-to-all sends every rank's shards to the owners, the owners run the iteration on the whole
    matrices, a second all-to-all returns each rank its rows of the results. Returns the results sharded as the
    updates are, and how many matrices this rank orthogonalised."""
    group, n, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    shapes = [tuple(u.shape) for u in updates]
    rows = [shard_rows(r, n) for r, _ in shapes]
    owners = assign_owners(shapes, n)
    shards = [u.to_local() for u in updates]
    for s, (r, c), rs in zip(shards, shapes, rows):
        if tuple(s.shape) != (rs[me], c):
            raise RuntimeError(f"Muon: a shard of a {r} x {c} matrix has shape {tuple(s.shape)} on mesh rank {me}, "
                               f"not the row split {rs} it expects")
    device = shards[0].device
    wire = torch.float32                # the fp32 master update (today's full_tensor), also for a narrower one
    to_owner = sorted(range(len(updates)), key=lambda i: (owners[i], i))
    mine = [i for i in to_owner if owners[i] == me]
    send_splits = [sum(rows[i][me] * shapes[i][1] for i in to_owner if owners[i] == k) for k in range(n)]
    recv_splits = [sum(rows[i][s] * shapes[i][1] for i in mine) for s in range(n)]

    send = _flat([shards[i] for i in to_owner], wire, device)
    recv = torch.empty(sum(recv_splits), dtype=wire, device=device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    del send

    # recv: by source rank, then the matrices this rank owns in order; stitch each matrix from its rows
    pieces: dict[int, list[Tensor]] = {i: [] for i in mine}
    at = 0
    for s in range(n):
        for i in mine:
            k = rows[i][s] * shapes[i][1]
            pieces[i].append(recv[at:at + k])
            at += k
    results = {}
    for i in mine:
        whole = torch.cat(pieces[i]).view(shapes[i]).to(updates[i].dtype)
        results[i] = orthogonalize(whole, steps).to(wire)
    del recv, pieces

    back = _flat([results[i][sum(rows[i][:s]):sum(rows[i][:s + 1])] for s in range(n) for i in mine], wire, device)
    del results
    got = torch.empty(sum(send_splits), dtype=wire, device=device)
    dist.all_to_all_single(got, back, send_splits, recv_splits, group=group)
    del back

    done: list[DTensor | None] = [None] * len(updates)
    at = 0
    for i in to_owner:
        k = rows[i][me] * shapes[i][1]
        local = got[at:at + k].view(rows[i][me], shapes[i][1]).to(updates[i].dtype)
        done[i] = DTensor.from_local(local, mesh, updates[i].placements, run_check=False, shape=updates[i].shape,
                                     stride=updates[i].stride())
        at += k
    return done, len(mine)


def _flat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``parts`` flattened and concatenated in ``dtype`` on ``device`` (an empty tensor for none)."""
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(device=device, dtype=dtype) for t in parts])
