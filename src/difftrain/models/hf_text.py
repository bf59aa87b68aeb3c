"""Frozen transformers text encoders, as FLUX uses them: T5 gives the token sequence for joint
attention, CLIP the pooled vector for adaLN. Either may be left out ('' path):
- T5 only: pooled = masked mean of the T5 sequence;
- CLIP only: the sequence is CLIP's last_hidden_state (at most CLIP's 77 positions).

Accepted paths (loaded with ``local_files_only=True``, nothing is downloaded):
- a model folder holding config.json, the weights and the tokenizer files together; or
- a diffusers FLUX-style pipeline folder: ``text_encoder_2/`` + ``tokenizer_2/`` is taken as T5 and
  ``text_encoder/`` + ``tokenizer/`` as CLIP, so both keys may name the same pipeline folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from difftrain.errors import UserError
from difftrain.models.text import PADDING, TextEmbedding, text_length, warn_truncated

# config model_type values each loader can build (checked first, for a clear message).
_KINDS = {"t5": ("t5", "mt5"), "clip": ("clip", "clip_text_model")}
_PIPELINE_DIRS = {"t5": ("text_encoder_2", "tokenizer_2"), "clip": ("text_encoder", "tokenizer")}


def _resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "fp32":
        return torch.float32
    if dtype == "bf16":
        return torch.bfloat16
    if dtype == "auto":  # bf16 matmuls on a CPU are slower than fp32, so only where CUDA has them
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    raise UserError(f"text.dtype = {dtype!r}: expected 'auto', 'bf16' or 'fp32'")


def _folders(kind: str, path: str) -> tuple[Path, Path, str]:
    """(model folder, tokenizer folder, what is expected) of a model folder or a pipeline folder."""
    p = Path(path)
    model_sub, tok_sub = _PIPELINE_DIRS[kind]
    model_dir, tok_dir = (p / model_sub, p / tok_sub) if (p / model_sub / "config.json").is_file() else (p, p)
    what = (f"expected a transformers {'T5' if kind == 't5' else 'CLIP text'} model folder "
            f"(config.json, weights, tokenizer files) or a pipeline folder with {model_sub}/ and {tok_sub}/")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"text.{kind}_path = {path!r}: no config.json there; {what}")
    return model_dir, tok_dir, what


def _config(kind: str, path: str):
    """The model's transformers config (config.json only: no weights read); UserError on anything wrong."""
    from transformers import AutoConfig

    model_dir, _, what = _folders(kind, path)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"text.{kind}_path = {path!r}: cannot load ({msg}); {what}") from None
    if config.model_type not in _KINDS[kind]:
        raise UserError(f"text.{kind}_path = {path!r}: holds a {config.model_type!r} model; {what}")
    return getattr(config, "text_config", config) if kind == "clip" and config.model_type == "clip" else config


def _load(kind: str, path: str, dtype: torch.dtype):
    """(model, tokenizer) from a model folder or a pipeline folder; UserError on anything wrong."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    key = f"text.{kind}_path"
    model_dir, tok_dir, what = _folders(kind, path)
    _config(kind, path)
    try:
        cls = T5EncoderModel if kind == "t5" else CLIPTextModel
        # dtype at load time avoids a transient fp32 copy of a 4.7B-parameter T5-XXL.
        model = cls.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{key} = {path!r}: cannot load ({msg}); {what}") from None
    return model.to(dtype).eval().requires_grad_(False), tokenizer


KEEP_FP8 = ("wo",)       # T5's FFN output projections: they read its activation outliers


def fp8_eligible(module: nn.Module, fqn: str, keep: tuple[str, ...] = KEEP_FP8) -> bool:
    """Linear layers quantized by text.precision = 'fp8': every nn.Linear but those named in ``keep`` (and none
    whose dims are not multiples of 16, which float8 kernels cannot take)."""
    return (isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] not in keep
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def quantize_fp8(model: nn.Module, keep: tuple[str, ...] = KEEP_FP8) -> int:
    """float8 (e4m3) weights, one scale per output row, for ``model``'s eligible linears (torchao); computed in the
    model's dtype. How many layers were quantized."""
    try:
        from torchao.quantization import Float8WeightOnlyConfig, quantize_
    except ImportError:
        raise UserError("text.precision = 'fp8' needs torchao (pip install torchao==0.18.0, paired with torch "
                        "2.13)") from None
    names = [n for n, m in model.named_modules() if fp8_eligible(m, n, keep)]
    quantize_(model, Float8WeightOnlyConfig(), filter_fn=lambda m, fqn: fp8_eligible(m, fqn, keep))
    return len(names)


class HFTextEncoder(nn.Module):
    """Frozen T5 and/or CLIP. Outputs are float32 whatever the compute dtype, so the DiT's autocast
    (not the encoder's storage dtype) decides the precision downstream."""

    trainable = False

    def __init__(self, t5=None, t5_tokenizer=None, clip=None, clip_tokenizer=None, max_tokens: int = 512,
                 paths: tuple[str, str] = ("", ""), padding: str = "masked"):
        super().__init__()
        if padding not in PADDING:
            raise UserError(f"text.padding = {padding!r}: expected one of {PADDING}")
        self.padding = padding
        if t5 is None and clip is None:
            raise UserError("text.kind = 'hf' needs text.t5_path and/or text.clip_path")
        self.t5, self.t5_tokenizer, self.clip, self.clip_tokenizer = t5, t5_tokenizer, clip, clip_tokenizer
        self.paths = paths
        self.clip_limit = 0
        if clip is not None:  # 77 for every released CLIP; positions beyond it do not exist
            self.clip_limit = min(clip.config.max_position_embeddings, clip_tokenizer.model_max_length)
        # CLIP alone cannot give more positions than it has; the effective length is what callers see.
        self.max_tokens = max_tokens if t5 is not None else min(max_tokens, self.clip_limit)
        self.dim = t5.config.d_model if t5 is not None else clip.config.hidden_size
        self.pooled_dim = clip.config.hidden_size if clip is not None else t5.config.d_model
        self.eval()

    @classmethod
    def from_paths(cls, t5_path: str, clip_path: str, max_tokens: int = 512, dtype: str = "auto",
                   device: torch.device | str | None = None, padding: str = "masked",
                   precision: str = "native") -> "HFTextEncoder":
        if not (t5_path or clip_path):
            raise UserError("text.kind = 'hf' needs text.t5_path and/or text.clip_path")
        if precision not in ("native", "fp8"):
            raise UserError(f"text.precision = {precision!r}: expected 'native' or 'fp8'")
        if precision == "fp8" and not t5_path:
            raise UserError("text.precision = 'fp8' quantizes T5's linear layers: set text.t5_path (CLIP alone "
                            "stays in text.dtype)")
        dt = _resolve_dtype(dtype)
        t5, t5_tok = _load("t5", t5_path, dt) if t5_path else (None, None)
        if precision == "fp8":
            quantize_fp8(t5)
        clip, clip_tok = _load("clip", clip_path, dt) if clip_path else (None, None)
        enc = cls(t5, t5_tok, clip, clip_tok, max_tokens, (t5_path, clip_path), padding)
        return enc.to(device) if device is not None else enc

    def train(self, mode: bool = True) -> "HFTextEncoder":
        # Frozen: a parent's .train() must not switch on T5's dropout.
        return super().train(False)

    def _encode(self, tokenizer, prompts: list[str], limit: int, length: int | None) -> tuple[Tensor, Tensor]:
        # Count without truncation first, so the warning can say how long the prompt really was.
        counts = [len(ids) for ids in tokenizer(prompts, verbose=False)["input_ids"]]
        for prompt, n in zip(prompts, counts):
            if n > limit:
                warn_truncated(prompt, n, limit)
        # 'padded': the full length, as FLUX. 'masked': a rung of the ladder holding the longest prompt (or
        # ``length``), so a compiled model sees few text lengths.
        pad_to = length or text_length(min(limit, max([1] + counts)), limit, self.padding)
        out = tokenizer(prompts, padding="max_length", max_length=max(pad_to, 1), truncation=True,
                        return_tensors="pt")
        return out["input_ids"], out["attention_mask"].bool()

    def tokenize(self, prompts: list[str], length: int | None = None) -> dict[str, Tensor]:
        tokens: dict[str, Tensor] = {}
        if self.t5 is not None:
            tokens["t5_ids"], tokens["t5_mask"] = self._encode(self.t5_tokenizer, prompts, self.max_tokens, length)
        if self.clip is not None:
            limit = self.clip_limit if self.t5 is not None else self.max_tokens
            # CLIP only pools for FLUX (T5 gives the sequence): always its own full length, as FLUX.
            pad = limit if self.t5 is not None else length
            tokens["clip_ids"], tokens["clip_mask"] = self._encode(self.clip_tokenizer, prompts, limit, pad)
        return tokens

    @torch.no_grad()
    def forward(self, tokens: dict[str, Tensor]) -> TextEmbedding:
        device = next(self.parameters()).device  # tokens are made on the CPU by data loaders
        masked = self.padding == "masked"
        if self.t5 is not None:
            # 'padded' passes no attention_mask, as FLUX: its DiT was trained on T5 states computed over the
            # padding too. 'masked' passes it, so a caption's states do not depend on its padding.
            t5_mask = tokens["t5_mask"].to(device)
            txt = self.t5(input_ids=tokens["t5_ids"].to(device),
                          attention_mask=t5_mask.long() if masked else None).last_hidden_state.float()
            mask = t5_mask if masked else torch.ones_like(t5_mask)
        if self.clip is not None:
            # CLIP is causal and pools at the first EOS, so padding after it cannot change the pooled
            # vector; FLUX does not pass the mask either.
            out = self.clip(input_ids=tokens["clip_ids"].to(device))
            pooled = out.pooler_output.float()
            if self.t5 is None:
                clip_mask = tokens["clip_mask"].to(device)
                txt, mask = out.last_hidden_state.float(), clip_mask if masked else torch.ones_like(clip_mask)
        else:
            m = t5_mask[..., None].to(txt.dtype)
            pooled = (txt * m).sum(1) / m.sum(1).clamp(min=1.0)
        return TextEmbedding(txt, pooled, mask)

    def extra_state(self) -> dict:
        """What a checkpoint needs to rebuild this encoder (the weights stay in their own folders)."""
        return {"kind": "hf", "t5_path": self.paths[0], "clip_path": self.paths[1], "max_tokens": self.max_tokens,
                "padding": self.padding}


class LazyHFTextEncoder(nn.Module):
    """The frozen encoders of ``HFTextEncoder``, built (weights read, moved to ``device``, quantized) the first
    time something encodes or tokenizes with them, not before. A run fed by a store that holds their states
    never needs them while it trains: only previews, eval and candidates do, so they do not take GPU memory
    (T5-XXL + CLIP-L: 9.5 GB in bf16) or a restart's read of their weights on ranks that never encode.

    What a trainer needs without them (widths, text rule, a checkpoint's record) comes from the models'
    config.json files; the rest is ``encoder()``'s (which builds them)."""

    trainable = False

    def __init__(self, t5_path: str, clip_path: str, max_tokens: int = 512, dtype: str = "auto",
                 device: torch.device | str = "cpu", padding: str = "masked", precision: str = "native",
                 on_build=None):
        super().__init__()
        if not (t5_path or clip_path):
            raise UserError("text.kind = 'hf' needs text.t5_path and/or text.clip_path")
        if padding not in PADDING:
            raise UserError(f"text.padding = {padding!r}: expected one of {PADDING}")
        t5 = _config("t5", t5_path) if t5_path else None
        clip = _config("clip", clip_path) if clip_path else None
        self.paths, self.padding = (t5_path, clip_path), padding
        self.dim = t5.d_model if t5 is not None else clip.hidden_size
        self.pooled_dim = clip.hidden_size if clip is not None else t5.d_model
        self.max_tokens = max_tokens if t5 is not None else min(max_tokens, clip.max_position_embeddings)
        self._args = (t5_path, clip_path, max_tokens, dtype, device, padding, precision)
        self._on_build = on_build
        self._built: list[HFTextEncoder] = []     # a list: not registered as a submodule until built

    @property
    def built(self) -> bool:
        return bool(self._built)

    def encoder(self) -> HFTextEncoder:
        """The encoders, built on the first call."""
        if not self._built:
            t5_path, clip_path, max_tokens, dtype, device, padding, precision = self._args
            enc = HFTextEncoder.from_paths(t5_path, clip_path, max_tokens, dtype, device=device, padding=padding,
                                           precision=precision)
            self._built.append(enc)
            if self._on_build is not None:
                self._on_build(enc)
        return self._built[0]

    def tokenize(self, prompts: list[str], length: int | None = None) -> dict[str, Tensor]:
        return self.encoder().tokenize(prompts, length)

    def forward(self, tokens: dict[str, Tensor]) -> TextEmbedding:
        return self.encoder()(tokens)

    def release(self) -> None:
        """Drop the built encoders (their GPU memory goes back to the allocator); the next use builds them again."""
        if self._built:
            device = next(self._built[0].parameters()).device
            self._built.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def extra_state(self) -> dict:
        t5_path, clip_path = self.paths
        return {"kind": "hf", "t5_path": t5_path, "clip_path": clip_path, "max_tokens": self.max_tokens,
                "padding": self.padding}


def resident_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (quantized weights at their stored size)."""
    seen, n = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            inner = getattr(t, "__tensor_flatten__", None)
            if inner is not None:        # a torchao tensor subclass: its stored parts
                names, _ = t.__tensor_flatten__()
                n += sum(getattr(t, a).numel() * getattr(t, a).element_size() for a in names)
            else:
                n += t.numel() * t.element_size()
    return n
