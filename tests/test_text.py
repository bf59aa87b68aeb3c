import pytest
import torch

from difftrain.shapes.captions import vocabulary
from difftrain.models.text import PromptTooLong, WordTextEncoder, batch_tokens, pad_tokens


def test_tokenize_pads_to_the_longest_prompt_and_marks_unknown_words():
    enc = WordTextEncoder(vocabulary(), max_tokens=8)
    tok = enc.tokenize(["a red circle", "a small blue square in the top left"])
    assert tok["ids"].shape == (2, 8)
    assert tok["ids"][0, 3:].eq(0).all() and tok["ids"][0, :3].ne(0).all()
    with pytest.warns(UserWarning, match="zebra"):
        unk = enc.tokenize(["a zebra"])
    assert unk["ids"][0, 1] == 1                       # <unk>
    assert enc.tokenize([""])["ids"].shape == (1, 8)   # padded to the ladder's first rung (capped at max_tokens)
    assert WordTextEncoder(vocabulary(), max_tokens=16, padding="padded").tokenize(["a"])["ids"].shape == (1, 16)
    long = WordTextEncoder(vocabulary(), max_tokens=40)
    assert long.tokenize(["a red circle " * 3])["ids"].shape == (1, 16)        # 9 words: rung 16 of 8, 16, 32, 40
    assert long.tokenize(["a red circle " * 11])["ids"].shape == (1, 40)       # 33 words: max_tokens


@pytest.mark.parametrize("padding", ["masked", "padded"])
def test_a_captions_features_do_not_depend_on_its_batch(padding):
    """Under either rule a caption's states and pooled vector are the same alone or beside a longer caption
    ('masked': the encoder masks the padding; 'padded': every caption is padded to max_tokens); the empty
    caption is one attended position under 'masked', all max_tokens under 'padded'."""
    torch.manual_seed(0)
    enc = WordTextEncoder(vocabulary(), max_tokens=16, dim=32, layers=2, padding=padding).eval()
    short, long = "a red circle", "a small blue square in the top left of the picture"
    alone = enc(enc.tokenize([short]))
    both = enc(enc.tokenize([short, long]))
    n = 3 if padding == "masked" else 16
    assert alone.mask_BT.sum() == n and both.mask_BT[0].sum() == n
    torch.testing.assert_close(alone.txt_BTD[0, :n], both.txt_BTD[0, :n], rtol=0, atol=1e-5)
    torch.testing.assert_close(alone.pooled_BP[0], both.pooled_BP[0], rtol=0, atol=1e-5)
    empty = enc(enc.tokenize([""]))
    assert int(empty.mask_BT.sum()) == (1 if padding == "masked" else 16)
    assert torch.isfinite(empty.txt_BTD).all() and torch.isfinite(empty.pooled_BP).all()
    if padding == "masked":      # without the mask the padding would change the short caption's states
        unmasked = WordTextEncoder(vocabulary(), max_tokens=16, dim=32, layers=2, padding="padded").eval()
        unmasked.load_state_dict(enc.state_dict())
        a = unmasked(enc.tokenize([short])).txt_BTD[0, :3]
        b = unmasked(enc.tokenize([short, long])).txt_BTD[0, :3]
        assert (a - b).abs().max() > 1e-3


def test_long_prompt_is_truncated_with_a_warning():
    enc = WordTextEncoder(vocabulary(), max_tokens=4)
    with pytest.warns(PromptTooLong, match="truncated to the encoder's limit of 4"):
        tok = enc.tokenize(["a small red circle in the top left"])
    assert tok["ids"].shape == (1, 4)


def test_batch_tokens_pads_to_a_common_length():
    a = {"ids": torch.ones(2, 3, dtype=torch.long)}
    b = {"ids": torch.ones(1, 5, dtype=torch.long)}
    both = batch_tokens(a, b)
    assert both["ids"].shape == (3, 5) and both["ids"][:2, 3:].eq(0).all()
    assert pad_tokens(b, 5)["ids"] is b["ids"]


def test_captions_that_differ_by_one_word_are_far_apart_at_initialisation():
    """Word identity must survive the untrained encoder: if every caption looks alike to the DiT at
    the start, conditioning on position/colour words takes thousands of steps to appear."""
    torch.manual_seed(0)
    enc = WordTextEncoder(vocabulary(), max_tokens=16, dim=96, layers=1).eval()
    rows = ["top left", "top right", "center", "bottom left"]
    emb = enc(enc.tokenize([f"a large red square in the {r}" for r in rows]))
    pooled = emb.pooled_BP
    spread = (pooled - pooled.mean(0)).norm(dim=1).mean() / pooled.norm(dim=1).mean()
    assert spread > 0.2, float(spread)
    # the sequence keeps the words' order: swapping "from" and "to" targets changes it
    a, b = enc(enc.tokenize(["a red circle moving from the top left to the bottom right",
                             "a red circle moving from the bottom right to the top left"])).txt_BTD
    assert (a - b).abs().mean() > 0.1


def test_batch_tokens_pads_each_key_to_its_own_length():
    # T5 ids may be long while CLIP's are capped at its positions: padding CLIP to T5's length
    # would ask CLIP for positions it does not have.
    a = {"t5_ids": torch.ones(1, 96, dtype=torch.long), "clip_ids": torch.ones(1, 77, dtype=torch.long)}
    b = {"t5_ids": torch.ones(2, 3, dtype=torch.long), "clip_ids": torch.ones(2, 77, dtype=torch.long)}
    out = batch_tokens(a, b)
    assert out["t5_ids"].shape == (3, 96) and out["clip_ids"].shape == (3, 77)
    assert out["t5_ids"][1:, 3:].eq(0).all()
