"""Text encoders behind one interface: ``tokenize(prompts) -> tokens`` then ``forward(tokens) ->
TextEmbedding`` (a sequence for joint attention and a pooled vector for adaLN).

Two kinds:
- ``WordTextEncoder``: a small transformer over a fixed word vocabulary, trained together with the
  DiT. It is how a world trained from scratch (the shapes world) gets text features.
- ``HFTextEncoder`` (``hf_text.py``): frozen transformers T5 (sequence) and CLIP (pooled), as FLUX.
Tokenizing is separate from encoding so data loaders can tokenize on the CPU ahead of time.

**The text rule** (``text.padding``), one for every path that feeds the DiT text: the shapes source, the
store with frozen-encoder states or with captions, dropped captions, CFG's unconditional branch, sample,
eval and previews.
- ``masked`` (default): encoders run with their attention mask, so a caption's states do not depend on how
  far it is padded; sequences are padded to a rung of a short ladder (powers of two from 8 up to
  ``max_tokens``, so a compiled run sees few text lengths); the DiT's attention masks the padding out. The
  store keeps true-length states.
- ``padded``: as FLUX.1 was trained: every caption is padded to ``max_tokens``, the encoder runs over the
  padding without a mask and the DiT attends all ``max_tokens`` states (padding states included). The store
  keeps all ``max_tokens`` states (4 MiB a sample for T5-XXL's 4096 wide states at 512 tokens in bf16).
The empty caption is one position (a frozen encoder's end-of-sequence token; the word encoder's pad
embedding) under ``masked``, never zero positions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from difftrain.words import words_of

PAD, UNK = "<pad>", "<unk>"


PADDING = ("masked", "padded")
MIN_RUNG = 8


@dataclass
class TextEmbedding:
    txt_BTD: Tensor      # sequence embedding for joint attention
    pooled_BP: Tensor    # pooled vector for adaLN modulation
    mask_BT: Tensor      # True where the DiT attends: real tokens under 'masked', every position under 'padded'


def text_length(longest: int, max_tokens: int, padding: str) -> int:
    """The length a batch's text is padded to under the rule: 'padded', ``max_tokens``; 'masked', the smallest
    rung (8, 16, 32, ... and ``max_tokens`` itself) that holds the batch's ``longest`` sequence."""
    if padding not in PADDING:
        raise ValueError(f"text.padding = {padding!r}: expected one of {PADDING}")
    if padding == "padded":
        return max_tokens
    rung = MIN_RUNG
    while rung < longest:
        rung *= 2
    return max(1, min(rung, max_tokens))


def real_lengths(tokens: dict[str, Tensor]) -> Tensor:
    """Positions the DiT attends per prompt, from tokens on the host (no device sync): the word encoder's
    non-pad ids (at least 1), a T5 mask, else a CLIP mask."""
    if "ids" in tokens:
        return (tokens["ids"] != 0).sum(1).clamp(min=1)
    key = "t5_mask" if "t5_mask" in tokens else "clip_mask"
    return tokens[key].sum(1)


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
                 heads: int = 4, padding: str = "masked", base_words: int = 0):
        super().__init__()
        if padding not in PADDING:
            raise ValueError(f"text.padding = {padding!r}: expected one of {PADDING}")
        self.padding = padding
        self.vocabulary = [PAD, UNK] + [w for w in vocabulary if w not in (PAD, UNK)]
        self.index = {w: i for i, w in enumerate(self.vocabulary)}
        self.max_tokens, self.dim, self.pooled_dim = max_tokens, dim, dim
        # ``base_words``: the first words are a base model's (``embed``), the rest words a fine-tune adds
        # (``new_words``, a parameter of their own, so that an adapter run trains them with the base frozen)
        n = len(self.vocabulary)
        self.base_words = base_words if 0 < base_words < n - 2 else 0
        rows = self.base_words + 2 if self.base_words else n
        self.embed = nn.Embedding(rows, dim)
        self.new_words = nn.Parameter(torch.empty(n - rows, dim)) if self.base_words else None
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
        if self.new_words is not None:
            nn.init.normal_(self.new_words, std=1.0)

    def tokenize(self, prompts: list[str], length: int | None = None) -> dict[str, Tensor]:
        """Word ids padded to ``length``, by default the rule's length for the batch's longest prompt ('masked':
        a rung of the ladder, so short captions cost few text tokens, which matters when text is a third of a
        small model's sequence; 'padded': ``max_tokens``)."""
        rows: list[list[str]] = []
        for prompt in prompts:
            words = words_of(prompt)
            if len(words) > self.max_tokens:
                warn_truncated(prompt, len(words), self.max_tokens)
                words = words[: self.max_tokens]
            rows.append(words)
        longest = max([1] + [len(r) for r in rows])
        ids = torch.zeros(len(prompts), max(longest, length or text_length(longest, self.max_tokens, self.padding)),
                          dtype=torch.long)
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
        real = ids != 0
        real[:, 0] = True                       # the empty prompt is one position: the pad embedding
        if self.new_words is None:
            x = self.embed(ids)
        else:                                   # base rows from embed, a fine-tune's words from new_words
            nb = self.embed.num_embeddings
            new = ids >= nb
            x = torch.where(new[..., None], self.new_words[(ids - nb).clamp(min=0)],
                            self.embed(ids.clamp(max=nb - 1)))
        x = x + self.pos[: ids.shape[1]]
        pad_mask = ~real if self.padding == "masked" else None
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad_mask)
        x = self.norm(x)
        m = real[..., None].to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1)
        mask = real if self.padding == "masked" else torch.ones_like(real)
        return TextEmbedding(x, pooled, mask)

    def extra_state(self) -> dict:
        """What a checkpoint needs to rebuild this encoder (the vocabulary is data, not code)."""
        out = {"kind": "words", "vocabulary": self.vocabulary[2:], "max_tokens": self.max_tokens,
               "dim": self.dim, "layers": len(self.layers), "padding": self.padding}
        if self.base_words:
            out["base_words"] = self.base_words
        return out
