"""Text encoders behind one interface: ``tokenize(prompts) -> tokens`` then ``forward(tokens) ->
TextEmbedding`` (a sequence for joint attention and a pooled vector for adaLN).

Two kinds:
- ``WordTextEncoder``: a small transformer over a fixed word vocabulary, trained together with the
  DiT. It is how a world trained from scratch (the shapes world) gets text features.
- ``HFTextEncoder`` (``hf_text.py``): frozen transformers T5 (sequence) and CLIP (pooled), as FLUX.
Tokenizing is separate from encoding so data loaders can tokenize on the CPU ahead of time.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from difftrain.words import words_of

PAD, UNK = "<pad>", "<unk>"


@dataclass
class TextEmbedding:
    txt_BTD: Tensor      # sequence embedding for joint attention
    pooled_BP: Tensor    # pooled vector for adaLN modulation
    mask_BT: Tensor      # True on real tokens (padding is attended anyway, as FLUX; kept for packing)


class PromptTooLong(UserWarning):
    """A prompt had more tokens than the encoder's limit and was truncated."""


def warn_truncated(prompt: str, n_tokens: int, limit: int) -> None:
    warnings.warn(f"prompt {prompt[:60]!r}{'...' if len(prompt) > 60 else ''} has {n_tokens} tokens; "
                  f"truncated to the encoder's limit of {limit}", PromptTooLong, stacklevel=3)


def _pad_right(v: Tensor, length: int) -> Tensor:
    extra = length - v.shape[1]
    return torch.cat((v, v.new_zeros(v.shape[0], extra)), 1) if extra > 0 else v


def pad_tokens(tokens: dict[str, Tensor], length: int) -> dict[str, Tensor]:
    """Right-pad every (B, T) tensor with zeros (the pad id / a False mask) to ``length``."""
    return {k: _pad_right(v, length) for k, v in tokens.items()}


def batch_tokens(*token_dicts: dict[str, Tensor]) -> dict[str, Tensor]:
    """Concatenate tokenized batches along the batch dim. Each key is padded to its own longest
    length: T5 ids may run to 512 while CLIP's never exceed its 77 positions."""
    out = {}
    for k in token_dicts[0]:
        length = max(d[k].shape[1] for d in token_dicts)
        out[k] = torch.cat([_pad_right(d[k], length) for d in token_dicts])
    return out


class WordTextEncoder(nn.Module):
    """Word embeddings + learned positions + a few pre-norm transformer layers; pooled = masked mean."""

    trainable = True

    def __init__(self, vocabulary: list[str], max_tokens: int = 16, dim: int = 128, layers: int = 1,
                 heads: int = 4):
        super().__init__()
        self.vocabulary = [PAD, UNK] + [w for w in vocabulary if w not in (PAD, UNK)]
        self.index = {w: i for i, w in enumerate(self.vocabulary)}
        self.max_tokens, self.dim, self.pooled_dim = max_tokens, dim, dim
        self.embed = nn.Embedding(len(self.vocabulary), dim)
        self.pos = nn.Parameter(torch.zeros(max_tokens, dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, max(1, min(heads, dim // 16)), 4 * dim, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Unit-scale word vectors: with small (0.02) ones, the first layer's attention, which averages over
        # the prompt at init, drowns each word's identity and the DiT sees nearly the same text for every
        # caption; conditioning then takes thousands of steps to appear instead of a few hundred.
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.pos, std=0.5)

    def tokenize(self, prompts: list[str]) -> dict[str, Tensor]:
        """Word ids padded to the batch's longest prompt (not to max_tokens): short captions then cost
        few text tokens, which matters when text is a third of a small model's sequence."""
        rows: list[list[str]] = []
        for prompt in prompts:
            words = words_of(prompt)
            if len(words) > self.max_tokens:
                warn_truncated(prompt, len(words), self.max_tokens)
                words = words[: self.max_tokens]
            rows.append(words)
        ids = torch.zeros(len(prompts), max([1] + [len(r) for r in rows]), dtype=torch.long)
        unknown: set[str] = set()
        for row, words in enumerate(rows):
            for col, w in enumerate(words):
                ids[row, col] = self.index.get(w, 1)
                if w not in self.index:
                    unknown.add(w)
        if unknown:
            warnings.warn(f"words not in the encoder's vocabulary (read as <unk>): {sorted(unknown)}",
                          stacklevel=2)
        return {"ids": ids}

    def forward(self, tokens: dict[str, Tensor]) -> TextEmbedding:
        ids = tokens["ids"]
        mask = ids != 0
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        m = mask[..., None].to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1.0)
        return TextEmbedding(x, pooled, mask)

    def extra_state(self) -> dict:
        """What a checkpoint needs to rebuild this encoder (the vocabulary is data, not code)."""
        return {"kind": "words", "vocabulary": self.vocabulary[2:], "max_tokens": self.max_tokens,
                "dim": self.dim, "layers": len(self.layers)}
