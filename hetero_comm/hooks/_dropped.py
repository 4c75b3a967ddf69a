"""Sending only the part of the gradient that units kept at this step touch
(:mod:`hetero_comm.nn.unit_dropout`).

Every rank drops the same units, so the gradient of a dropped unit is zero on every rank in
the rows of the layer that produces it (weight rows, bias entries) and in the columns of the
layer that consumes it: the sum there is zero, and sending it is waste. :class:`KeptLayout`
maps a flat layout of parameters (a DDP bucket, or a plan bucket of error-feedback state)
onto the compact vector of what is kept. A hook then works on that vector as if it were the
bucket: the dense path allreduces it, a compressing hook compresses it with error feedback on
the kept part of the residual. The residual of dropped rows and columns is left as it is
(held back, sent at a step that keeps them), and the result is expanded with zeros there.

The parts are gathered with ``index_select`` / ``index_copy_`` on 2-D views of each
parameter (one index per row or column, any gradient dtype); the segment kernels would zero
what they pack and need float32.
"""

import logging
from typing import List, Optional, Sequence

import torch

from .._layout import Piece
from ._plan import PlanBucket

__all__ = ["KeptLayout", "KeptPart", "kept_layout", "send_kept_part", "DroppedUnits"]

logger = logging.getLogger("hetero_comm")


class KeptLayout:
    """The kept part of a flat layout of ``pieces``: ``numel`` kept elements of ``full_numel``."""

    def __init__(self, pieces: List[Piece]) -> None:
        self.pieces = pieces
        self.full_numel = sum(piece.numel for piece in pieces)
        self.numel = sum(piece.kept_numel for piece in pieces)

    @property
    def dropped(self) -> int:
        return self.full_numel - self.numel

    def _views(self, flat: torch.Tensor, compact: torch.Tensor):
        """Per piece: its matrix in ``flat`` and its kept part's matrix in ``compact``."""
        at = 0
        for piece in self.pieces:
            matrix = flat[piece.start: piece.start + piece.numel].view(piece.rows, piece.cols)
            kept_rows = piece.rows if piece.kept_rows is None else piece.kept_rows.numel()
            yield piece, matrix, compact[at: at + piece.kept_numel].view(kept_rows, -1)
            at += piece.kept_numel

    def gather(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The kept part of ``flat`` into ``out`` (``numel`` elements)."""
        for piece, matrix, target in self._views(flat, out):
            if piece.kept_rows is not None:
                matrix = matrix.index_select(0, piece.kept_rows)
            if piece.kept_cols is not None:
                matrix = matrix.index_select(1, piece.kept_cols)
            target.copy_(matrix)
        return out

    def scatter(self, compact: torch.Tensor, flat: torch.Tensor) -> None:
        """Inverse of :meth:`gather`: ``compact`` into the kept part; the rest untouched."""
        for piece, matrix, source in self._views(flat, compact):
            if piece.kept_rows is None and piece.kept_cols is None:
                matrix.copy_(source)
            elif piece.kept_cols is None:
                matrix.index_copy_(0, piece.kept_rows, source)
            elif piece.kept_rows is None:
                matrix.index_copy_(1, piece.kept_cols, source)
            else:
                matrix.index_put_((piece.kept_rows.unsqueeze(1), piece.kept_cols), source)

    def expand(self, compact: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """``compact`` into the kept part of ``flat``, zeros everywhere else."""
        if self.dropped:
            flat.zero_()
        self.scatter(compact, flat)
        return flat


def kept_layout(units, parameters: Sequence[torch.Tensor]) -> Optional[KeptLayout]:
    """The kept part of ``parameters`` laid out one after another (a bucket's layout) at
    this step, or ``None`` when ``units`` (a :class:`~hetero_comm.nn.UnitDropoutSet`) dropped
    nothing in them."""
    pieces, start = [], 0
    for parameter in parameters:
        piece = units.kept_piece(parameter)
        pieces.append(piece._replace(start=start) if piece is not None else
                      Piece(start, 1 if parameter.numel() else 0, parameter.numel()))
        start += parameter.numel()
    layout = KeptLayout(pieces)
    return layout if layout.dropped else None


class KeptPart(PlanBucket):
    """The kept part of ``part`` as a plan bucket of its own, in pooled scratch buffers."""

    def __init__(self, part: PlanBucket, numel: int) -> None:
        super().__init__(("kept",), (numel,))
        self.part = part

    @property
    def origin(self) -> PlanBucket:
        return self.part.origin

    def reset(self) -> None:
        """Reset the bucket it was gathered from (its own tensors are scratch, already back in
        the pool when a flag read later on the device calls this)."""
        self.part.reset()


def send_kept_part(send, units):
    """``send`` (a compressing hook's send function: ``send(state, plan_bucket, grad, index)``)
    on the part of each plan bucket that ``units`` keep at this step: the bucket's
    error-feedback state and gradient gathered into compact pooled buffers, the state
    scattered back once ``send`` has updated it, the result expanded with zeros."""

    def send_kept(state, part: PlanBucket, grad: torch.Tensor, index: int) -> torch.futures.Future:
        layout = kept_layout(units, state.plan.parameters_of(part))
        if layout is None:
            return send(state, part, grad, index)
        pool = state.pool
        # What the hook keeps besides the tensors (the two-level hook's share layout) names
        # positions in the part as last sent whole or compact: a kept layout starts afresh.
        part.extra.clear()
        compact = KeptPart(part, layout.numel)
        for name, tensor in part.tensors.items():
            compact.tensors[name] = layout.gather(tensor, pool.acquire(layout.numel, tensor.dtype, grad.device))
        compact_grad = layout.gather(grad, pool.acquire(layout.numel, grad.dtype, grad.device))
        buffers = [compact_grad, *compact.tensors.values()]
        state.statistics.count_bytes(layout.dropped * grad.element_size(), 0, True)
        try:
            future = send(state, compact, compact_grad, index)
        except FloatingPointError:  # send reset the compact state, and so the part's
            for buffer in buffers:
                pool.release(buffer)
            raise
        for name, tensor in part.tensors.items():  # send has updated them on this thread
            layout.scatter(compact.tensors[name], tensor)

        def expand(fut) -> torch.Tensor:
            value = fut.value()
            # again: a send that finishes its agreement later (the CPU's pipelined codec)
            # updates them after it returned
            for name, tensor in part.tensors.items():
                layout.scatter(compact.tensors[name], tensor)
            layout.expand(value, grad)
            state.callbacks.release(buffers, grad.device)
            return grad

        return future.then(expand)

    return send_kept


class DroppedUnits:
    """The unit-dropout set whose dropped units a hook state does not send, and the check that
    its masks move on between synchronised steps."""

    def __init__(self, units, owner: str) -> None:
        if not callable(getattr(units, "kept_piece", None)):
            raise TypeError(f"skip_dropped_units takes a hetero_comm.nn.UnitDropoutSet or None; "
                            f"got {type(units).__name__}")
        self.units, self.owner = units, owner
        self._masks_step, self.warned = None, False  # warned: the masks warning was given
        self._non_finite_at_checks = (0, 0)  # the count at the last two mask checks

    def kept_layout(self, parameters) -> Optional[KeptLayout]:
        """What units kept at this step touch of ``parameters`` (a flat layout); ``None``:
        send all."""
        return kept_layout(self.units, parameters)

    def check_masks_advance(self, non_finite_buckets: int) -> None:
        """Warn (once) when the masks did not change between two synchronised steps: the set
        was not attached to the optimizer, so the same units stay dropped. Not after a bucket
        was handed on holding NaN in the last two steps (``non_finite_buckets`` grew: a
        ``GradScaler`` then skips ``optimizer.step()``, and the attached set with it; on CUDA
        that bucket is counted a step late)."""
        skipped = non_finite_buckets > self._non_finite_at_checks[0]
        self._non_finite_at_checks = (self._non_finite_at_checks[1], non_finite_buckets)
        if self.units.step == self._masks_step and not self.warned and not skipped:
            logger.warning("%s: the unit-dropout masks did not change since the last step; call "
                           "units.attach(optimizer) (or units.next_step() after each step)",
                           self.owner)
            self.warned = True
        self._masks_step = self.units.step
