"""Fit a model's training step in less memory: keep, swap or (partly) recompute each block's activations.

1. Profile: :func:`profile_memory` times each block and measures what it saves and adds at
   its peak (:class:`MemoryMeter`), and the swap space's bandwidth.
2. Plan: :func:`plan_memory` picks one of :data:`CHOICES` per block for a memory budget, by
   the swap-or-recompute rule (:func:`rule_choices`) or exactly (integer program); :func:`predict` gives
   the cost model's peak and step time for any choice.
   :func:`tune_memory_plan` runs the model's best few plans and keeps the fastest measured.
3. Apply: :func:`apply_memory_plan` wraps the blocks (``torch.utils.checkpoint`` to recompute,
   selectively for a partial recomputation,
   ``saved_tensors_hooks`` to swap); the model trains as before, bit for bit.
"""

from .apply import AppliedMemoryPlan, apply_memory_plan
from .meter import MemoryMeter
from .plan import (CHOICES, MemoryPlan, candidate_plans, exhaustive_memory_plan, plan_memory, predict,
                   rule_choices)
from .profile import MemoryProfile, chain_blocks, measure_swap_bandwidth, profile_memory
from .swap import FileSwap, HostSwap, SwapSpace, make_swap_space
from .tune import PlanTrial, TunedMemoryPlan, tune_memory_plan

__all__ = ["MemoryMeter", "MemoryProfile", "profile_memory", "measure_swap_bandwidth", "chain_blocks",
           "MemoryPlan", "CHOICES", "plan_memory", "candidate_plans", "predict", "rule_choices", "exhaustive_memory_plan",
           "apply_memory_plan", "AppliedMemoryPlan", "tune_memory_plan", "TunedMemoryPlan", "PlanTrial", "SwapSpace", "FileSwap", "HostSwap",
           "make_swap_space"]
