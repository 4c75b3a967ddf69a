"""Pipeline + data parallel training across unequal devices.

1. Profile: :func:`profile_layers` on each kind of device (:func:`gather_profiles` shares them).
2. Describe one machine: a :class:`DeviceKind` per device, in a :class:`Cluster` of ``m`` machines.
3. Plan: :func:`plan_pipeline` (integer program; :func:`exhaustive_plan` checks it on small
   cases), read it with :func:`format_plan`, play it with :func:`simulate` / :func:`plot_timeline`.
4. Run: :func:`build_pipeline` turns the plan into ``torch.distributed.pipelining`` stages, each
   data parallel (DDP, any hetero_comm hook) with the same stage on the other machines.
"""

from .cost import Cluster, DeviceKind
from .plan import SCHEDULES, PipelinePlan, StagePlan
from .planner import (capability_order, evaluate_plan, even_plan, exhaustive_plan, plan_pipeline,
                      proportional_plan)
from .profile import LayerProfile, gather_profiles, profile_layers
from .simulate import Simulation, format_plan, plot_timeline, simulate
from .executor import PipelineGroups, PipelineRunner, build_pipeline

__all__ = ["PipelinePlan", "StagePlan", "SCHEDULES", "Cluster", "DeviceKind", "LayerProfile",
           "profile_layers", "gather_profiles", "plan_pipeline", "exhaustive_plan", "even_plan",
           "proportional_plan", "evaluate_plan", "capability_order", "simulate",
           "Simulation", "format_plan", "plot_timeline"]
__all__ += ["PipelineGroups", "PipelineRunner", "build_pipeline"]
