"""What one training step hands on: the batches fetched for it (``Fetched``) and the figures it produced
(``StepStats``), read by the loop and by the reports (``outputs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftrain.data.batch import Batch


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int = 0          # real (unpadded) tokens of the global batch
    samples: int = 0
    flops: float = 0.0       # DiT training FLOPs of the global batch
    skipped: bool = False    # non-finite loss or gradient: no update
    stop: bool = False       # some rank was asked to stop (preemption): every rank stops after this step
    fwd_bwd_s: float = 0.0
    optim_s: float = 0.0
    wait_s: float = 0.0      # time in the step's explicit collectives (a straggler waits least)
    rows: torch.Tensor | None = None   # the objective's per-example statistics, every rank's (on the device)


@dataclass
class Fetched:
    batches: list[Batch]
    t0: float                # when the step began
    data_s: float            # time to take them from the source (with any injected fault)
    step_s: float = 0.0      # time of the optimizer step on them
