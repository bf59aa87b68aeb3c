"""Combinations of keys that no run can build, refused when the config is read (``validate``), not after a run has
started building its model: each refusal one line naming the keys, their values and the way out.

Only what the config alone decides is here; what needs files (the checkpoint ``dpo.init`` names, a store, a base's
folder), the world size or the device is checked where it is read. A config is a DPO config when ``dpo.init`` is set
(``difftrain dpo`` needs it); the DPO refusals apply to those only.
"""

from __future__ import annotations

from difftrain.config.schema import Config
from difftrain.errors import UserError


def adapter_of(cfg: Config) -> tuple[str, str, str] | None:
    """The run's adapter as (kind, the section it comes from, its export), or None: ``[adapter]`` when its kind is
    not 'none', else a DPO config's LoRA reference (``dpo.reference = 'lora'``), else none (every weight trained)."""
    if cfg.adapter.kind != "none":
        return cfg.adapter.kind, "adapter", cfg.adapter.export
    if cfg.dpo.init and cfg.dpo.reference == "lora":
        return "lora", "dpo", cfg.dpo.lora_export
    return None


def check_buildable(cfg: Config, source: str = "config") -> None:
    """Refuse the combinations of keys that a run would refuse while building its model."""
    _check_adapter(cfg, source)
    _check_dpo(cfg, source)
    _check_parallel(cfg, source)
    _check_fp8(cfg, source)
    check_shapes_stages(cfg, source)
    t = cfg.text
    if t.kind == "hf" and t.precision == "fp8" and not t.t5_path:
        raise UserError(f"{source}: text.precision = 'fp8' with text.t5_path = '': fp8 quantizes T5's linear layers "
                        "(CLIP alone stays in text.dtype); set text.t5_path or text.precision = 'native'")


def _check_adapter(cfg: Config, source: str) -> None:
    a, dpo = cfg.adapter, bool(cfg.dpo.init)
    if dpo and a.kind != "none" and cfg.dpo.reference != "lora":
        raise UserError(f"{source}: adapter.kind = {a.kind!r} with dpo.reference = {cfg.dpo.reference!r} (dpo.init "
                        "set): a DPO run with adapters takes its base as the reference; set dpo.reference = 'lora' "
                        "(the adapter is [adapter]'s) or adapter.kind = 'none'")
    if cfg.train.fp8 != "none" and a.kind != "none":
        raise UserError(f"{source}: train.fp8 = {cfg.train.fp8!r} with adapter.kind = {a.kind!r}: float8 training "
                        "converts the linears an adapter wraps; set train.fp8 = 'none' to train the adapter")
    spec = adapter_of(cfg)
    if a.base_precision != "bf16" and spec is None:
        raise UserError(f"{source}: adapter.base_precision = {a.base_precision!r} with adapter.kind = 'none': only "
                        "a frozen base is quantized; set adapter.kind = 'lora' or 'lokr', or "
                        "adapter.base_precision = 'bf16'")
    if spec is None:
        return
    kind, section, export = spec
    if a.base_precision != "bf16":
        if cfg.parallel.cpu_offload:
            raise UserError(f"{source}: adapter.base_precision = {a.base_precision!r} with parallel.cpu_offload = "
                            "true: FSDP's offload leaves the quantized base (not sharded) on the host; set "
                            "parallel.cpu_offload = false (an nf4 base is a quarter of a bf16 one)")
        if cfg.train.compile:
            raise UserError(f"{source}: adapter.base_precision = {a.base_precision!r} with train.compile = true: "
                            "compiling the quantized base's layers is not supported yet; set train.compile = false")
        if export == "merge":
            key = "adapter.export" if section == "adapter" else "dpo.lora_export"
            raise UserError(f"{source}: {key} = 'merge' with adapter.base_precision = {a.base_precision!r}: a "
                            f"merged model would carry the quantized base's error; set {key} = 'adapter' (and fold "
                            "it into the full-precision base: sample --adapter, or difftrain export --adapter)")
    if not dpo and not cfg.model.init_from:
        raise UserError(f"{source}: adapter.kind = {kind!r} with model.init_from = '': an adapter trains on a "
                        "frozen base; set model.init_from to it (a diffusers FLUX transformer folder or a difftrain "
                        "export), or adapter.kind = 'none'")


def _check_dpo(cfg: Config, source: str) -> None:
    d = cfg.dpo
    if not d.init:
        return
    if cfg.parallel.cp != 1:
        raise UserError(f"{source}: parallel.cp = {cfg.parallel.cp} with dpo.init set: DPO compares whole samples' "
                        "errors; set parallel.cp = 1")
    if d.replay_weight and cfg.data.source != "shapes":
        raise UserError(f"{source}: dpo.replay_weight = {d.replay_weight} with data.source = {cfg.data.source!r}: "
                        "replay draws from the shapes source only; set dpo.replay_weight = 0 (or data.source = "
                        "'shapes' for a model of the shapes world)")
    if d.replay_weight and cfg.text.kind == "hf":
        raise UserError(f"{source}: dpo.replay_weight = {d.replay_weight} with text.kind = 'hf': DPO trains a frozen "
                        "encoder's runs from the pairs' cached states and releases the encoder, so replay samples "
                        "could not be encoded; set dpo.replay_weight = 0")


def _check_parallel(cfg: Config, source: str) -> None:
    """What the mesh sizes decide without the world size: two 'rest of the world' sizes; with both data-parallel
    sizes fixed, the shapes source's batch split; offload on a mesh of one process."""
    par = cfg.parallel
    sizes = {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "cp": par.cp}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise UserError(f"{source}: parallel.{free[0]} = -1 with parallel.{free[1]} = -1: at most one mesh size can "
                        f"be 'the rest of the world'; set parallel.{free[0]} to a size")
    if not free and par.cpu_offload and par.dp_replicate * par.dp_shard * par.cp == 1:
        raise UserError(f"{source}: parallel.cpu_offload = true with parallel.dp_replicate = dp_shard = cp = 1: "
                        "offload needs FSDP over more than one process; set parallel.cpu_offload = false or "
                        "parallel.dp_shard = -1")
    if cfg.data.source == "store" or -1 in (par.dp_replicate, par.dp_shard):
        return
    dp, tc = par.dp_replicate * par.dp_shard, cfg.train
    if tc.global_batch % dp:
        raise UserError(f"{source}: train.global_batch = {tc.global_batch} with parallel.dp_replicate x dp_shard = "
                        f"{dp}: the global batch is split over the data-parallel ranks; set train.global_batch to a multiple of {dp}")
    share = tc.global_batch // dp
    if tc.micro_batch and share % tc.micro_batch:
        raise UserError(f"{source}: train.micro_batch = {tc.micro_batch} with train.global_batch = {tc.global_batch} "
                        f"over parallel.dp_replicate x dp_shard = {dp} ranks: the micro-batch must divide each "
                        f"rank's share {share}; set train.micro_batch to a divisor of {share}")


def _check_fp8(cfg: Config, source: str) -> None:
    """Float8 training converts the blocks' linears whose widths are multiples of 16 (not the modulation's): the
    double blocks' need model.hidden to be one; the single blocks' the MLP width too."""
    if cfg.train.fp8 == "none":
        return
    m = cfg.model
    mlp = int(m.hidden * m.mlp_ratio)
    if m.hidden % 16 == 0 and (m.double_blocks or mlp % 16 == 0):
        return
    why = (f"model.hidden = {m.hidden} is not a multiple of 16" if m.hidden % 16 else
           f"the single blocks' MLP width {mlp} (model.hidden x model.mlp_ratio) is not a multiple of 16")
    raise UserError(f"{source}: train.fp8 = {cfg.train.fp8!r} with {why}: no linear layer of the blocks can train in "
                    "float8; set train.fp8 = 'none' or widths that are multiples of 16")


def check_shapes_stages(cfg: Config, source: str) -> None:
    """The shapes source renders each step at ``train.global_batch`` by the config's task weights: a stage may not
    weigh store sources nor set a bucket's global batch to another value."""
    if cfg.data.source != "shapes" or not cfg.data.stages:
        return
    from difftrain.config.stages import parse_stages

    for st in parse_stages(cfg, source):
        if st.mixture:
            raise UserError(f"{source}: data.stages ({st.name!r}).mixture with data.source = 'shapes': the shapes "
                            "source draws tasks by data.t2i_weight/edit_weight/keyframe_weight; set data.source = 'store' or "
                            "remove the mixture")
        for b in st.buckets:
            if b.global_batch != cfg.train.global_batch:
                raise UserError(f"{source}: data.stages ({st.name!r}), bucket {b.name}: global_batch "
                                f"{b.global_batch} with data.source = 'shapes': the shapes source trains every step "
                                f"at train.global_batch ({cfg.train.global_batch}); set the bucket's global_batch to it")


__all__ = ["check_buildable", "check_shapes_stages", "adapter_of"]
