"""Drop-in DDP communication hooks: ``ddp_model.register_comm_hook(state, hook)``.

* :func:`segment_sparse_hook` with :class:`SegmentSparseState`: the most important segments
  of each bucket, selected the same on every rank (two plain allreduces per bucket: the
  importance, then the values), error feedback.
* :func:`dct_quant_hook` with :class:`DCTQuantState`: quantized DCT coefficients (a MAX
  allreduce of the scales, a sum allreduce of the integers), error feedback.
* :func:`two_level_hook` with :class:`TwoLevelState`: for machines of several ranks, a dense
  sum inside each machine and the sparse hook's steps between machines, each local rank
  carrying its own share; the density fixed or chosen from the link.
* :func:`allreduce_hook` with :class:`AllreduceState`: the dense baseline, same weighting.

Every state takes ``rank_weight`` (this rank's share of the result ``sum_i w_i g_i``) and
offers ``stats()``, ``state_dict()``, ``load_state_dict()``, and ``prepare_optimizer()``,
which fits the user's dense optimizer to what the hook hands it while keeping the user's
learning rate and schedule (``_optimizer.py``). The compressing states
(:class:`ErrorFeedbackState`) also take ``warmup_steps`` and ``min_compress_numel`` and keep
their error-feedback state by parameter (``_plan.py``), so it survives DDP's bucket rebuild
and a resumed run.

Modules: ``_state.py`` (the states' shared settings, statistics, checkpoints and running),
``_plan.py`` (the parameter-keyed error-feedback layout and its routing), ``_optimizer.py``
(what a hook hands the optimizer, and fitting the optimizer to it), ``_dropped.py`` (sending
only what kept units touch), ``_codec.py`` (the sparse hook's exchange on the CPU: three
kernels a bucket, the agreement pipelined), ``_sparse_parts.py`` (the parts the sparse hook's
steps call on a GPU), ``_exchange_thread.py`` (the two-level sync's background thread),
``_machines.py`` (which ranks share a machine, and their groups), ``_auto_density.py`` (the
density chosen from the link), ``variants.py`` (the config objects of variants with settings
of their own: :class:`DCT`, :class:`AutoDensity`), one module per hook.
"""

from ._state import ErrorFeedbackState, HookState
from .allreduce import AllreduceState, allreduce_hook
from .dct_quant import DCTQuantState, dct_quant_hook
from .segment_sparse import SegmentSparseState, segment_sparse_hook
from .two_level import TwoLevelState, two_level_hook
from ._machines import MachineLayout
from ._optimizer import unwrap_optimizer
from .variants import DCT, AutoDensity

__all__ = ["HookState", "ErrorFeedbackState", "AllreduceState", "allreduce_hook",
           "SegmentSparseState", "segment_sparse_hook", "DCTQuantState", "dct_quant_hook",
           "TwoLevelState", "two_level_hook", "MachineLayout", "DCT", "AutoDensity", "unwrap_optimizer"]
