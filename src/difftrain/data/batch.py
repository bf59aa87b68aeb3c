"""Sequence assembly: every task becomes the same thing, a token sequence with (index, row, col)
position ids and a loss mask.

- text-to-image: one target frame at index 0;
- editing: the target at index 0 and the reference image at index 1 (as FLUX Kontext), no loss
  on the reference;
- keyframes: K frames at indices 0..K-1; frames given as conditioning are clean and carry no loss.
The trainer and the model never ask which task a batch is; ``task`` is only for logging.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from difftrain.models.text import TextEmbedding
from difftrain.tokens import image_ids, patchify, unpatchify


@dataclass
class Batch:
    x0_BLC: Tensor                 # clean tokens: targets and conditions (targets are ignored when sampling)
    ids_BL3: Tensor                # position ids (index, row, col)
    loss_mask_BL: Tensor           # True on target tokens: noised, predicted, in the loss
    tokens: dict[str, Tensor]      # tokenized prompts (see models.text)
    prompts: list[str]
    grid: tuple[int, int, int]     # (frames, latent h, latent w): how tokens unpack into frames
    task: str = "t2i"
    meta: list[dict] = field(default_factory=list)   # per-example facts for evaluation and logging
    sample_ids: list[int] = field(default_factory=list)  # the examples' ids (what noise and timesteps are drawn from)
    # per example, how many earlier slots of its global batch hold the same id (a store stream whose batch crosses
    # an epoch boundary can serve an id twice): drawn apart (``flow.draw_t_and_noise``); empty = none repeats
    repeats: list[int] = field(default_factory=list)
    text: TextEmbedding | None = None   # precomputed by frozen encoders (the latent store); else from ``tokens``
    pairs: int = 0                 # a preference-pair batch: rows [0, pairs) winners, [pairs, 2 pairs) their losers
    # a store step's reads on this rank (on the step's first micro-batch): rows asked for and rows unreadable; the
    # trainer sums them over ranks for the run's read-error budget (``StoreLoader.account_reads``)
    rows_asked: int = 0
    rows_unreadable: int = 0
    # the user's loss mask: False on target tokens that are noised and predicted but neither count in the loss nor
    # in its token count (``counted``); None = every target token counts
    keep_BL: Tensor | None = None
    # per-token weights of the loss on the tokens it counts (``data.edit_changed_weight``); None = every token 1
    weight_BL: Tensor | None = None
    # a DPO step's replay micro-batch (``dpo.replay_weight``): samples of the base's training data, moved with this one
    replay: "Batch | None" = None

    @property
    def counted_BL(self) -> Tensor:
        """Tokens the loss is taken on: targets the loss mask keeps."""
        return self.loss_mask_BL if self.keep_BL is None else self.loss_mask_BL & self.keep_BL

    @property
    def loss_weight_BL(self) -> Tensor:
        """Each token's weight in the loss and its count: ``counted_BL`` as 0/1, times ``weight_BL`` where given."""
        w = self.counted_BL.float()
        return w if self.weight_BL is None else w * self.weight_BL

    def _map(self, fn) -> "Batch":
        text = None if self.text is None else TextEmbedding(fn(self.text.txt_BTD), fn(self.text.pooled_BP),
                                                            fn(self.text.mask_BT))
        return replace(self, x0_BLC=fn(self.x0_BLC), ids_BL3=fn(self.ids_BL3), loss_mask_BL=fn(self.loss_mask_BL),
                       tokens={k: fn(v) for k, v in self.tokens.items()}, text=text,
                       keep_BL=None if self.keep_BL is None else fn(self.keep_BL),
                       weight_BL=None if self.weight_BL is None else fn(self.weight_BL),
                       replay=None if self.replay is None else self.replay._map(fn))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """Page-locked host copies, so ``to(cuda, non_blocking=True)`` overlaps the copy with compute."""
        return self._map(lambda t: t.pin_memory())

    def __len__(self) -> int:
        return self.x0_BLC.shape[0]

    def rows(self, sl: slice) -> "Batch":
        """Examples ``sl`` of the batch (a rank's share of a request)."""
        text = None if self.text is None else TextEmbedding(self.text.txt_BTD[sl], self.text.pooled_BP[sl],
                                                            self.text.mask_BT[sl])
        return replace(self, x0_BLC=self.x0_BLC[sl], ids_BL3=self.ids_BL3[sl], loss_mask_BL=self.loss_mask_BL[sl],
                       tokens={k: v[sl] for k, v in self.tokens.items()}, prompts=self.prompts[sl],
                       meta=self.meta[sl], sample_ids=self.sample_ids[sl], repeats=self.repeats[sl], text=text,
                       keep_BL=None if self.keep_BL is None else self.keep_BL[sl],
                       weight_BL=None if self.weight_BL is None else self.weight_BL[sl], replay=None)


def assemble(latents_BFCHW: Tensor, indices: list[int], target_BF: Tensor, tokens: dict[str, Tensor],
             prompts: list[str], task: str, meta: list[dict] | None = None) -> Batch:
    """Pack F latent frames per example into one sequence. Frame f sits at RoPE index ``indices[f]``;
    ``target_BF[b, f]`` says whether frame f of example b is predicted (True) or given (False)."""
    B, F, C, H, W = latents_BFCHW.shape
    if len(indices) != F or tuple(target_BF.shape) != (B, F):
        raise ValueError(f"{F} frames need {F} indices and a ({B}, {F}) target mask; "
                         f"got {len(indices)} and {tuple(target_BF.shape)}")
    x = patchify(latents_BFCHW.reshape(B * F, C, H, W)).reshape(B, F, (H // 2) * (W // 2), C * 4)
    return assemble_packed(x, H, W, indices, target_BF, tokens, prompts, task, meta)


def assemble_packed(tokens_BFLC: Tensor, H: int, W: int, indices: list[int], target_BF: Tensor,
                    tokens: dict[str, Tensor], prompts: list[str], task: str, meta: list[dict] | None = None) -> Batch:
    """``assemble`` for latents already packed in 2x2 patches, frame by frame ((B, F, H/2 * W/2, C*4), as the
    latent store keeps them): a reshape, no copy."""
    B, F, L, Cp = tokens_BFLC.shape
    h, w = H // 2, W // 2
    if L != h * w or len(indices) != F or tuple(target_BF.shape) != (B, F):
        raise ValueError(f"packed latents {tuple(tokens_BFLC.shape)} do not match a {H}x{W} latent with {F} "
                         f"frames, {len(indices)} indices and a {tuple(target_BF.shape)} target mask")
    if not bool(target_BF.any(1).all()):
        raise ValueError("every example needs at least one target frame")
    dev = tokens_BFLC.device
    ids = torch.cat([image_ids(h, w, i, dev) for i in indices]).expand(B, -1, -1)
    mask = target_BF.to(dev).repeat_interleave(L, dim=1)
    return Batch(tokens_BFLC.reshape(B, F * L, Cp), ids.contiguous(), mask, tokens, prompts, (F, H, W), task,
                 meta or [])


def frames_of(tokens_BLC: Tensor, grid: tuple[int, int, int]) -> Tensor:
    """Inverse of ``assemble``'s packing: (B, L, C*4) -> latents (B, F, C, H, W)."""
    F, H, W = grid
    B, L, Cpp = tokens_BLC.shape
    per = L // F
    x = unpatchify(tokens_BLC.reshape(B * F, per, Cpp), H, W)
    return x.reshape(B, F, *x.shape[1:])
