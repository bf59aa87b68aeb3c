"""Process group and device mesh: who this process is, on which device, and where it sits in the
``dp_replicate x dp_shard x cp`` mesh.

Started by torchrun (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT`` from its
rendezvous) or as a plain process (world of one: no process group at all). The mesh is resolved and
checked against the world size, and the global batch against the data-parallel size, before anything
is allocated, so a wrong launch fails in a second with a message naming the key, not after loading a
24B model.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from difftrain.config.schema import Config
from difftrain.errors import UserError

log = logging.getLogger("difftrain.parallel")
MESH_DIMS = ("dp_replicate", "dp_shard", "cp")


def resolve_mesh(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Fill in the one ``-1`` (the rest of the world) and check that the product is the world size."""
    free = [k for k in MESH_DIMS if sizes[k] == -1]
    if len(free) > 1:
        raise UserError(f"parallel.{free[0]} and parallel.{free[1]} are both -1: at most one mesh size can be "
                        "'the rest of the world'")
    fixed = 1
    for k in MESH_DIMS:
        if sizes[k] != -1:
            fixed *= sizes[k]
    out = dict(sizes)
    if free:
        if world % fixed:
            raise UserError(f"parallel.{free[0]} = -1: the other mesh sizes multiply to {fixed}, which does not "
                            f"divide the world size {world}")
        out[free[0]] = world // fixed
    product = out["dp_replicate"] * out["dp_shard"] * out["cp"]
    if product != world:
        shown = " x ".join(f"{k} {out[k]}" for k in MESH_DIMS)
        raise UserError(f"parallel mesh {shown} = {product} processes, but the world size is {world}: set one of "
                        "parallel.dp_replicate / dp_shard / cp to -1, or sizes whose product is the world size")
    return out


def batch_split(global_batch: int, micro_batch: int, dp: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) of one rank for a global batch over ``dp`` data ranks."""
    if global_batch % dp:
        ok = [n for n in range(dp, 4 * dp + 1, dp)]
        raise UserError(f"train.global_batch = {global_batch} is not divisible by the data-parallel size {dp} "
                        f"(dp_replicate x dp_shard): use a multiple of {dp}, e.g. {ok[:3]}")
    share = global_batch // dp
    micro = micro_batch or share
    if share % micro:
        raise UserError(f"train.micro_batch = {micro_batch} must divide the per-rank share {share} of "
                        f"train.global_batch = {global_batch} over {dp} data-parallel ranks")
    return micro, share // micro


@dataclass
class ParallelEnv:
    """Where this process sits. ``mesh`` is None for a world of one (no process group, no wrapping)."""
    world: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    sizes: dict[str, int] | None = None
    mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        return 1 if self.sizes is None else self.sizes["dp_replicate"] * self.sizes["dp_shard"]

    @property
    def cp(self) -> int:
        return 1 if self.sizes is None else self.sizes["cp"]

    @property
    def dp_rank(self) -> int:
        """The loader's rank: this process's data-parallel coordinate (context-parallel peers share data)."""
        if self.mesh is None:
            return 0
        return self.mesh["dp_replicate"].get_local_rank() * self.sizes["dp_shard"] + self.mesh["dp_shard"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["cp"].get_local_rank()

    @property
    def cp_group(self):
        return None if self.mesh is None else self.mesh["cp"].get_group()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards and reduces over: (dp_shard x cp) flattened, with dp_replicate as an outer
        dimension when > 1 (HSDP). None when there is nothing to shard or replicate."""
        if self.mesh is None:
            return None
        shard = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.sizes["dp_replicate"] == 1:
            return shard
        return self.mesh["dp_replicate", "dp_shard_cp"]


def pick_backend(requested: str, has_cuda: bool) -> str:
    if requested == "nccl" and not has_cuda:
        raise UserError("parallel.backend = 'nccl' needs CUDA GPUs, and none is visible here: use 'gloo' "
                        "(or 'auto', which picks gloo on CPUs)")
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    return requested


def check_layout(cfg: Config, world: int) -> dict[str, int]:
    """The mesh sizes for ``world`` processes, after checking that the config can run on them: the mesh, the
    heads over context parallelism and, for the shapes source, ``train.global_batch`` over the data-parallel
    size. A store run has a global batch per bucket (``[[data.stages]]``), which its loader checks; its
    ``train.global_batch`` is not used and not checked."""
    par = cfg.parallel
    sizes = resolve_mesh({"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "cp": par.cp}, world)
    if cfg.model.heads % sizes["cp"]:
        raise UserError(f"parallel.cp = {sizes['cp']} must divide model.heads = {cfg.model.heads}")
    if cfg.data.source != "store":
        batch_split(cfg.train.global_batch, cfg.train.micro_batch, sizes["dp_replicate"] * sizes["dp_shard"])
    return sizes


def init_distributed(cfg: Config) -> ParallelEnv:
    """Read torchrun's environment, check the mesh and batch split, start the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    par = cfg.parallel
    sizes = check_layout(cfg, world)
    has_cuda = torch.cuda.is_available()
    backend = pick_backend(par.backend, has_cuda)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if par.cpu_offload and device.type != "cuda":
        raise UserError("parallel.cpu_offload = true moves sharded state from GPU memory to host memory; this run "
                        "has no GPU (its state is in host memory already): set parallel.cpu_offload = false")
    if par.cpu_offload and world == 1:
        raise UserError("parallel.cpu_offload = true needs FSDP, i.e. more than one process (torchrun "
                        "--nproc-per-node N): a single process keeps its state on its device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return ParallelEnv(1, 0, device)
    if backend == "nccl" and par.cpu_offload:
        # Offloaded gradients are CPU tensors: their norm reduction (and the export's gathers) need gloo.
        backend = "cuda:nccl,cpu:gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=par.startup_timeout_minutes)
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                store=generation_store(rank, world, timeout), rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, tuple(sizes[k] for k in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    env = ParallelEnv(world, rank, device, sizes, mesh)
    env.fsdp_mesh()                                   # create the flattened group now, so its timeout is set
    set_collective_timeout(env, par.startup_timeout_minutes)
    if rank == 0:
        log.info("world %d (%s): %s", world, backend, " x ".join(f"{k} {sizes[k]}" for k in MESH_DIMS))
    return env


def generation_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's key-value store, under a prefix that is new for every start of the job.

    torchrun keeps one store for the whole job (its agents' rendezvous store, ``TORCHELASTIC_USE_AGENT_STORE``)
    and its workers' process groups write their addresses under fixed keys. After a restart, a new worker can
    read the address a dead worker of the previous attempt left there before its peer overwrites it: gloo's
    ``connectFullMesh`` then fails with "Connection refused" (a race, so some restarts work). Restart counts
    cannot name the attempt (each agent keeps its own, and they differ after a membership change), so the
    ranks agree on a generation: rank 0 takes the next number from a counter, and every other rank learns it
    by a handshake keyed by a fresh random nonce and the generation (hello -> ack -> confirm), which no key
left by an earlier attempt can answer."""
    import time
    import uuid

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, world_size=world, is_master=(rank == 0 and not agent), timeout=timeout,
                          multi_tenant=not agent, wait_for_workers=False)
    base = f"difftrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}"
    if rank == 0:
        generation = store.add(f"{base}/generation", 1)
        pending, acked = set(range(1, world)), {}
        deadline = time.monotonic() + timeout.total_seconds()
        while pending:
            for r in sorted(pending):
                if r in acked and store.check([f"{base}/confirm/{acked[r]}/{generation}"]):
                    pending.discard(r)
                    continue
                if store.check([f"{base}/hello/{r}"]):
                    nonce = store.get(f"{base}/hello/{r}").decode()
                    if acked.get(r) != nonce:        # a stale hello is acked too, harmlessly: no one confirms it
                        store.set(f"{base}/ack/{nonce}", str(generation))
                        acked[r] = nonce
            if pending:
                if time.monotonic() > deadline:
                    raise UserError(f"ranks {sorted(pending)[:16]} did not join within {timeout} (start-up "
                                    "timeout, parallel.startup_timeout_minutes)")
                time.sleep(0.02)
    else:
        nonce = uuid.uuid4().hex
        store.set(f"{base}/hello/{rank}", nonce)
        generation = int(store.get(f"{base}/ack/{nonce}").decode())   # waits (store timeout)
        store.set(f"{base}/confirm/{nonce}/{generation}", "1")
    return dist.PrefixStore(f"{base}/g{generation}", store)


def set_collective_timeout(env: ParallelEnv, minutes: float, extra=()) -> None:
    """Set the collective timeout of every process group the run uses: the default group, the mesh's (FSDP and
    context-parallel traffic runs on those, which otherwise keep the backend's default) and ``extra`` (the
    checkpointer's own gloo group). Called with the long start-up allowance (compilation, checkpoint loading),
    then tightened after the first steps so that a hung rank is detected in minutes. Uses c10d's private setter
    (no public API yet)."""
    setter = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if not dist.is_initialized() or setter is None or env.mesh is None:
        return
    groups = {id(g): g for g in [dist.group.WORLD, *env.mesh.get_all_groups(), *env.fsdp_mesh().get_all_groups(),
                                 *(g for g in extra if g is not None)]}
    for group in groups.values():
        setter(datetime.timedelta(minutes=minutes), group)


def agree(error: str | None) -> str | None:
    """The verdict, on every rank, of work some ranks did alone (rank 0 sealing a checkpoint, writing the export):
    None when it succeeded everywhere, else the failed ranks' errors, the same text on every rank. A collective:
    every rank calls it at the same point, so that a failure on one rank ends the others' wait at once instead of
    leaving them in the next collective until the timeout."""
    if not dist.is_initialized():
        return error
    flag = torch.tensor([0.0 if error is None else 1.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None) or "a rank failed"


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's value on every rank."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t.item())


def all_reduce_sum_on_device(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, left on its device (no host sync; a no-op in a world of one)."""
    if dist.is_initialized():
        dist.all_reduce(values)
    return values


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows (the same count on each), concatenated in rank order, on the device (no host sync;
    the tensor itself in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, rows.contiguous())
    return torch.cat(parts)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum scalars over all ranks in one collective (a no-op in a world of one)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def shutdown(clean: bool = True) -> None:
    """End the process group. After a clean run every rank first waits for the others (a rank tearing gloo
    down while a peer still has a collective in flight can abort the job at exit); after an error it does
    not wait, since a failed peer would never arrive."""
    if dist.is_initialized():
        try:
            if clean:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` without a process group."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out
