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


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for every test module that prepares a store (starting Ray costs seconds). Three logical
    CPUs (on however many cores): room for two encoder actors and a decode task."""
    from difftrain.data.prepare.job import start_ray
    ray = start_ray(num_cpus=3)
    yield ray
    ray.shutdown()


@pytest.fixture
def tiny_cfg():
    """A config small enough for a CPU test: 32x32 images, 4x4 tokens a frame, a ~50k-parameter DiT."""
    def make(*overrides):
        return load_config(None, TINY + list(overrides))
    return make


def run_diffusers_flux(model, x, ids, txt, pooled, t, guidance):
    """diffusers FluxTransformer2DModel on (B, L, C) tokens; it multiplies timestep and guidance by 1000
    itself, as ours does."""
    with torch.no_grad():
        return model(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled, timestep=t,
                     img_ids=ids.float(), txt_ids=torch.zeros(txt.shape[1], 3), guidance=guidance,
                     return_dict=False)[0]


def run_ours_flux(model, x, ids, txt, pooled, t, guidance):
    B = x.shape[0]
    with torch.no_grad():
        return model(x, ids.expand(B, -1, -1), txt, t, pooled, guidance,
                     txt_ids_BT3=torch.zeros(B, txt.shape[1], 3, dtype=ids.dtype))


def fixed_dit_output(dit) -> torch.Tensor:
    """The DiT's output on a fixed input (2 samples of 16 image tokens, 5 text tokens; seed 0), as the checkpoint
    fixtures recorded it when they were written (``dit_output.safetensors``)."""
    g = torch.Generator().manual_seed(0)
    p = dit.params
    x = torch.randn(2, 16, p.in_channels, generator=g)
    ids = torch.randint(0, 4, (2, 16, 3), generator=g)
    txt = torch.randn(2, 5, p.text_dim, generator=g)
    pooled = torch.randn(2, p.pooled_dim, generator=g)
    t = torch.rand(2, generator=g)
    with torch.no_grad():
        return dit(x, ids, txt, t, pooled)
