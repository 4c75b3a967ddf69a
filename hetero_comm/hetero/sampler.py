"""A batch sampler that gives each rank a share of every global batch proportional to its
speed."""

from typing import Iterator, List, Optional, Sequence

import torch

from .planning import plan_batch_sizes

__all__ = ["HeteroSampler"]


class HeteroSampler:
    """Yield this rank's index lists, one per step, for a dataset of ``num_samples`` items.

    Every epoch the indices ``0 .. num_samples-1`` are shuffled with ``seed + epoch`` (the same
    on every rank) and cut into consecutive global batches of ``global_batch_size``; each
    global batch is cut between ranks by ``batch_sizes`` (rank 0 first). So across ranks every
    sample is used exactly once per epoch and every rank runs the same number of steps. With
    ``drop_last=False`` the final, smaller global batch is split in proportion to the same
    sizes (:func:`plan_batch_sizes` with ``minimum=0`` if it has fewer samples than ranks, so
    a rank may then get an empty batch); ``drop_last=True`` skips it.

    The first epoch uses an equal split unless ``batch_sizes`` is given; call
    :meth:`set_batch_sizes` (e.g. from measured speeds, as
    :class:`~hetero_comm.hetero.DynamicBatchController` does) to change the split, and
    :meth:`set_epoch` before each epoch. A change takes effect from the next index list the
    iterator produces, also within an epoch: the global batches are fixed by the shuffle, only
    their cut between ranks moves, so the cover and the step count stay as above as long as
    every rank changes its sizes at the same step. Use as ``DataLoader(dataset,
    batch_sampler=sampler)``.

    Args:
        num_samples: dataset length, >= 1.
        global_batch_size: samples per step over all ranks, >= world_size.
        rank, world_size: this rank and the number of ranks.
        batch_sizes: per-rank sizes summing to ``global_batch_size`` (default: equal split).
        seed: shuffling seed shared by all ranks.
        drop_last: skip the final smaller global batch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, rank: int, world_size: int,
                 batch_sizes: Optional[Sequence[int]] = None, seed: int = 0,
                 drop_last: bool = False) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, {world_size - 1}]; got {rank!r}")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1; got {num_samples!r}")
        if not isinstance(global_batch_size, int) or global_batch_size < world_size:
            raise ValueError(f"global_batch_size must be an integer >= world_size ({world_size}); "
                             f"got {global_batch_size!r}")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0
        self.set_batch_sizes(batch_sizes if batch_sizes is not None else
                             plan_batch_sizes([1.0] * world_size, global_batch_size))

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` (call on every rank before iterating)."""
        self.epoch = epoch

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Per-rank batch sizes (each >= 1, summing to ``global_batch_size``) for the
        following iterations."""
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != self.world_size or min(sizes) < 1 or sum(sizes) != self.global_batch_size:
            raise ValueError(f"batch_sizes must be {self.world_size} integers >= 1 summing to "
                             f"global_batch_size ({self.global_batch_size}); got {list(batch_sizes)}")
        self.batch_sizes = sizes

    def num_steps(self) -> int:
        """Steps per epoch (the same on every rank, whatever the batch sizes)."""
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def global_batch_of_step(self, step: int) -> int:
        """Samples in global batch ``step`` of an epoch over all ranks: ``global_batch_size``,
        or fewer for the final partial batch."""
        if not 0 <= step < self.num_steps():
            raise ValueError(f"step must be in [0, {self.num_steps() - 1}]; got {step!r}")
        return min(self.global_batch_size, self.num_samples - step * self.global_batch_size)

    def sizes_of_step(self, step: int) -> List[int]:
        """Every rank's batch size at ``step`` under the current ``batch_sizes``."""
        samples = self.global_batch_of_step(step)
        if samples == self.global_batch_size:
            return list(self.batch_sizes)
        return plan_batch_sizes(self.batch_sizes, samples,
                                minimum=1 if samples >= self.world_size else 0)

    def step_sizes(self) -> List[List[int]]:
        """For each step of the epoch, every rank's batch size (under the current sizes)."""
        return [self.sizes_of_step(step) for step in range(self.num_steps())]

    def rank_weights(self) -> List[float]:
        """This rank's share of each step's global batch (its hook's ``rank_weight``), under
        the current sizes."""
        return [sizes[self.rank] / sum(sizes) for sizes in self.step_sizes()]

    def __len__(self) -> int:
        return self.num_steps()

    def __iter__(self) -> Iterator[List[int]]:
        order = torch.randperm(self.num_samples,
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for step in range(self.num_steps()):
            sizes = self.sizes_of_step(step)  # read per step: a re-plan applies at once
            mine = step * self.global_batch_size + sum(sizes[: self.rank])
            yield order[mine: mine + sizes[self.rank]].tolist()
