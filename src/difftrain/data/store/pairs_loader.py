"""The DPO pairs loader: the training pairs of an ``EncodedPairs`` (``data/store/pairs.py``), a step at a time.

The loader serves, per optimizer step, ``global_pairs`` pairs of one group (drawn per step from (seed, step),
weighted by the groups' sizes), each group read in a fresh permutation every epoch (seeded by (seed, group,
epoch)); data rank r of N takes pairs [r P/N, (r+1) P/N) of the step, so a pair never splits across ranks, in
micro-batches of ``micro_pairs``. A batch holds the winners then their losers (``Batch.pairs``), both with the
pair's id as sample id: the objective draws one t and one noise for both. Text is padded to one length for the
whole step (the text rule's length for the step's longest prompt), however the step is split. The loader's
state (step and the groups' cursors) is in the checkpoint.
"""

from __future__ import annotations

import numpy as np

from difftrain.data.batch import Batch
from difftrain.data.store.pairs import EncodedPairs, Tokenize
from difftrain.errors import UserError


class PairsLoader:
    """The training pairs, per optimizer step (see the module docstring). ``tokenize`` is the trained text
    encoder's (None when the pairs carry frozen encoders' states)."""

    def __init__(self, pairs: EncodedPairs, tokenize: Tokenize | None, global_pairs: int, micro_pairs: int, rank: int,
                 ranks: int, seed: int):
        if global_pairs % ranks:
            raise UserError(f"train.global_batch = {global_pairs} pairs do not split over {ranks} data-parallel "
                            "ranks (a pair never splits: the global batch must be a multiple of the rank count)")
        share = global_pairs // ranks
        micro = micro_pairs or share
        if share % micro:
            raise UserError(f"train.micro_batch = {micro_pairs} pairs must divide each rank's {share} pairs")
        for g in pairs.groups:
            if 0 < len(g.train) < global_pairs:
                raise UserError(f"the pairs file has {len(g.train)} training pairs of task {g.task!r} at "
                                f"{g.size[1]}x{g.size[0]}, fewer than train.global_batch = {global_pairs} pairs a "
                                "step: rank more candidates, or lower train.global_batch")
        if pairs.train_pairs == 0:
            raise UserError("the pairs file has no training pairs (split = 'train')")
        self.pairs, self.tokenize = pairs, tokenize
        self.global_pairs, self.micro, self.rank, self.share, self.seed = global_pairs, micro, rank, share, seed
        self.sizes = np.array([len(g.train) for g in pairs.groups], dtype=np.float64)
        self.step = 0
        self.cursor = [0] * len(pairs.groups)       # pairs of each group served so far (over epochs)
        self._perm: dict[tuple[int, int], np.ndarray] = {}

    def __iter__(self) -> "PairsLoader":
        return self

    def _group_at(self, step: int) -> int:
        rng = np.random.default_rng([self.seed, 505, step])
        return int(rng.choice(len(self.sizes), p=self.sizes / self.sizes.sum()))

    def _permutation(self, g: int, epoch: int) -> np.ndarray:
        if (g, epoch) not in self._perm:
            self._perm = {k: v for k, v in self._perm.items() if k[1] >= epoch - 1}
            self._perm[(g, epoch)] = np.random.default_rng([self.seed, 606, g, epoch]).permutation(
                len(self.pairs.groups[g].train))
        return self._perm[(g, epoch)]

    def _take(self, g: int, n: int) -> np.ndarray:
        train, out = self.pairs.groups[g].train, []
        while sum(len(x) for x in out) < n:
            epoch, pos = divmod(self.cursor[g], len(train))
            k = min(n - sum(len(x) for x in out), len(train) - pos)
            out.append(train[self._permutation(g, epoch)[pos:pos + k]])
            self.cursor[g] += k
        return np.concatenate(out)

    def __next__(self) -> list[Batch]:
        g = self._group_at(self.step)
        rows = self._take(g, self.global_pairs)
        self.step += 1
        length = self.pairs.text_length(rows, self.tokenize)
        mine = rows[self.rank * self.share:(self.rank + 1) * self.share]
        return [self.pairs.batch(mine[m:m + self.micro], self.tokenize, length)
                for m in range(0, self.share, self.micro)]

    def validation_batches(self, ranks: int) -> list[tuple[Batch, bool]]:
        """This rank's validation batches, round-robin over ranks, each with whether it counts: every rank gets
        the same number (a rank with none left reruns the first batch, not counted), so the forwards of a
        sharded model stay in step."""
        chunks = [g.validation[s:s + self.micro] for g in self.pairs.groups
                  for s in range(0, len(g.validation), self.micro)]
        if not chunks:
            return []
        per_rank = -(-len(chunks) // ranks)
        mine = [(c, True) for c in chunks[self.rank::ranks]]
        mine += [(chunks[0], False)] * (per_rank - len(mine))
        return [(self.pairs.batch(c, self.tokenize), counts) for c, counts in mine]

    def state_dict(self) -> dict:
        return {"kind": "pairs", "step": self.step, "cursor": list(self.cursor), "global_pairs": self.global_pairs,
                "key": self.pairs.key}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "pairs":
            raise ValueError("the checkpoint's loader state is not a pairs loader's: resume a DPO run with "
                             "'difftrain dpo'")
        if state["key"] != self.pairs.key:
            raise ValueError("the checkpoint was trained on another pairs file (or another encoding of it): the "
                             "data order would differ")
        if int(state["global_pairs"]) != self.global_pairs:
            raise ValueError(f"loader state was saved with {state['global_pairs']} pairs a step, this run has "
                             f"{self.global_pairs}")
        self.step, self.cursor = int(state["step"]), [int(c) for c in state["cursor"]]
