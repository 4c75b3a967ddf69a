"""Drop-in DDP communication hooks: ``ddp_model.register_comm_hook(state, hook)``.

* :func:`segment_sparse_hook` with :class:`SegmentSparseState`: the most important segments
  of each bucket, one plain allreduce, error feedback.
* :func:`dct_quant_hook` with :class:`DCTQuantState`: quantized low-frequency DCT
  coefficients, error feedback.
* :func:`allreduce_hook` with :class:`AllreduceState`: the dense baseline, same weighting.

Every state takes ``rank_weight`` (this rank's share of the result ``sum_i w_i g_i``),
``warmup_steps`` and ``min_compress_numel``, offers ``stats()``, ``state_dict()`` and
``load_state_dict()``, and survives DDP's bucket rebuild and a resumed run.
"""

from ._common import AllreduceState, HookState, allreduce_hook
from .dct_quant import DCTQuantState, dct_quant_hook
from .segment_sparse import SegmentSparseState, segment_sparse_hook

__all__ = ["HookState", "AllreduceState", "allreduce_hook", "SegmentSparseState",
           "segment_sparse_hook", "DCTQuantState", "dct_quant_hook"]
