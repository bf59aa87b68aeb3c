"""``difftrain candidates CKPT PROMPTS --k K --out DIR``: K candidates per prompt, for raters and for DPO.

PROMPTS is a text file (one text-to-image prompt a line) or JSONL, one object a line: ``prompt``, ``task``
(``t2i``, ``edit`` with ``source``, an image path relative to the file, or ``keyframes`` with ``frames``), an
optional ``id``. Every image gets its own initial-noise seed, a function of (``--seed``, prompt id, k) only:
candidates of two checkpoints on the same prompts and seeds form a comparison batch.

DIR holds ``manifest.json`` (the checkpoint's path, step and digest, the weights used, the sampler settings, the
prompts), ``candidates.jsonl`` (one line per candidate, appended once its PNG is in place: id, prompt id, prompt,
task, k, seed, noise seed, image path(s) and source image, relative to DIR), ``images/`` (PNGs with no metadata:
what was used to make an image is in the manifest, never in the image) and ``sources/`` (an edit's source image
copied in as a PNG: every path a line names lies inside DIR, as the rating app requires). A killed run keeps
every candidate it recorded; rerun the same command to finish. Under torchrun the model is sharded (as
``sample``) and each rank generates its slice of every batch; rank 0 writes.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from difftrain.errors import UserError

FORMAT = "difftrain-candidates-1"
TASKS = ("t2i", "edit", "keyframes")


@dataclass
class Prompt:
    id: str
    prompt: str
    task: str = "t2i"
    source: str = ""                     # the edit's source image (absolute path)
    frames: int = 0                      # keyframes to generate
    line: int = field(default=0, compare=False)


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a .txt or .jsonl file, checked line by line (task, source image, frames, unique ids)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: prompts file not found")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 text ({e})") from None
    out: list[Prompt] = []
    jsonl = p.suffix == ".jsonl"
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{p}:{n}"
        if not jsonl:
            out.append(Prompt(f"p{n:06d}", raw.strip(), line=n))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UserError(f"{where}: expected an object with a string 'prompt'")
        unknown = set(obj) - {"id", "prompt", "task", "source", "frames"}
        if unknown:
            raise UserError(f"{where}: unknown key(s) {sorted(unknown)}; expected id, prompt, task, source, frames")
        task = obj.get("task", "t2i")
        if task not in TASKS:
            raise UserError(f"{where}: task {task!r}, expected one of {TASKS}")
        source = ""
        if task == "edit":
            if not obj.get("source"):
                raise UserError(f"{where}: an edit needs 'source' (the image to edit)")
            src = Path(obj["source"])
            src = src if src.is_absolute() else p.parent / src
            if not src.is_file():
                raise UserError(f"{where}: source image {src} not found")
            source = str(src.resolve())
        frames = 0
        if task == "keyframes":
            frames = obj.get("frames")
            if not isinstance(frames, int) or frames < 1:
                raise UserError(f"{where}: keyframes need 'frames', a whole number >= 1, got {frames!r}")
        out.append(Prompt(str(obj.get("id", f"p{n:06d}")), obj["prompt"], task, source, frames, n))
    if not out:
        raise UserError(f"{p}: no prompts in it")
    seen: dict[str, int] = {}
    for q in out:
        if q.id in seen:
            raise UserError(f"{p}:{q.line}: prompt id {q.id!r} already used on line {seen[q.id]}")
        seen[q.id] = q.line
    return out


def noise_seed(seed: int, prompt_id: str, k: int) -> int:
    """The initial-noise seed of candidate k of a prompt: the same for every checkpoint."""
    state = np.random.SeedSequence([seed, zlib.crc32(prompt_id.encode()), k]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def candidate_id(prompt_id: str, k: int) -> str:
    return f"{prompt_id}-{k}"


def _done(path: Path) -> set[str]:
    """Candidates recorded by an earlier run (a line cut short by a kill is ignored and rewritten)."""
    done: set[str] = set()
    if not path.is_file():
        return done
    good = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            done.add(json.loads(raw)["id"])
            good.append(raw)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(f"{g}\n" for g in good), encoding="utf-8")       # drop a torn last line
    return done


def _source_copy(source: str, outdir: Path) -> str:
    """The edit's source image as a PNG inside ``outdir`` (``sources/<digest>.png``, named by the file's bytes);
    the path relative to ``outdir``. The rating app serves only files inside a candidates folder."""
    import hashlib

    from PIL import Image

    data = Path(source).read_bytes()
    rel = f"sources/{hashlib.sha256(data).hexdigest()[:20]}.png"
    if not (outdir / rel).is_file():
        (outdir / "sources").mkdir(parents=True, exist_ok=True)
        with Image.open(source) as im:
            _write_png(np.asarray(im.convert("RGB")), outdir / rel)
    return rel


def _write_png(img: np.ndarray, path: Path) -> None:
    """A PNG with no text chunks, written whole then renamed (a kill never leaves half an image)."""
    from PIL import Image

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    Image.fromarray(np.asarray(img, dtype=np.uint8)).save(tmp, format="PNG", pnginfo=None)
    os.replace(tmp, path)


def generate(checkpoint: str, prompts_path: str, k: int, out: str, *, seed: int = 0, steps: int | None = None,
             cfg_scale: float | None = None, guidance: float | None = None, batch: int = 16, raw_weights: bool = False,
             progress: bool = True, adapters: list[tuple[str, float]] = ()) -> dict:
    if k < 1:
        raise UserError(f"--k {k}: expected a number of candidates >= 1")
    if batch < 1:
        raise UserError(f"--batch {batch}: expected >= 1")
    prompts = read_prompts(prompts_path)
    from difftrain.data.batch import assemble
    from difftrain.images import read_image
    from difftrain.inference import guidance_scale, load_pipeline, to_tensor
    from difftrain.parallel.dist import gather_objects, rank_world
    from difftrain.train.verification import checkpoint_digest

    pipe, cfg, info = load_pipeline(checkpoint, use_ema=not raw_weights, guidance=guidance, adapters=adapters)
    weights = "ema" if not raw_weights and cfg.train.ema_decay > 0 else "model"
    sampler = {"sampler": "euler", "steps": steps or cfg.sample.steps, "cfg_scale": guidance_scale(cfg, cfg_scale),
               "shift": [cfg.sample.shift, cfg.sample.shift_value], "image_size": cfg.data.image_size,
               **({"guidance": pipe.guidance} if pipe.dit.params.guidance_embed else {})}
    manifest = {"format": FORMAT, "checkpoint": str(Path(info["path"]).resolve()), "step": int(info.get("step", 0)),
                "run": Path(info["path"]).parent.parent.name, "digest": checkpoint_digest(info["path"]),
                "weights": weights, "sampler": sampler, "k": k, "seed": seed,
                "adapters": [{"path": a["path"], "step": a.get("step"), "scale": a["scale"]}
                             for a in info.get("adapters", [])],
                "prompts": [{key: v for key, v in asdict(q).items() if key != "line"} for q in prompts]}
    rank, ranks = rank_world()
    outdir = Path(out)
    mpath, cpath = outdir / "manifest.json", outdir / "candidates.jsonl"
    if rank == 0:
        if mpath.is_file():
            old = json.loads(mpath.read_text())
            same = {key: old.get(key, [] if key == "adapters" else None)
                    for key in ("digest", "weights", "sampler", "k", "seed", "prompts", "adapters")}
            if same != {key: manifest[key] for key in same}:
                diff = [key for key in same if same[key] != manifest[key]]
                raise UserError(f"{outdir}: holds candidates made with other settings ({', '.join(diff)} differ): "
                                "use another --out, or the same checkpoint, prompts and settings to resume")
        (outdir / "images").mkdir(parents=True, exist_ok=True)
        tmp = mpath.with_name(f".manifest.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, mpath)
    done = gather_objects(_done(cpath) if rank == 0 else None)[0]
    todo = [(q, j) for q in prompts for j in range(k) if candidate_id(q.id, j) not in done]
    # one request per batch: a task, and for an edit its one source image
    groups: dict[tuple, list] = {}
    for q, j in todo:
        groups.setdefault((q.task, q.source, q.frames), []).append((q, j))
    chunks = [items[s:s + batch] for items in groups.values() for s in range(0, len(items), batch)]
    size = cfg.data.image_size
    sources = ({q.source: _source_copy(q.source, outdir) for q, _ in todo if q.task == "edit"} if rank == 0 else {})
    bar = _progress(progress and rank == 0, len(todo))
    written = 0
    try:
        for items in chunks:
            task, source, frames = items[0][0].task, items[0][0].source, items[0][0].frames
            texts = [q.prompt for q, _ in items]
            if task == "edit":
                ref = pipe.autoencoder.encode(to_tensor(read_image(source, size)[None]).to(pipe.device))
                ref = ref.expand(len(items), -1, -1, -1)
                req = assemble(torch.stack((torch.zeros_like(ref), ref), 1), [0, 1],
                               torch.tensor([[True, False]] * len(items)), pipe.text_encoder.tokenize(texts), texts,
                               "edit")
            else:
                req = pipe.blank_batch(texts, size, size, frames or 1, task)
            L, C = req.x0_BLC.shape[1:]
            seeds = [noise_seed(seed, q.id, j) for q, j in items]
            noise = torch.stack([torch.randn(L, C, generator=torch.Generator().manual_seed(s)) for s in seeds])
            B = len(items)
            lo, hi = rank * B // ranks, (rank + 1) * B // ranks
            rows = slice(lo, hi) if hi > lo else slice(0, 1)    # a rank with no row generates a stand-in
            with torch.no_grad():
                lat = pipe.sample(req, sampler["steps"], sampler["cfg_scale"], seed=seed, noise=noise,
                                  rows=rows if ranks > 1 else None)
            imgs = pipe.to_images(lat)[: hi - lo]
            if ranks > 1:
                imgs = np.concatenate(gather_objects(imgs))
            if rank == 0:
                with open(cpath, "a", encoding="utf-8") as f:
                    for b, ((q, j), s) in enumerate(zip(items, seeds)):
                        cid = candidate_id(q.id, j)
                        names = ([f"images/{cid}.png"] if task != "keyframes" else
                                 [f"images/{cid}_f{fr}.png" for fr in range(imgs.shape[1])])
                        for fr, name in enumerate(names):
                            _write_png(imgs[b, fr], outdir / name)
                        row = {"id": cid, "prompt_id": q.id, "prompt": q.prompt, "task": task, "k": j, "seed": seed,
                               "noise_seed": s, "image": names[0], "frames": names if task == "keyframes" else [],
                               "source": sources.get(q.source, "") if task == "edit" else ""}
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                written += B
                bar(B)
    finally:
        bar(None)
    return {"out": str(outdir), "candidates": len(prompts) * k, "written": written, "skipped": len(done),
            "digest": manifest["digest"]}


def _progress(on: bool, total: int):
    """A rich progress bar (a callback: advance by n; None closes it); a no-op when off."""
    if not on:
        return lambda n: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]candidates"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   transient=False)
    task = bar.add_task("candidates", total=total)
    bar.start()

    def advance(n):
        if n is None:
            bar.stop()
        else:
            bar.advance(task, n)
    return advance


def read_candidates(out: str | Path) -> tuple[dict, list[dict]]:
    """A candidates folder's manifest and rows (for ``pairs``, the rating app, scripts)."""
    d = Path(out)
    mpath, cpath = d / "manifest.json", d / "candidates.jsonl"
    if not mpath.is_file() or not cpath.is_file():
        raise UserError(f"{d}: not a candidates folder (expected manifest.json and candidates.jsonl, written by "
                        "'difftrain candidates')")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{mpath}: not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{mpath}: format {got!r}, expected {FORMAT!r}")
    rows = []
    for n, raw in enumerate(cpath.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError:
            raise UserError(f"{cpath}:{n}: not a JSON line") from None
    return manifest, rows
