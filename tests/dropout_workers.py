"""Rank functions for the unit-dropout sync tests (:mod:`hetero_comm.nn` with a hook state's
``skip_dropped_units``), run on real gloo ranks by :func:`lab.launch.run_ranks`."""

import copy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from lab.registry import HOOKS
from hetero_comm.nn import UnitDropoutSet, convert_dropout
from hook_workers import batch, flat


def make_dropout_model(seed: int = 0) -> nn.Sequential:
    """Two dropout layers after Linear layers (1,490 parameters), the last layer plain."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Dropout(0.5), nn.Linear(30, 17),
                         nn.Tanh(), nn.Dropout(0.5), nn.Linear(17, 5))


def train_unit_dropout(rank, world_size, hook, settings, steps, options=None):
    """Train the dropout model with unit dropout (p from ``options``, default 0.5) and
    ``hook`` skipping dropped rows (``options["skip"]``, default True), SGD lr 0.05 with the
    set attached (``options["weights"]``: a rank_weight per rank). Records per step each rank's masked local gradient (weighted), the applied
    gradient and the kept units of every layer; at the end what is held back, the
    parameters and the stats. ``options["resume_at"]``: rebuild everything there from
    rank 0's checkpoints (hook state and unit set) and continue. ``options["nan_at"]``
    ``(rank, step)``: that rank's gradient is NaN there, and a step whose applied gradient is
    not finite is skipped (as a ``GradScaler`` skips it); ``options["device_side_checks"]``:
    the hooks' CUDA way of finding it, forced on the CPU."""
    options = options or {}
    weights = options.get("weights")  # rank_weight per rank, as DynamicBatchController sets
    weight = 1.0 / world_size if weights is None else weights[rank]
    model = make_dropout_model()
    units = convert_dropout(model, options.get("p"), seed=options.get("seed", 11),
                            skip_compute=options.get("skip_compute", True))
    spec = HOOKS[hook]

    def build(module, unit_set, checkpoint=None):
        ddp = DistributedDataParallel(module, bucket_cap_mb=options.get("bucket_cap_mb", 25))
        state = spec.make_state(dict(settings, **({} if weights is None else {"rank_weight": weight})))
        if checkpoint is not None:
            state.load_state_dict(checkpoint["hook"])
            unit_set.load_state_dict(checkpoint["units"])
        if options.get("skip", True):
            state.skip_dropped_units(unit_set)
        ddp.register_comm_hook(state, spec.hook)
        if options.get("device_side_checks"):
            state.non_finite.device_checks.on_every_device = True
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        if options.get("attach", True):
            unit_set.attach(optimizer)
        return ddp, state, optimizer

    ddp, state, optimizer = build(model, units)
    produced, applied, kept = [], [], []
    for step in range(steps):
        if options.get("resume_at") == step:
            checkpoint = [{"hook": state.state_dict(), "units": units.state_dict()}]
            dist.broadcast_object_list(checkpoint, src=0)
            model = copy.deepcopy(model)  # new parameters, layers and unit set
            units = model[2].unit_set
            ddp, state, optimizer = build(model, units, copy.deepcopy(checkpoint[0]))
        x, y = batch(rank, step)
        local = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
        produced.append(flat(g * weight for g in local))
        kept.append([units.kept_units(layer, "cpu").numpy() for layer in units.layers])
        optimizer.zero_grad()
        if options.get("nan_at") == (rank, step):
            x = x * float("nan")
        nn.functional.mse_loss(ddp(x), y).backward()
        applied.append(flat(p.grad for p in model.parameters()))
        if np.isfinite(applied[-1]).all():
            optimizer.step()
    held = state.held_back(list(model.parameters())) if hasattr(state, "held_back") else \
        [torch.zeros_like(p) for p in model.parameters()]
    return {"produced": np.stack(produced), "applied": np.stack(applied), "kept": kept,
            "held_back": flat(held), "params": flat(model.parameters()),
            "stats": {k: v for k, v in state.stats().items() if k != "pool"},
            "units_step": units.step,
            "warned_masks": state.dropped_units.warned if state.dropped_units else None,
            "buffers_in_use": state.pool.stats()["buffers_in_use"] if hasattr(state, "pool") else 0}


def agree_on_seed(rank, world_size, seeds):
    """Build a set with this rank's seed from ``seeds`` (``None``: drawn on rank 0); returns
    the agreed seed, or the error message."""
    try:
        return UnitDropoutSet(seeds[rank]).seed
    except ValueError as error:
        return str(error)
