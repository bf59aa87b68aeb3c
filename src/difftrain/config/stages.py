"""The curriculum's schema: stages of resolution buckets and source mixtures, each starting at a step.

A stage (``[[data.stages]]``) names its buckets, the mixture of sources it draws from (broad data
first, curated later) and the step at which it starts. A bucket is one image shape (h x w pixels,
both sides multiples of the autoencoder factor x the 2x2 patch), with its own global batch and a
largest micro-batch, chosen so every micro-step costs about the same: given ``micro_cost`` M and
``cost_power`` p, a micro-batch of a sample of S tokens holds at most floor(M / S^p) samples (p = 1:
tokens; p > 1 weighs attention's quadratic part). Gradient accumulation follows from the global
batch, the data-parallel size and that micro-batch, so balance and elastic resume hold together.

    [[data.stages]]
    name = "low"
    start_step = 0
    buckets = [[48, 48], [48, 80], [80, 48]]     # or: area = 2304, aspects = [0.6, 1.0, 1.67]
    global_batch = 32                            # per bucket, or {size = [h, w], global_batch = ..} entries
    micro_cost = 1024                            # 0 = train.micro_batch
    mixture = {shapes-t2i = 0.2, shapes-edit = 0.5, shapes-keyframes = 0.3}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from difftrain.config.autoencoder import autoencoder_geometry
from difftrain.errors import UserError

_STAGE_KEYS = {"name", "start_step", "buckets", "area", "aspects", "global_batch", "micro_batch", "micro_cost",
               "cost_power", "crop", "mixture"}
_BUCKET_KEYS = {"size", "global_batch", "micro_batch"}


@dataclass(frozen=True)
class Bucket:
    h: int                    # pixels
    w: int
    global_batch: int         # samples per optimizer step drawn from this bucket (all ranks)
    micro_batch: int = 0      # most samples per micro-step and rank (0 = from micro_cost, or the whole share)
    micro_cost: float = 0.0   # M of the B * S^p <= M rule (0 = off)
    cost_power: float = 1.0
    patch: int = 16           # pixels per token side (autoencoder factor x 2)

    @property
    def name(self) -> str:
        return f"{self.h}x{self.w}"

    def tokens(self, frames: int = 1) -> int:
        return frames * (self.h // self.patch) * (self.w // self.patch)

    def micro_for(self, frames: int, share: int) -> int:
        """Largest micro-batch for examples of ``frames`` frames, given a rank's share of the global batch."""
        if self.micro_batch:
            return min(self.micro_batch, share)
        if self.micro_cost:
            return max(1, min(share, int(self.micro_cost // (self.tokens(frames) ** self.cost_power))))
        return share


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    start_step: int
    buckets: tuple[Bucket, ...]
    crop: str = "center"
    mixture: dict[str, float] = field(default_factory=dict)   # source -> weight ({} = the config's task weights)

    def bucket(self, name: str) -> Bucket:
        for b in self.buckets:
            if b.name == name:
                return b
        raise KeyError(f"stage {self.name!r} has no bucket {name!r}; it has {[b.name for b in self.buckets]}")


def patch_pixels(cfg, strict: bool = False) -> int:
    """Pixels per token side: the autoencoder's spatial factor x the 2x2 patch (``strict``: see
    ``autoencoder_geometry``)."""
    return autoencoder_geometry(cfg.autoencoder, strict)[1] * 2


def _int(value, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise UserError(f"{where} = {value!r}: expected an integer >= {lo}")
    return value


def _num(value, where: str, lo: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
        raise UserError(f"{where} = {value!r}: expected a number >= {lo}")
    return float(value)


def parse_stages(cfg, source: str = "config", strict: bool = False) -> list[Stage]:
    """``data.stages`` as checked ``Stage`` objects (a single default stage at data.image_size when empty).
    ``strict``: the autoencoder's folder must be there (what encodes or reads latents)."""
    m = patch_pixels(cfg, strict)
    raw = cfg.data.stages or [{"name": "base", "start_step": 0,
                               "buckets": [[cfg.data.image_size, cfg.data.image_size]]}]
    stages: list[Stage] = []
    for i, st in enumerate(raw):
        where = f"{source}: data.stages[{i}]"
        if not isinstance(st, dict):
            raise UserError(f"{where}: expected a table, got {st!r}")
        unknown = set(st) - _STAGE_KEYS
        if unknown:
            raise UserError(f"{where}: unknown key(s) {sorted(unknown)}; a stage has {sorted(_STAGE_KEYS)}")
        name = st.get("name", f"stage{i}")
        if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
            raise UserError(f"{where}.name = {name!r}: expected letters, digits, '-' or '_'")
        start = _int(st.get("start_step", 0), f"{where}.start_step")
        if i == 0 and start != 0:
            raise UserError(f"{where}.start_step = {start}: the first stage must start at step 0")
        if stages and start <= stages[-1].start_step:
            raise UserError(f"{where}.start_step = {start}: stages must start at increasing steps "
                            f"(the previous one starts at {stages[-1].start_step})")
        gb = _int(st.get("global_batch", cfg.train.global_batch), f"{where}.global_batch", 1)
        mb = _int(st.get("micro_batch", cfg.train.micro_batch), f"{where}.micro_batch")
        cost = _num(st.get("micro_cost", 0), f"{where}.micro_cost")
        power = _num(st.get("cost_power", 1.0), f"{where}.cost_power", 0.5)
        crop = st.get("crop", "center")
        if crop not in ("center", "random"):
            raise UserError(f"{where}.crop = {crop!r}: expected 'center' or 'random'")
        entries = st.get("buckets")
        if entries is None:
            if "area" not in st or "aspects" not in st:
                raise UserError(f"{where}: give buckets = [[h, w], ...] or area = pixels and aspects = [w/h, ...]")
            area = _num(st["area"], f"{where}.area", 1)
            entries = []
            for j, a in enumerate(st["aspects"]):
                a = _num(a, f"{where}.aspects[{j}]", 1e-3)
                size = [max(m, round(math.sqrt(area / a) / m) * m), max(m, round(math.sqrt(area * a) / m) * m)]
                if size not in entries:
                    entries.append(size)
        if not isinstance(entries, list) or not entries:
            raise UserError(f"{where}.buckets = {entries!r}: expected a non-empty list")
        buckets: list[Bucket] = []
        for j, e in enumerate(entries):
            bw = f"{where}.buckets[{j}]"
            b_gb, b_mb = gb, mb
            if isinstance(e, dict):
                extra = set(e) - _BUCKET_KEYS
                if extra:
                    raise UserError(f"{bw}: unknown key(s) {sorted(extra)}; a bucket has {sorted(_BUCKET_KEYS)}")
                b_gb = _int(e.get("global_batch", gb), f"{bw}.global_batch", 1)
                b_mb = _int(e.get("micro_batch", mb), f"{bw}.micro_batch")
                e = e.get("size")
            if not (isinstance(e, list) and len(e) == 2):
                raise UserError(f"{bw} = {e!r}: expected [height, width] in pixels")
            h, w = (_int(v, bw, 1) for v in e)
            if h % m or w % m:
                raise UserError(f"{bw} = [{h}, {w}]: both sides must be multiples of {m} (autoencoder factor x the "
                                "2x2 patch)")
            if any(b.h == h and b.w == w for b in buckets):
                raise UserError(f"{bw} = [{h}, {w}]: listed twice")
            buckets.append(Bucket(h, w, b_gb, b_mb, cost, power, m))
        mixture = st.get("mixture", {})
        if not isinstance(mixture, dict) or any(_num(v, f"{where}.mixture.{k}") < 0 for k, v in mixture.items()):
            raise UserError(f"{where}.mixture = {mixture!r}: expected {{source = weight >= 0, ...}}")
        if mixture and sum(mixture.values()) <= 0:
            raise UserError(f"{where}.mixture: the weights sum to 0")
        if any(s.name == name for s in stages):
            raise UserError(f"{where}.name = {name!r}: two stages have this name")
        stages.append(Stage(i, name, start, tuple(buckets), crop, {k: float(v) for k, v in mixture.items()}))
    return stages
