"""A store-fed run's previews without its text encoders: the frozen encoders' states of the preview prompts, read from
the store.

A store written by ``difftrain prepare`` with frozen ('hf') encoders holds each row's T5 and CLIP states and the empty
caption's (``empty_text.safetensors``, for caption dropout). The previews of a run fed by it draw their prompts from
the same rows (the first ``preview.count`` captions of its text-to-image tables, ``ConfiguredSource.preview_prompts``)
and guide with the empty caption, so their states are all in the store: ``StoredPrompts`` reads them once and stands
in for the text encoder in the sampling pipeline. T5-XXL and CLIP (9.5 GB in bf16) are then never built by the run;
a prompt the store does not hold (``preview.prompts``, ``sample.prompts``) needs ``preview.text = 'encoders'``, which
builds them for previews (and keeps them), as before.
"""

from __future__ import annotations

import numpy as np
import torch

from difftrain.data.store import tables as st
from difftrain.errors import UserError
from difftrain.models.text import TextEmbedding


def stored_states(store: str, prompts: list[str], dtype: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{prompt: (txt T x D, pooled)} of the wanted prompts found among the store's text-to-image rows (table order, the
    first row holding a caption wins), and of '' (the empty caption); reads the caption column, then the states of the
    rows found only."""
    want = set(prompts) - {""}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    manifest = st.read_manifest(store) or {"tables": {}}
    bits = np.uint16 if dtype == "bf16" else np.uint32
    for name, info in sorted(manifest["tables"].items()):
        if info.get("task") != "t2i" or not info.get("text_embeddings") or not want - set(out):
            continue
        ds = st.open_table(st.table_uri(store, name), name)
        captions = ds.to_table(columns=["caption"]).column(0).to_pylist()
        rows = {}
        for i, c in enumerate(captions):
            if c in want and c not in out and c not in rows:
                rows[c] = i
        if not rows:
            continue
        taken = ds.take(list(rows.values()), columns=["txt", "txt_len", "pooled"]).to_pylist()
        for caption, r in zip(rows, taken):
            txt = st.from_bits(np.asarray(r["txt"], dtype=bits), dtype).reshape(int(r["txt_len"]), -1)
            out[caption] = (txt.float(), st.from_bits(np.asarray(r["pooled"], dtype=bits), dtype).float())
    from safetensors.torch import load_file         # the empty caption: guidance's unconditional prediction
    try:
        empty = load_file(f"{store.rstrip('/')}/empty_text.safetensors")
    except (OSError, RuntimeError) as e:
        raise UserError(f"data.store = {store!r}: its empty caption's states (empty_text.safetensors) cannot be "
                        f"read ({e}); re-run 'difftrain prepare'") from None
    out[""] = (empty["txt"].float(), empty["pooled"].float())
    return out


class StoredPrompts:
    """The text encoder as the sampling pipeline calls it (``tokenize``, then the call on its tokens), answering from
    stored states: a prompt's tokens are its index here. A prompt not held is refused, naming it."""

    trainable = False

    def __init__(self, states: dict[str, tuple[torch.Tensor, torch.Tensor]], padding: str, max_tokens: int,
                 device: torch.device):
        self.prompts = list(states)
        self.index = {p: i for i, p in enumerate(self.prompts)}
        self.states = [states[p] for p in self.prompts]
        self.padding, self.max_tokens, self.device = padding, max_tokens, device
        self.dim = self.states[0][0].shape[1] if self.states else 0
        self.pooled_dim = self.states[0][1].shape[0] if self.states else 0

    def tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        missing = [p for p in prompts if p not in self.index]
        if missing:
            raise UserError(f"preview prompt {missing[0]!r} is not among the store's captions, whose frozen encoders' "
                            "states a store-fed run previews with: set preview.text = 'encoders' to build the text "
                            "encoders for previews, or preview from the store's own captions")
        return {"stored": torch.tensor([[self.index[p]] for p in prompts], dtype=torch.long)}

    def __call__(self, tokens: dict[str, torch.Tensor]) -> TextEmbedding:
        from difftrain.models.text import text_length

        idx = [int(i) for i in tokens["stored"][:, 0].tolist()]
        txts = [self.states[i][0] for i in idx]
        length = text_length(max(t.shape[0] for t in txts), self.max_tokens, self.padding)
        txt = torch.stack([torch.cat([t, t.new_zeros(max(0, length - t.shape[0]), t.shape[1])])[:length]
                           for t in txts])
        if self.padding == "masked":
            mask = torch.stack([torch.arange(length) < t.shape[0] for t in txts])
        else:
            mask = torch.ones(len(txts), length, dtype=torch.bool)
        pooled = torch.stack([self.states[i][1] for i in idx])
        return TextEmbedding(txt.to(self.device), pooled.to(self.device), mask.to(self.device))
