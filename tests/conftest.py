import pytest
import torch

# Tests run tiny models: one thread avoids OpenMP spin-waiting when the CI machine is shared.
torch.set_num_threads(1)

from difftrain.config import load_config

TINY = [
    "model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
    "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "text.max_tokens=16", "data.image_size=32",
    "data.frames=3", "data.world_size=64", "train.global_batch=4", "train.minutes=0", "train.warmup_steps=2",
    "train.log_every=1", "train.lr=1e-3", "sample.steps=3", "eval.n=4",
]


@pytest.fixture
def tiny_cfg():
    """A config small enough for a CPU test: 32x32 images, 4x4 tokens a frame, a ~50k-parameter DiT."""
    def make(*overrides):
        return load_config(None, TINY + list(overrides))
    return make
