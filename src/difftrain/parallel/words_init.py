"""A trained word encoder (``text.kind = "words"``) carried from ``model.init_from``.

The words encoder's vocabulary is data: it is fixed when the base is trained. A difftrain export of such a model
holds the encoder's tensors (``text.*`` in ``model.safetensors``) and its words (``vocabulary.json``, the
encoder's rows after the padding and unknown-word rows, in order). A run that starts from that export builds its
encoder on the base's vocabulary followed by the words of its own data the base never saw (each a new row,
initialised as a new encoder's rows are), and reads every tensor of the base's encoder into it, the embedding row
by row by word, so that every word the base knew keeps its vector and its id. Every rank reads only the rows it
holds (FSDP2 shards rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from difftrain.errors import UserError

VOCABULARY = "vocabulary.json"
TEXT_PREFIX = "text."
MAX_WORDS = 10_000_000


def _folder(path: str | Path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def base_vocabulary(path: str | Path) -> list[str] | None:
    """The words of the encoder an export at ``path`` holds (None: the export has no ``vocabulary.json``)."""
    f = _folder(path) / VOCABULARY
    if not f.is_file():
        return None
    try:
        words = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"init_from {f}: not a JSON list of words ({e})") from None
    if (not isinstance(words, list) or len(words) > MAX_WORDS
            or not all(isinstance(w, str) and w for w in words) or len(set(words)) != len(words)):
        raise UserError(f"init_from {f}: expected a JSON list of distinct non-empty words (at most {MAX_WORDS})")
    return words


def write_vocabulary(encoder, out: Path) -> Path | None:
    """``OUT/vocabulary.json`` beside an export's weights, for a words encoder (None for other encoders)."""
    vocab = getattr(encoder, "vocabulary", None)
    if vocab is None:
        return None
    f = out / VOCABULARY
    f.write_text(json.dumps(vocab[2:]) + "\n", encoding="utf-8")       # after <pad> and <unk>
    return f


def extended(base: list[str], data: list[str]) -> list[str]:
    """The base's words in their order, then the data's words the base lacks (in the data's order)."""
    known = set(base)
    return list(base) + [w for w in data if w not in known]


def _local(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor this rank writes, its first global row)."""
    from difftrain.parallel.pretrained import _local_rows

    t, lo, _ = _local_rows(p)
    return t, lo


def load_word_encoder(encoder: nn.Module, path: str | Path, base_words: list[str]) -> dict:
    """Read the base's word-encoder tensors from the export at ``path`` into ``encoder`` (plain or FSDP2-sharded):
    every tensor whole, but the embedding, whose rows are matched by word (<pad> and <unk> by position). Returns
    {"tensors", "words_kept", "words_new"}. Raises ``UserError`` (before writing anything) when the export has no
    encoder tensors or their shapes differ from this encoder's (another ``text.dim``/``layers``/``max_tokens``)."""
    from safetensors import safe_open

    from difftrain.parallel.pretrained import EXPORT_WEIGHTS

    f = _folder(path) / EXPORT_WEIGHTS
    if not f.is_file():
        raise UserError(f"init_from {path}: {VOCABULARY} is there but not {EXPORT_WEIGHTS}")
    params = {k: v for k, v in encoder.named_parameters() if k != "new_words"}    # a fine-tune's own rows
    with safe_open(str(f), framework="pt", device="cpu") as h:
        have = {k[len(TEXT_PREFIX):]: k for k in h.keys() if k.startswith(TEXT_PREFIX)}
        if not have:
            raise UserError(f"init_from {f}: {VOCABULARY} names a word encoder but the file holds no "
                            f"'{TEXT_PREFIX}*' tensors")
        problems = []
        for name, p in params.items():
            if name not in have:
                problems.append(f"{name}: missing")
                continue
            shape = tuple(h.get_slice(have[name]).get_shape())
            want = tuple(p.shape)
            if name == "embed.weight":
                if shape[0] != len(base_words) + 2 or shape[1:] != want[1:]:
                    problems.append(f"{name}: {shape}, expected ({len(base_words) + 2}, {want[1]}) for "
                                    f"{len(base_words)} words of width {want[1]}")
            elif shape != want:
                problems.append(f"{name}: {shape}, this run's text encoder has {want}")
        extra = sorted(set(have) - set(params))
        if extra:
            problems.append(f"not in this run's text encoder: {extra[:5]}")
        if problems:
            raise UserError(f"init_from {f}: its word encoder does not fit this run's text settings "
                            f"(text.dim, text.layers, text.max_tokens): " + "; ".join(problems[:6]))
        vocab = encoder.vocabulary                  # ours: <pad>, <unk>, the base's words, then new ones
        base_row = {w: i + 2 for i, w in enumerate(base_words)}
        with torch.no_grad():
            for name, p in params.items():
                local, lo = _local(p)
                n = local.shape[0]
                if name == "embed.weight":
                    src = h.get_slice(have[name])
                    for r in range(n):
                        g = lo + r
                        b = g if g < 2 else base_row.get(vocab[g])
                        if b is not None:
                            local[r].copy_(src[b:b + 1][0].to(local.dtype))
                else:
                    local.copy_(h.get_slice(have[name])[lo:lo + n].to(local.dtype))
    kept = sum(1 for w in vocab[2:] if w in base_row)
    return {"tensors": len(params), "words_kept": kept, "words_new": len(vocab) - 2 - kept,
            "new_rows_trained_apart": getattr(encoder, "new_words", None) is not None}


def adapter_words(path: str | Path) -> tuple[list[str], torch.Tensor] | None:
    """The words an adapter learnt, from its export folder (``export/adapter/words/``: the merged embedding and its
    vocabulary); None when it learnt none."""
    from safetensors.torch import load_file

    from difftrain.parallel.pretrained import EXPORT_WEIGHTS

    d = Path(path) / "words"
    if not (d / VOCABULARY).is_file():
        return None
    words = base_vocabulary(d)
    try:
        emb = load_file(str(d / EXPORT_WEIGHTS))["text.embed.weight"]
    except Exception as e:  # noqa: BLE001 -- safetensors and key errors alike: the folder is unreadable
        raise UserError(f"--adapter {d}: not a readable words folder ({type(e).__name__}: {e})") from None
    if emb.ndim != 2 or emb.shape[0] != len(words) + 2 or not bool(torch.isfinite(emb).all()):
        raise UserError(f"--adapter {d}: its embedding {list(emb.shape)} does not hold {len(words) + 2} finite rows "
                        f"for its {len(words)} words")
    return words, emb


def with_adapter_words(encoder: nn.Module, path: str | Path, words: list[str], emb: torch.Tensor) -> nn.Module:
    """A words encoder like ``encoder`` (the base's) whose vocabulary is ``words`` (the base's words first, then those
    the adapter learnt) and whose embedding is ``emb``; every other tensor the base's. Refused when the adapter's
    words do not start with the base's (an adapter trained on another base)."""
    from difftrain.models.text import WordTextEncoder

    have = encoder.vocabulary[2:]
    if words[: len(have)] != have:
        raise UserError(f"--adapter {path}: its words do not start with this model's {len(have)} words (an adapter "
                        "trained on another base?)")
    if emb.shape[1] != encoder.dim:
        raise UserError(f"--adapter {path}: its word vectors are {emb.shape[1]} wide, this model's {encoder.dim}")
    new = WordTextEncoder(words, encoder.max_tokens, encoder.dim, len(encoder.layers), padding=encoder.padding)
    state = {k: v for k, v in encoder.state_dict().items() if not k.startswith(("embed.", "new_words"))}
    state["embed.weight"] = emb
    new.load_state_dict(state)
    return new.to(next(encoder.parameters()).device).eval().requires_grad_(False)
