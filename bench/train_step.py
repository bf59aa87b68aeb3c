"""Training-step time of our MMDiT vs. diffusers' FluxTransformer2DModel of the same size and weights.

Both run a plain loop: forward, MSE against a fixed target, backward, AdamW step, on the same batch.
Prints one JSON object: ``ratio_eager`` (ours eager / theirs eager), ``ratio_compiled`` (ours with
per-block torch.compile / theirs eager, measured in the same window), ``ratio_both_compiled`` (both
compiled), ``compile_speedup_ours`` and the per-step medians in seconds.

    python bench/train_step.py [--hidden 256 --heads 4 --double 2 --single 4 --tokens 256 --batch 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from diffusers import FluxTransformer2DModel

from difftrain.models.dit import MMDiT
from difftrain.tokens import image_ids
from difftrain.models.flux_adapter import from_diffusers, params_from_diffusers_config
from difftrain.parallel import compile_blocks


def step_times(fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="image tokens per sample (a square number)")
    ap.add_argument("--text-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled measurements")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    head_dim = args.hidden // args.heads
    a = head_dim // 8                      # FLUX's split: (16, 56, 56) of 128
    rope = (a, (head_dim - a) // 2, head_dim - a - (head_dim - a) // 2)
    torch.manual_seed(0)
    cfg = dict(patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
               attention_head_dim=head_dim, num_attention_heads=args.heads, joint_attention_dim=256,
               pooled_projection_dim=128, guidance_embeds=False, axes_dims_rope=rope)
    theirs = FluxTransformer2DModel(**cfg)
    params = params_from_diffusers_config(dict(theirs.config))

    def fresh_ours() -> MMDiT:
        m = MMDiT(params)
        m.load_state_dict(from_diffusers(theirs.state_dict(), params))
        return m

    side = int(args.tokens ** 0.5)
    B, T = args.batch, args.text_tokens
    x = torch.randn(B, side * side, 64)
    txt = torch.randn(B, T, 256)
    pooled = torch.randn(B, 128)
    t = torch.rand(B)
    ids = image_ids(side, side).float()
    target = torch.randn(B, side * side, 64)

    def loop(model, forward):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step():
            loss = (forward(model) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def f_theirs(m):
        return m(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled, timestep=t,
                 img_ids=ids, txt_ids=torch.zeros(T, 3), return_dict=False)[0]

    ids_b = ids[None].expand(B, -1, -1)

    def f_ours(m):
        return m(x, ids_b, txt, t, pooled)

    with torch.no_grad():
        same = (f_ours(fresh_ours()) - f_theirs(theirs)).abs().max().item()
    result = {"config": {**{k: v for k, v in vars(args).items()}, "rope": rope}, "max_abs_diff_forward": same,
              "threads": torch.get_num_threads()}
    # Interleave measurements so machine noise hits both sides alike.
    ours_e, theirs_e = fresh_ours(), FluxTransformer2DModel(**cfg)
    theirs_e.load_state_dict(theirs.state_dict())
    s_ours, s_theirs = loop(ours_e, f_ours), loop(theirs_e, f_theirs)
    t_ours, t_theirs = [], []
    for _ in range(3):
        t_theirs += step_times(s_theirs, args.warmup if not t_theirs else 1, args.steps // 3 + 1)
        t_ours += step_times(s_ours, args.warmup if not t_ours else 1, args.steps // 3 + 1)
    result["ours_eager_s"] = statistics.median(t_ours)
    result["theirs_eager_s"] = statistics.median(t_theirs)
    result["ratio_eager"] = result["ours_eager_s"] / result["theirs_eager_s"]
    if not args.no_compile:
        ours_c = fresh_ours()
        compile_blocks(ours_c)
        t0 = time.perf_counter()
        s_ours_c = loop(ours_c, f_ours)
        s_ours_c()
        result["compile_seconds_ours"] = time.perf_counter() - t0
        theirs_c = FluxTransformer2DModel(**cfg)
        theirs_c.load_state_dict(theirs.state_dict())
        for block in list(theirs_c.transformer_blocks) + list(theirs_c.single_transformer_blocks):
            block.compile()
        s_theirs_c = loop(theirs_c, f_theirs)
        s_theirs_c()
        tc_ours, tc_theirs, te_theirs, te_ours = [], [], [], []
        for _ in range(3):
            te_theirs += step_times(s_theirs, 1, args.steps // 3 + 1)
            te_ours += step_times(s_ours, 1, args.steps // 3 + 1)
            tc_ours += step_times(s_ours_c, 1, args.steps // 3 + 1)
            tc_theirs += step_times(s_theirs_c, 1, args.steps // 3 + 1)
        result["ours_compiled_s"] = statistics.median(tc_ours)
        result["theirs_compiled_s"] = statistics.median(tc_theirs)
        # Ratios use the eager times of this same window: the machine's speed drifts between windows.
        result["theirs_eager_window_s"] = statistics.median(te_theirs)
        result["ratio_compiled"] = result["ours_compiled_s"] / result["theirs_eager_window_s"]
        result["compile_speedup_ours"] = statistics.median(te_ours) / result["ours_compiled_s"]
        result["ratio_both_compiled"] = result["ours_compiled_s"] / result["theirs_compiled_s"]
    else:
        result["ratio_compiled"] = None
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
