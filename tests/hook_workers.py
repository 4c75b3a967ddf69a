"""Rank functions for the hook and heterogeneity tests, run on real gloo ranks by
:func:`lab.launch.run_ranks`. They live here (not in a test module) so spawned
processes can import them.
"""

import copy
import gc
import io
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hetero import DynamicBatchController, HeteroSampler
from lab.registry import HOOKS, make_hook


# The optimizers the workers build by name, as a user has them.
OPTIMIZERS = {"adamw": lambda parameters: torch.optim.AdamW(parameters, lr=1e-3),
              "sgd_momentum": lambda parameters: torch.optim.SGD(parameters, lr=0.01, momentum=0.9),
              "sgd": lambda parameters: torch.optim.SGD(parameters, lr=0.01)}


def make_model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    """Three layers of uneven sizes (1,490 parameters in six tensors)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 17), nn.Tanh(),
                         nn.Linear(17, 5)).to(dtype)


def batch(rank: int, step: int, dtype=torch.float32):
    """Deterministic data, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 20, generator=g).to(dtype), torch.randn(8, 5, generator=g).to(dtype)


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]).numpy()


def train(rank, world_size, hook, settings, steps, options=None):
    """Train with ``hook`` for ``steps`` steps (plain SGD, lr 0.05) and record per step the
    gradient this rank produced, the weighted result the hook applied, and at the end what
    the hook still holds back, the parameters, stats and a state_dict.

    ``options``: ``dtype`` (parameters and gradients), ``bucket_cap_mb``, ``weights`` (one
    rank_weight per rank), ``no_sync_every`` (accumulate locally on every n-th step),
    ``nan_at`` ((rank, step): that rank's gradient becomes NaN; a step whose applied
    gradient is not finite is skipped, as a ``GradScaler`` skips it; an exception from
    ``backward()`` ends the run as ``{"error": (type name, message), "applied": ...}``),
    ``device_side_checks`` (the hooks' CUDA way of finding non-finite
    gradients, without a host read, forced on the CPU), ``count_part_routes`` (record under
    ``"part_routes"`` the step of each bucket sent as several plan buckets), ``resume_at`` (save all
    state there, rebuild model, DDP and hook state from the checkpoint and continue; every
    rank loads rank 0's ``state_dict()``, as frameworks do, or with ``checkpoint_from="own"``
    its own).
    """
    options = options or {}
    dtype = options.get("dtype", torch.float32)
    weights = options.get("weights")
    model = make_model(dtype=dtype)
    spec = HOOKS[hook]
    kwargs = dict(settings)
    if weights is not None:
        kwargs["rank_weight"] = weights[rank]
    weight = weights[rank] if weights is not None else 1.0 / world_size

    part_routes = []  # buckets sent as several plan buckets (count_part_routes)

    def build(module, checkpoint=None):
        ddp = DistributedDataParallel(module, bucket_cap_mb=options.get("bucket_cap_mb", 25))
        state = spec.make_state(kwargs)
        if checkpoint is not None:
            state.load_state_dict(checkpoint)
        ddp.register_comm_hook(state, spec.hook)
        if options.get("device_side_checks"):
            state.non_finite.device_checks.on_every_device = True
        if options.get("count_part_routes"):
            send_parts = state._send_parts

            def counted(*args):
                part_routes.append(state.step)
                return send_parts(*args)
            state._send_parts = counted
        return ddp, state

    ddp, state = build(model)
    produced, applied, pool_allocations = [], [], []
    pending = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for step in range(steps):
        if options.get("resume_at") == step:
            checkpoint = [state.state_dict()]  # a collective: every rank calls it
            if options.get("checkpoint_from", "rank0") == "rank0":
                dist.broadcast_object_list(checkpoint, src=0)
            checkpoint = copy.deepcopy(checkpoint[0])
            model = copy.deepcopy(model)  # new parameter objects, as in a new process
            ddp, state = build(model, checkpoint)
        x, y = batch(rank, step, dtype)
        local = list(torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters())))
        if options.get("nan_at") == (rank, step):
            x = x * float("nan")
        for acc, g in zip(pending, local):
            acc.add_(g.float(), alpha=weight)
        every = options.get("no_sync_every", 0)
        if every and step % every == 0:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()
            continue  # gradients stay in .grad and join the next synchronised step
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
        except Exception as error:
            if options.get("nan_at") is None:
                raise
            return {"error": (type(error).__name__, str(error)), "applied": np.stack(applied)}
        produced.append(flat(pending))
        applied.append(flat(p.grad for p in model.parameters()))
        finite = bool(np.isfinite(applied[-1]).all())
        with torch.no_grad():
            for p in model.parameters():
                if finite:  # else skipped, as a GradScaler skips a step with NaN or infinity
                    p.sub_(0.05 * p.grad)
                p.grad = None
        pending = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        if hasattr(state, "pool"):  # the pool's storage and the sparse codec's buffer sets
            pool_allocations.append(state.pool.stats()["allocations"]
                                    + (state.codecs.builds if hasattr(state, "codecs") else 0))
    return {
        "produced": np.stack(produced), "applied": np.stack(applied),
        "held_back": flat(state.held_back(list(model.parameters())) if hasattr(state, "held_back")
                          else [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]),
        "params": flat(model.parameters()),
        "stats": {k: v for k, v in state.stats().items() if k != "pool"},
        "pool_allocations": pool_allocations, "part_routes": part_routes,
        # Saved to bytes: tensors sent through the result queue would live in shared memory
        # that goes away with this process.
        "state_dict": _saved(state.state_dict()) if options.get("return_state_dict") else None,
    }


def train_recording_warnings(rank, world_size, hook, settings, steps, options=None):
    """:func:`train`'s result, with the messages of the ``RuntimeWarning``s given during it
    under ``"warnings"``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(rank, world_size, hook, settings, steps, options)
    result["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return result


def hook_warnings(rank, world_size, hook, settings, steps):
    """The hook's own warnings (``segment_sparse_hook: ...``) during :func:`train`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(rank, world_size, hook, settings, steps)
    return [str(w.message) for w in caught if str(w.message).startswith("segment_sparse_hook")]


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def loaded_residual_total(rank, world_size, hook, settings, checkpoint: bytes) -> float:
    """Load a hook state saved by another world size; the sum of what it holds back here."""
    state = HOOKS[hook].make_state(settings)
    state.load_state_dict(loaded(checkpoint))
    assert state.step == loaded(checkpoint)["step"]
    return float(sum(b.tensors["residual"].double().sum() for b in state.plan.buckets))


def load_into_another_model(rank, world_size, hook, settings, checkpoint: bytes):
    """Load a hook state saved with :func:`make_model`'s model, then train a wider model
    with it. Returns the error message."""
    spec = HOOKS[hook]
    state = spec.make_state(settings)
    state.load_state_dict(loaded(checkpoint))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 31), nn.ReLU(), nn.Linear(31, 5))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, spec.hook)
    x, y = batch(rank, 0)
    try:
        nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as error:  # DDP may wrap the hook's ValueError
        return str(error)
    return "no error"


def share_one_state(rank, world_size, hook, settings):
    """Register one hook state on two models and train each a step: the second must be
    refused. Returns the error message."""
    spec = HOOKS[hook]
    state = spec.make_state(settings)
    models = [make_model(seed) for seed in (0, 1)]
    ddps = [DistributedDataParallel(model) for model in models]
    for ddp in ddps:
        ddp.register_comm_hook(state, spec.hook)
    x, y = batch(rank, 0)
    nn.functional.mse_loss(ddps[0](x), y).backward()
    try:
        nn.functional.mse_loss(ddps[1](x), y).backward()
    except Exception as error:  # DDP may wrap the hook's ValueError
        return str(error)
    return "no error"


def weighted_step(rank, world_size, sizes, hook, settings):
    """One DDP step with unequal local batches (``sizes``) and ``rank_weight = b_i / B``;
    returns the gradient the hook applied."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    spec = HOOKS[hook]
    state = spec.make_state(dict(settings, rank_weight=sizes[rank] / sum(sizes)))
    ddp.register_comm_hook(state, spec.hook)
    x, y = global_batch(sum(sizes))
    start = sum(sizes[:rank])
    local = slice(start, start + sizes[rank])
    nn.functional.mse_loss(ddp(x[local]), y[local]).backward()
    return flat(p.grad for p in model.parameters())


def global_batch(size: int):
    g = torch.Generator().manual_seed(7)
    return torch.randn(size, 20, generator=g), torch.randn(size, 5, generator=g)


class SimulatedClock:
    """Time that moves only when told to: compute and waiting are simulated exactly, so a test
    of the batch controller does not depend on the machine's speed or load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def controlled_training(rank, world_size, hook, settings, options):
    """Epochs through :class:`DynamicBatchController` on a dataset of ``num_samples`` items
    with a simulated clock: a sample costs ``costs[epoch][rank]`` seconds of compute and every
    hook call first waits ``hook_wait`` seconds (as if for other ranks). Parameters are not
    updated, so every step's applied gradient must equal the gradient of the global batch.

    Returns, per step, this rank's indices, the applied gradient and its rank_weight; and the
    controller's plan history.
    """
    clock = SimulatedClock()
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=options.get("bucket_cap_mb", 25))
    spec = HOOKS[hook]
    state = spec.make_state(settings)
    sampler = HeteroSampler(options["num_samples"], options["global_batch_size"], rank,
                            world_size, seed=5)
    controller = DynamicBatchController(sampler, state, clock=clock,
                                        **options.get("controller", {}))

    def waiting_hook(hook_state, bucket):
        clock.advance(options.get("hook_wait", 0.0))
        return spec.hook(hook_state, bucket)

    controller.register_comm_hook(ddp, waiting_hook)
    x, y = global_batch(options["num_samples"])
    steps = []
    for epoch, costs in enumerate(options["costs"]):
        controller.set_epoch(epoch)
        for index in sampler:
            with controller.step(len(index)):
                clock.advance(len(index) * costs[rank])
                nn.functional.mse_loss(ddp(x[index]), y[index]).backward()
            steps.append((index, flat(p.grad for p in model.parameters()), state.rank_weight))
            model.zero_grad(set_to_none=True)
    controller.replan()
    return {"steps": steps, "history": controller.history}


def train_on_cuda(rank, world_size, hook, settings, steps):
    """Six Linear(512, 512) on CUDA in several DDP buckets, SGD; returns the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1.5)  # several buckets in flight
    state, hook_function = make_hook(hook, settings)
    ddp.register_comm_hook(state, hook_function)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        batch = torch.randn(64, 512, generator=data).cuda()
        ddp(batch).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


def steady_step_host_syncs(rank, world_size, hook, settings, warmup_steps=4):
    """NCCL on one GPU (world size 1): run ``warmup_steps`` steps, then one more under
    ``torch.cuda.set_sync_debug_mode("error")``. Returns "ok", or the error that step raised
    (a host synchronisation inside forward, backward with the hook, or the optimizer)."""
    nccl = dist.new_group([0], backend="nccl")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
    ddp = DistributedDataParallel(model, process_group=nccl, bucket_cap_mb=1.5)
    state, hook_function = make_hook(hook, dict(settings, process_group=nccl))
    ddp.register_comm_hook(state, hook_function)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return _host_syncs_of_a_steady_step(ddp, optimizer, warmup_steps)


def recipe_step_host_syncs(rank, world_size, optimizer_name, warmup_steps=4):
    """As :func:`steady_step_host_syncs`, with ``hetero_comm.compress``'s recipe for
    ``optimizer_name`` ("adamw", "sgd_momentum" or "sgd")."""
    import hetero_comm

    nccl = dist.new_group([0], backend="nccl")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
    ddp = DistributedDataParallel(model, process_group=nccl, bucket_cap_mb=1.5)
    optimizer = OPTIMIZERS[optimizer_name](ddp.parameters())
    hetero_comm.compress(ddp, optimizer, process_group=nccl)
    return _host_syncs_of_a_steady_step(ddp, optimizer, warmup_steps)


def _host_syncs_of_a_steady_step(ddp, optimizer, warmup_steps):
    from hetero_comm import ops

    batch = torch.randn(64, 512, device="cuda")
    previous = ops.set_strict_checks(False)
    try:
        for step in range(warmup_steps + 1):
            if step == warmup_steps:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                optimizer.zero_grad()
                ddp(batch).square().mean().backward()
                optimizer.step()
            except RuntimeError as error:  # with where it happened: the sync's Python frame
                return f"step {step}: {error}\n{traceback.format_exc()}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return "ok"
    finally:
        ops.set_strict_checks(previous)


def two_level_construction_error(rank, world_size, settings, dense=False):
    """Build a TwoLevelState (``dense``: with :meth:`TwoLevelState.dense`) with ``settings``;
    the error's type and message."""
    from hetero_comm.hooks import TwoLevelState
    try:
        (TwoLevelState.dense if dense else TwoLevelState)(**settings)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "no error", ""


def two_level_with_this_ranks_layout(rank, world_size, layouts):
    """Build a TwoLevelState with ``machines=layouts[rank]``; the error's type and message."""
    return two_level_construction_error(rank, world_size, dict(machines=layouts[rank]))


def prepared_by_two_level(rank, world_size, settings, optimizer_name, dense=False):
    """A TwoLevelState (``dense``: :meth:`TwoLevelState.dense`) with ``settings`` prepares a
    fresh ``optimizer_name`` ("adamw" or "sgd_momentum"); its first group's hyperparameters,
    as lists."""
    from hetero_comm.hooks import TwoLevelState
    optimizer = OPTIMIZERS[optimizer_name]([nn.Parameter(torch.ones(3))])
    (TwoLevelState.dense if dense else TwoLevelState)(**settings).prepare_optimizer(optimizer)
    group = optimizer.param_groups[0]
    return {name: list(group[name]) if isinstance(group[name], tuple) else group[name]
            for name in ("betas", "momentum") if name in group}


def integer_gradient_steps(rank, world_size, hook, settings, steps):
    """A bias-free linear model in float64 whose gradients are integers (so every order of
    summing them is exact): each step's applied gradient, with weights 1 / world_size (a power
    of two in the tests)."""
    torch.manual_seed(0)
    model = nn.Linear(40, 24, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randint(-3, 4, model.weight.shape))
    ddp = DistributedDataParallel(model)
    state, hook_function = make_hook(hook, settings)
    ddp.register_comm_hook(state, hook_function)
    applied = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(-5, 6, (4, 40), generator=g).double()
        c = torch.randint(-5, 6, (4, 24), generator=g).double()
        (ddp(x) * c).sum().backward()
        applied.append(model.weight.grad.detach().clone().numpy())
        model.weight.grad = None
    return np.stack(applied)


def auto_density_agreement(rank, world_size, steps, resume_at, rails, silent=None, start=0.5):
    """The automatic density's agreement on real ranks with synthetic measurements, ``rails``
    rails (rank r in rail r % rails; rail 1 exchanges 80% of rail 0's bytes): a rank's exchange
    takes its bytes over 1 MB/s, 1 ms more per rail index and 0.5 ms per step modulo 3, and the
    ranks of the second machine (r // rails == 1) wait 2-4 ms more. At ``resume_at`` a copy
    resumes from ``state_dict()`` and runs beside the original on the same inputs. Rank
    ``silent`` exchanges nothing (its shares empty). The density starts at ``start``. Returns,
    per copy, what each step's agree() returned, the least seconds in its history, and the
    least seconds this rank's rail should have found."""
    from hetero_comm.hooks import AutoDensity
    from hetero_comm.hooks._auto_density import DensityController

    rail, values = rank % rails, (100_000, 80_000)[rank % rails]

    def seconds(step, sent, waits):
        return sent / 1e6 + 0.001 * rail + 0.0005 * (step % 3) + (0.002 * (1 + step % 2) if waits else 0.0)

    def build():
        auto = DensityController(AutoDensity(0.02, 0.5), wire_bytes_per_value=1, segment_size=256)
        auto.rail, auto.rails = rail, rails
        return auto

    runs, densities = [build()], [start]
    agreed, expected = {0: [], 1: []}, []
    for step in range(steps):
        if step == resume_at:
            runs.append(build())
            runs[1].load_state_dict(loaded(_saved(runs[0].state_dict())))
            densities.append(densities[0])
        sent = int(values * runs[0].bytes_per_value(densities[0]))
        expected.append(seconds(step, sent, False))
        for index, run in enumerate(runs):
            if rank != silent:
                run.add_exchange(sent, seconds(step, sent, rank // rails == 1), 0.0)
            agreed[index].append(run.agree(run.propose(0.02, 0.1, densities[index]), None))
            if agreed[index][-1] is not None:
                densities[index] = agreed[index][-1]
    return dict(agreed=agreed, expected=expected,
                least={index: [entry.get("least_link_seconds") for entry in run.history]
                       for index, run in enumerate(runs)})


OP_PREFIXES = ("aten::", "hetero_comm::", "c10d::")


def _top_level_op_calls(events) -> int:
    """Operator calls in profiler ``events`` that no other operator call made."""
    calls = 0
    for event in events:
        if not event.name.startswith(OP_PREFIXES):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(OP_PREFIXES):
            parent = parent.cpu_parent
        calls += parent is None
    return calls


def op_calls_per_bucket(rank, world_size, optimizer_name, steps=3):
    """The operator calls a recipe's hook adds per DDP bucket, on every thread (the profiler
    with ``profile_all_threads``): a steady backward's calls with ``hetero_comm.compress``
    less those with a hook that hands each bucket back as it is, over the buckets. Also the
    buckets a step and the compression ratio reached."""
    import hetero_comm
    from hetero_comm.recipes import DENSITY_WARMUP_STEPS
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    def backward_calls(setup):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.016)
        optimizer = OPTIMIZERS[optimizer_name](ddp.parameters())
        state = setup(ddp, optimizer)
        inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        # past the dense warm-up, the recipes' density warm-up and DDP's bucket rebuild
        for _ in range(3 + DENSITY_WARMUP_STEPS):
            optimizer.zero_grad()
            ddp(inputs).square().mean().backward()
            optimizer.step()
        handed.clear()
        with profile(activities=[ProfilerActivity.CPU],
                     experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
            for _ in range(steps):
                ddp(inputs).square().mean().backward()
        ratio = state.stats()["compression_ratio"] if state is not None else None
        return _top_level_op_calls(prof.events()), ratio

    handed = []  # the buckets the baseline's hook handed back

    def hand_back(ddp, optimizer):
        def hook(_, bucket):
            handed.append(bucket.index())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future
        ddp.register_comm_hook(None, hook)

    baseline, _ = backward_calls(hand_back)
    buckets = len(handed)
    recipe, ratio = backward_calls(hetero_comm.compress)
    return dict(per_bucket=(recipe - baseline) / buckets, buckets=buckets / steps, ratio=ratio)


def uneven_small_model() -> nn.Module:
    """Eight tanh layers of uneven widths (34,312 parameters): with ``bucket_cap_mb=0.016``
    DDP cuts them into 6 buckets of 5,184-6,256 values."""
    widths = (64, 96, 64, 48, 64, 80, 64, 40, 64)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh())
                           for a, b in zip(widths, widths[1:])])


def fused_and_separate(rank, world_size, optimizer_name, fuse_below=None, min_compress_numel=0,
                       nan_at=None, steps=6):
    """``hetero_comm.compress`` on small DDP buckets (5.2-6.3K values, of uneven sizes)
    trained twice: with the CPU's exchange fusing consecutive buckets until they hold
    ``fuse_below`` values (default: the library's) and with every bucket alone. Buckets below
    ``min_compress_numel`` go dense between them; ``nan_at``: a step whose third layer's
    gradient is NaN (that step's update is skipped, as a GradScaler does). The initial and
    final parameters of each run, the allreduce calls and buckets encoded in the last step."""
    import hetero_comm
    from hetero_comm.hooks import _codec

    def train(fuse_below):
        collectives, encoded = [], []
        issue, encode = dist.all_reduce, _codec.BucketCodec.encode

        def counted_issue(*args, **kwargs):
            collectives.append(1)
            return issue(*args, **kwargs)

        def counted_encode(*args, **kwargs):
            encoded.append(1)
            return encode(*args, **kwargs)
        saved, _codec.FUSE_BELOW_NUMEL = _codec.FUSE_BELOW_NUMEL, fuse_below
        try:
            model = uneven_small_model()
            initial = flat(model.parameters())
            step_now = [0]
            model[2][0].weight.register_hook(
                lambda grad: grad * float("nan") if step_now[0] == nan_at else grad)
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.016)
            optimizer = OPTIMIZERS[optimizer_name](ddp.parameters())
            state = hetero_comm.compress(ddp, optimizer)
            state.min_compress_numel = min_compress_numel
            generator = torch.Generator().manual_seed(rank)
            for step in range(steps):
                step_now[0] = step
                inputs = torch.randn(8, 64, generator=generator)
                optimizer.zero_grad()
                collectives.clear(), encoded.clear()
                dist.all_reduce, _codec.BucketCodec.encode = counted_issue, counted_encode
                try:
                    ddp(inputs).square().mean().backward()
                finally:
                    dist.all_reduce, _codec.BucketCodec.encode = issue, encode
                if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
                    optimizer.step()
            return initial, flat(model.parameters()), len(collectives), len(encoded)
        finally:
            _codec.FUSE_BELOW_NUMEL = saved

    initial, fused, fused_calls, buckets = train(fuse_below or _codec.FUSE_BELOW_NUMEL)
    _, separate, separate_calls, _ = train(0)
    return dict(initial=initial, fused=fused, separate=separate, fused_calls=fused_calls,
                separate_calls=separate_calls, buckets=buckets)


def step_cut_short(rank, world_size, steps_after=3):
    """The small-bucket model under ``hetero_comm.compress`` (AdamW) for three steps, then a
    backward that raises midway (buckets of the later layers already handed to the hook), then
    the same state on a new DDP model for ``steps_after`` steps: what the cut step's buckets'
    futures held, how often the pipeline dropped a step's work, and the final parameters."""
    import hetero_comm
    from hetero_comm.hooks import _codec, segment_sparse_hook

    model = uneven_small_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.016)
    optimizer = OPTIMIZERS["adamw"](ddp.parameters())
    state = hetero_comm.compress(ddp, optimizer)
    generator = torch.Generator().manual_seed(rank)

    def step(net):
        optimizer.zero_grad()
        net(torch.randn(8, 64, generator=generator)).square().mean().backward()
        optimizer.step()

    for _ in range(3):
        step(ddp)
    cut = model[0][0].weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("cut")))
    try:
        step(ddp)
    except RuntimeError:
        pass
    cut.remove()
    pipeline = state._pipeline
    in_flight = [m.delivered for m in pipeline.open]
    for group in pipeline.issued + pipeline.wires:
        in_flight.extend(m.delivered for m in group.members)
    discarded, discard = [], _codec.ExchangePipeline.discard

    def counted_discard(self):
        discarded.append(1)
        return discard(self)
    _codec.ExchangePipeline.discard = counted_discard
    del ddp  # (its reducer's hooks on the parameters go with it)
    gc.collect()
    try:
        again = DistributedDataParallel(model, bucket_cap_mb=0.016)
        again.register_comm_hook(state, segment_sparse_hook)
        for _ in range(steps_after):
            step(again)
    finally:
        _codec.ExchangePipeline.discard = discard
    def failed(future) -> bool:
        try:
            future.wait()
        except RuntimeError:
            return True
        return False
    return dict(in_flight=len(in_flight), undone=sum(not f.done() for f in in_flight),
                failed=sum(failed(f) for f in in_flight if f.done()), discarded=len(discarded),
                params=flat(model.parameters()), ratio=state.stats()["compression_ratio"])


def disagreeing_states(rank, world_size, hook, settings, rank_settings, rank_fuse_below=None):
    """Every rank builds ``hook``'s state from ``settings``, the last rank updated with
    ``rank_settings`` (and with ``rank_fuse_below``, its library's grouping of small buckets
    changed, as another version's), and runs a step: what each rank's backward raised (type,
    message)."""
    if rank_fuse_below is not None and rank == world_size - 1:
        from hetero_comm.hooks import _codec
        _codec.FUSE_BELOW_NUMEL = rank_fuse_below
    chosen = dict(settings, **(rank_settings if rank == world_size - 1 else {}))
    model = make_model()
    ddp = DistributedDataParallel(model)
    state, hook_function = make_hook(hook, chosen)
    ddp.register_comm_hook(state, hook_function)
    inputs, targets = batch(rank, 0)
    try:
        nn.functional.mse_loss(ddp(inputs), targets).backward()
    except Exception as error:  # DDP hands the hook's error on as a RuntimeError
        return type(error).__name__, str(error)
    return "no error", ""


def two_phase_sum_parts(rank, world_size, k, segment, seed=0):
    """Each rank rounds its own random segments to int8 on a scale every rank shares and sums
    them with :func:`two_phase_int8_sum`. Returns the rank's values, what its rounding
    dropped, the decoded sum, the chunk it owned and what the owner's rounding dropped."""
    from hetero_comm.hooks._two_phase import TWO_PHASE_LEVELS, two_phase_int8_sum

    values = torch.randn(k, segment, generator=torch.Generator().manual_seed(seed + rank))
    values[:, 0] *= 10.0  # segments whose values differ in size
    scale = torch.rand(k, generator=torch.Generator().manual_seed(seed + 999)) * 3 + 0.5
    step = scale.view(-1, 1) / TWO_PHASE_LEVELS
    wire = torch.round(values / step).clamp_(-TWO_PHASE_LEVELS, TWO_PHASE_LEVELS)
    dropped = values - wire * step
    summed = two_phase_int8_sum(wire.to(torch.int8).view(-1), scale, segment)
    decoded = summed.wire.to(torch.float32).view(k, segment) * (summed.scale.view(-1, 1) / TWO_PHASE_LEVELS)
    return dict(values=values, dropped=dropped, decoded=decoded, owned=(summed.owned.start, summed.owned.stop),
                owner_error=summed.error.view(-1, segment), wire=summed.wire, scale=summed.scale)


def bytes_counted_by_the_lab(rank, world_size):
    """The lab's byte counter over one collective of each kind it counts: the bytes handed in
    (all_reduce 40, all_gather 12, all_to_all 8, reduce_scatter 16, all_gather_single 12, an
    all-to-all split unevenly 12) and the bytes those send over the rank's link."""
    from hetero_comm._collectives import all_gather_single, reduce_scatter_single
    from lab.byte_count import count_collective_bytes

    totals = {}
    with count_collective_bytes(totals):
        dist.all_reduce(torch.ones(10))
        dist.all_gather([torch.empty(3) for _ in range(world_size)], torch.ones(3))
        dist.all_to_all_single(torch.empty(8, dtype=torch.int8), torch.ones(8, dtype=torch.int8))
        reduce_scatter_single(torch.empty(4 // world_size), torch.ones(4))
        all_gather_single(torch.empty(3 * world_size), torch.ones(3))
        # 3 rows of 2 bytes each, split [1, 2] on both ranks: rank 0 keeps 1 row and sends 2,
        # rank 1 keeps 2 and sends 1 (so receives 2 rows on rank 0, 4 on rank 1)
        received = [1, 1] if rank == 0 else [2, 2]
        dist.all_to_all_single(torch.empty(sum(received), 2, dtype=torch.int8),
                               torch.ones(3, 2, dtype=torch.int8), output_split_sizes=received,
                               input_split_sizes=[1, 2])
    dist.all_reduce(torch.ones(10))  # after the block: not counted, the functions restored
    return totals["bytes"], totals["link_bytes"]
