"""The FP8 frozen text encoder (text.precision = 'fp8'): float8 weights for T5's linears except the FFN output
projections, on a tiny T5 whose FFN carries an activation outlier (a channel scaled up into ``wo`` and its weights
scaled down, which computes the same in full precision). Quantizing ``wo`` too must visibly fail the cosine bound
there: random weights alone would pass any bound and prove nothing."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

PROMPTS = ["a small red circle in the top left", "a big blue square", "make the triangle green",
           "a red circle moving from the top left to the bottom right", "hi", "a large green triangle in the centre"]
BOUND = 0.995          # the least cosine of any token's state against the full-precision encoder


@pytest.fixture(scope="module")
def outlier_t5(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("t5")
    tok = transformers.ByT5Tokenizer()
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(tok), d_model=64, d_kv=16, d_ff=128,
                                                           num_layers=2, num_heads=4)).eval()
    with torch.no_grad():
        x = torch.randn(2, 20, 64)
        for block in t5.encoder.block:            # 8 FFN channels that carry much of what the FFN writes ...
            block.layer[1].DenseReluDense.wo.weight[:, :8] *= 4
        before = t5(inputs_embeds=x).last_hidden_state
        for block in t5.encoder.block:            # ... arrive 10^6 times larger, wo's weights 10^6 smaller
            ff = block.layer[1].DenseReluDense
            ff.wi.weight[:8] *= 1e6
            ff.wo.weight[:, :8] /= 1e6
        after = t5(inputs_embeds=x).last_hidden_state
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)      # the same function in full precision
    t5.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def _states(enc):
    with torch.no_grad():
        emb = enc(enc.tokenize(PROMPTS))
    return emb.txt_BTD[emb.mask_BT], emb


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_fp8_keeps_wo_and_stays_close_while_quantizing_wo_fails(outlier_t5, monkeypatch):
    from difftrain.models import hf_text
    from difftrain.models.hf_text import HFTextEncoder

    full = HFTextEncoder.from_paths(outlier_t5, "", max_tokens=64, dtype="fp32")
    fp8 = HFTextEncoder.from_paths(outlier_t5, "", max_tokens=64, dtype="fp32", precision="fp8")
    ref, ref_emb = _states(full)
    got, emb = _states(fp8)
    cos = _cosine(got, ref)
    assert cos.min() >= BOUND, float(cos.min())
    assert torch.allclose(emb.pooled_BP, ref_emb.pooled_BP, atol=0.05 * float(ref_emb.pooled_BP.abs().max()))
    layers = dict(fp8.t5.named_modules())
    quantized = [n for n, m in layers.items() if isinstance(m, torch.nn.Linear)
                 and type(m.weight).__name__ != "Parameter" and type(m.weight) is not torch.Tensor]
    assert quantized and not any(n.endswith(".wo") for n in quantized)
    assert all(type(layers[f"encoder.block.{i}.layer.1.DenseReluDense.wo"].weight) in (torch.nn.Parameter,
                                                                                   torch.Tensor) for i in range(2))
    # The weights' bytes: every quantized linear holds one byte a weight (plus a scale a row).
    def nbytes(m):
        w = m.weight
        inner = getattr(w, "qdata", None)
        return (inner.numel() * inner.element_size()) if inner is not None else w.numel() * w.element_size()
    assert all(nbytes(layers[n]) == layers[n].in_features * layers[n].out_features for n in quantized)

    # Quantizing wo as well: the outlier channel's small weights flush to zero in float8, and the states break.
    monkeypatch.setattr(hf_text, "KEEP_FP8", ())
    monkeypatch.setattr(hf_text.quantize_fp8, "__defaults__", ((),))
    naive = HFTextEncoder.from_paths(outlier_t5, "", max_tokens=64, dtype="fp32", precision="fp8")
    bad, _ = _states(naive)
    assert _cosine(bad, ref).min() < 0.9, float(_cosine(bad, ref).min())


def test_fp8_is_in_the_store_key_only_when_asked_and_refused_without_t5(tiny_cfg, outlier_t5):
    from difftrain.data.store.tables import encoder_identity
    from difftrain.errors import UserError
    from difftrain.models.hf_text import HFTextEncoder

    native = encoder_identity(tiny_cfg("text.kind=hf", f"text.t5_path={outlier_t5}"))
    fp8 = encoder_identity(tiny_cfg("text.kind=hf", f"text.t5_path={outlier_t5}", "text.precision=fp8"))
    assert "precision" not in native["text"] and fp8["text"]["precision"] == "fp8"
    assert {k: v for k, v in fp8["text"].items() if k != "precision"} == native["text"]   # old stores keep their key
    with pytest.raises(UserError, match="text.precision = 'fp8' quantizes T5's linear layers: set text.t5_path"):
        HFTextEncoder.from_paths("", outlier_t5, precision="fp8")
