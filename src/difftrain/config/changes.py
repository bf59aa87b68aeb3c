"""Which config keys differ between a checkpoint and the run that resumes it, and which may."""

from __future__ import annotations

import dataclasses

from difftrain.config.schema import AdapterConfig, DPOConfig

# Keys a resumed run may change without --allow-config-change: how the job runs, not what it computes.
ALWAYS_CHANGEABLE = ("run.out_dir", "parallel.", "train.steps", "train.minutes", "train.log_every",
                     "train.sample_every", "train.checkpoint_every", "train.keep_checkpoints", "train.keep_every",
                     "train.async_checkpoint", "train.checkpoint_timeout", "train.max_failed_saves",
                     "train.metrics_port", "train.peak_tflops", "train.threads",
                     "train.compile", "train.export_dtype", "train.schedule_change",
                     "train.compile_cache", "train.micro_batch", "data.read_threads", "data.prefetch",
                     "data.cache_dir", "data.cache_gb", "data.cache_lookahead", "data.max_error_rate", "sample.", "preview.",
                     "eval.", "health.", "data.encoder_actors", "data.encoder_device",
                     "attention.",      # a kernel computes the math kernel's attention within its tolerance
                     "validation.every", "validation.n", "validation.timesteps", "validation.seed",
                     "validation.ema")  # measuring: validation.source changes what training reads

# Keys added after a checkpoint was written, with the value that computes what that checkpoint's release did:
# a saved config without the key and a run with that value are the same run.
EARLIER_BEHAVIOUR = {"model.positions": "corner", "text.precision": "native", "train.fp8": "none",
                     "validation.source": "", "train.optimizer": "adamw", "train.muon_momentum": 0.95,
                     "train.muon_ns_steps": 5, "data.edit_changed_weight": 1.0}


def _section_defaults(section: str, cls) -> dict:
    return {f"{section}.{f.name}": (f.default_factory() if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls)}


# The [dpo] and [adapter] sections came later: a checkpoint without one was trained as a run with its defaults is.
EARLIER_BEHAVIOUR.update(_section_defaults("dpo", DPOConfig))
EARLIER_BEHAVIOUR.update(_section_defaults("adapter", AdapterConfig))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "sources":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """Keys whose value differs between a checkpoint's config and this run's, other than those that may
    change; each as 'key: saved -> now'."""
    a, b = _flat(saved), _flat(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key.startswith(ALWAYS_CHANGEABLE):
            continue
        if key not in a and key in EARLIER_BEHAVIOUR and b.get(key) == EARLIER_BEHAVIOUR[key]:
            continue
        if any(key == x or key.startswith(x.rstrip(".") + ".") for x in allowed):
            continue
        out.append(f"{key}: {a.get(key, '(absent)')!r} -> {b.get(key, '(absent)')!r}")
    return out
