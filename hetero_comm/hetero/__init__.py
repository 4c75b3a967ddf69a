"""Heterogeneous clusters: batch sizes proportional to measured speed.

* :func:`plan_batch_sizes`: integer batch sizes proportional to per-rank speed, summing to
  the global batch (largest remainder).
* :class:`HeteroSampler`: each rank's share of every global batch, every sample once per
  epoch, the same number of steps on every rank.
* :class:`DynamicBatchController`: measures each rank's compute speed, re-plans the sizes
  (per epoch, or every K steps with smoothing and a rate bound) and sets the hook's
  ``rank_weight`` every step.

Set each hook state's ``rank_weight`` to ``local_batch / global_batch`` (see
:meth:`HeteroSampler.rank_weights`) and average the loss over the local batch: the result is
then exactly the gradient of the global batch's mean loss.
"""

from .controller import DynamicBatchController
from .planning import plan_batch_sizes
from .sampler import HeteroSampler

__all__ = ["plan_batch_sizes", "HeteroSampler", "DynamicBatchController"]
