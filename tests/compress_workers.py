"""Rank functions for tests/test_compress.py, run on real gloo ranks by
:func:`lab.launch.run_ranks` (spawned processes import them from here)."""

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm


def make_ddp(seed: int = 0, device: str = "cpu") -> DistributedDataParallel:
    torch.manual_seed(seed)
    return DistributedDataParallel(nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5)).to(device))


def regression_steps(ddp, optimizer, rank, first, count) -> None:
    """Steps ``first .. first + count - 1`` of a regression on this rank's own batches."""
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(100 * step + rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(torch.randn(8, 20, generator=g)),
                               torch.randn(8, 5, generator=g)).backward()
        optimizer.step()


def _untouched(ddp, optimizer, groups_before) -> bool:
    """Nothing registered on ``ddp``, ``optimizer``'s step not wrapped, its groups as before."""
    return (not ddp._comm_hooks and "step" not in vars(optimizer)
            and _groups(optimizer) == groups_before)


def _groups(optimizer):
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


BAD_CALLS = {
    "not DDP": lambda ddp: (ddp.module, torch.optim.AdamW(ddp.parameters()), {}),
    "foreign parameters": lambda ddp: (ddp, torch.optim.AdamW(
        list(ddp.parameters()) + [nn.Parameter(torch.zeros(3))]), {}),
    "unsupported optimizer": lambda ddp: (ddp, torch.optim.RMSprop(ddp.parameters()), {}),
    "ratio too small": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(ratio=2)),
    "ratio too large": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(ratio=1000)),
    "ratio not a number": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(ratio="32")),
    "ratio nan": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(ratio=float("nan"))),
    "ratio unknown word": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(ratio="fast")),
    "machines not covering the ranks": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()),
                                                    dict(machines=[0, 0, 1])),
    "machines not dividing the ranks": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()),
                                                    dict(machines=3)),
    "machines zero": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(machines=0)),
    "machines empty": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(machines=[])),
    "machines empty text": lambda ddp: (ddp, torch.optim.AdamW(ddp.parameters()), dict(machines="")),
    "adam coupled decay": lambda ddp: (ddp, torch.optim.Adam(ddp.parameters(), weight_decay=0.01), {}),
    "sgd nesterov in one group": lambda ddp: (ddp, torch.optim.SGD(
        [{"params": ddp.module[0].parameters(), "nesterov": True},
         {"params": ddp.module[2].parameters()}], lr=0.1, momentum=0.9), {}),
    "sgd dampening": lambda ddp: (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9,
                                                       dampening=0.5), {}),
    "sgd momenta differ": lambda ddp: (ddp, torch.optim.SGD(
        [{"params": ddp.module[0].parameters(), "momentum": 0.9},
         {"params": ddp.module[2].parameters(), "momentum": 0.5}], lr=0.1), {}),
}


def bad_calls(rank, world_size):
    """Each bad call: the exception's type and message, and whether nothing was changed; then
    whether a good call on the same model still works, and what a second call raises."""
    results = {}
    for name, make in BAD_CALLS.items():
        ddp = make_ddp()
        model, optimizer, kwargs = make(ddp)
        before = copy.deepcopy(_groups(optimizer))
        try:
            hetero_comm.compress(model, optimizer, **kwargs)
            results[name] = ("no error", "", False)
        except (TypeError, ValueError) as error:
            results[name] = (type(error).__name__, str(error), _untouched(ddp, optimizer, before))
        # the same model then takes a good call
        state = hetero_comm.compress(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
        assert isinstance(state, hetero_comm.hooks.SegmentSparseState)
    ddp = make_ddp()
    first = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    hetero_comm.compress(ddp, first)
    second = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    before = copy.deepcopy(_groups(second))
    try:
        hetero_comm.compress(ddp, second)
        results["second call"] = ("no error", "", False)
    except ValueError as error:
        results["second call"] = ("ValueError", str(error),
                                  len(ddp._comm_hooks) == 1 and "step" not in vars(second)
                                  and _groups(second) == before)
    return results


def call_warnings(rank, world_size, model_kind, optimizer_kind, ratio):
    """The warnings ``compress`` gives for a model with attention, normalization or recurrent
    layers, or none of them."""
    torch.manual_seed(0)
    if model_kind == "attention":
        module = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    elif model_kind == "gru":
        module = nn.GRU(16, 16)
    elif model_kind == "groupnorm":
        module = nn.Sequential(nn.Conv2d(1, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten())
    else:
        module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    ddp = DistributedDataParallel(module)
    optimizer = (torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9) if optimizer_kind == "sgd"
                 else torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hetero_comm.compress(ddp, optimizer, ratio=ratio)
    return [str(w.message) for w in caught if "hetero_comm.compress" in str(w.message)]


def resume_either_order(rank, world_size, load_optimizer_first, nesterov=False):
    """Train 3 steps with SGD (momentum 0.9, ``nesterov``) under compress, save, and resume
    into new objects, loading the optimizer's dict before or after compress; then 2 more
    steps. Returns the resumed state's momentum and Nesterov setting, and whether the
    parameters after each run's last step are identical."""
    def steps(ddp, optimizer, first, count):
        regression_steps(ddp, optimizer, rank, first, count)

    ddp = make_ddp()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov)
    state = hetero_comm.compress(ddp, optimizer)
    steps(ddp, optimizer, 0, 3)
    saved = copy.deepcopy(dict(model=ddp.module.state_dict(), optimizer=optimizer.state_dict(),
                               hook=state.state_dict()))
    steps(ddp, optimizer, 3, 2)
    straight = [p.detach().clone() for p in ddp.parameters()]

    ddp = make_ddp(seed=1)
    ddp.module.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov)
    if load_optimizer_first:
        optimizer.load_state_dict(saved["optimizer"])
    state = hetero_comm.compress(ddp, optimizer)
    if not load_optimizer_first:
        optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["hook"])
    steps(ddp, optimizer, 3, 2)
    resumed = [p.detach().clone() for p in ddp.parameters()]
    return state.momentum, state.nesterov, all(torch.equal(a, b) for a, b in zip(straight, resumed))


def two_level_steps(rank, world_size, optimizer_kind, ratio):
    """compress(machines=2) on 4 ranks for 6 steps: the state's type, its stats and the
    parameters (which every rank must share)."""
    ddp = make_ddp()
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=1e-3) if optimizer_kind == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    state = hetero_comm.compress(ddp, optimizer, machines=2, ratio=ratio)
    regression_steps(ddp, optimizer, rank, 0, 6)
    stats = state.stats()
    return (type(state).__name__, {k: stats[k] for k in ("steps", "density", "compression_ratio")},
            torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))


def one_machine_steps(rank, world_size, machines, ratio, local_world_size, optimizer_kind):
    """compress on ranks that share one machine: the state's type, the warnings, whether the
    optimizer's settings are as given, and the parameters after 4 steps against plain DDP's."""
    import os
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    results = []
    for use_compress in (True, False):
        ddp = make_ddp()
        optimizer = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer_kind == "adamw"
                     else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
        groups_before = _groups(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = (hetero_comm.compress(ddp, optimizer, machines=machines, ratio=ratio)
                     if use_compress else None)
        regression_steps(ddp, optimizer, rank, 0, 4)
        results.append(dict(kind=type(state).__name__, warnings=[str(w.message) for w in caught],
                            optimizer_as_given=_groups(optimizer) == groups_before,
                            stats=state.stats() if state else None,
                            params=torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])))
    return results


class _WithUnused(nn.Module):
    """A model whose ``unused`` layer never takes part in the forward (DDP needs
    ``find_unused_parameters=True`` for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 128), nn.Tanh(), nn.LayerNorm(128),
                                  nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 5))
        self.unused = nn.Linear(128, 128)

    def forward(self, x):
        return self.body(x)


DDP_CONFIGURATIONS = {
    "default": {},
    "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
    "static_graph": dict(static_graph=True),
    "find_unused_parameters": dict(find_unused_parameters=True),
    "frozen first layer": {},
}


def ddp_configurations(rank, world_size, optimizer_kind):
    """compress under DDP's settings users turn on: for each, 8 steps of a regression (the body
    of a model with a layer the forward never uses); returns the body's parameters after the
    steps and the compression ratio per setting."""
    results = {}
    for name, settings in DDP_CONFIGURATIONS.items():
        torch.manual_seed(0)
        model = _WithUnused()
        if name == "frozen first layer":
            model.body[0].requires_grad_(False)
        # only find_unused_parameters lets DDP wrap a model with a layer the forward skips
        ddp = DistributedDataParallel(model if name == "find_unused_parameters" else model.body,
                                      **settings)
        trained = [p for p in ddp.parameters() if p.requires_grad]
        optimizer = (torch.optim.AdamW(trained, lr=3e-3) if optimizer_kind == "adamw"
                     else torch.optim.SGD(trained, lr=0.05, momentum=0.9))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the recipe's coarse-segment notes on a small model
            state = hetero_comm.compress(ddp, optimizer)
        regression_steps(ddp, optimizer, rank, 0, 8)
        results[name] = (torch.cat([p.detach().reshape(-1) for p in model.body.parameters()]),
                         state.stats()["compression_ratio"])
    return results


def grad_scaler_steps(rank, world_size, optimizer_kind, compressed, device="cpu", steps=60):
    """float16 autocast on ``device`` (gloo ranks; on CUDA sharing one GPU) with
    ``torch.amp.GradScaler`` starting at a scale that overflows float16 (2**24), so that its
    first steps overflow: the loss of
    every step, the scale after it, the parameters and (compressed) the hook's count of buckets
    handed on as NaN. A regression to a linear teacher, dense or through ``compress``."""
    ddp = make_ddp(device=device)
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer_kind == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9))
    state = None
    if compressed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the small model's own warnings
            state = hetero_comm.compress(ddp, optimizer)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 24)
    teacher = torch.randn(20, 5, generator=torch.Generator().manual_seed(7)).to(device)
    losses, scales = [], []
    for step in range(steps):
        x = torch.randn(16, 20, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.mse_loss(ddp(x).float(), x @ teacher)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).cpu()
    return losses, scales, params, None if state is None else state.stats()["non_finite_buckets"]


def compress_with_this_ranks_ratio(rank, world_size, ratios, timeout_seconds=None):
    """``hetero_comm.compress`` with ``ratio=ratios[rank]`` (a rank given ``"skip"`` does not
    call it); the error's type and message, and whether the model and optimizer were left as
    they were."""
    from hetero_comm import _agreement

    if timeout_seconds is not None:
        _agreement.SETUP_TIMEOUT_SECONDS = timeout_seconds
    ddp = make_ddp()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    groups_before = _groups(optimizer)
    if ratios[rank] == "skip":
        return "skipped", "", True
    try:
        hetero_comm.compress(ddp, optimizer, ratio=ratios[rank])
    except (ValueError, RuntimeError) as error:
        return type(error).__name__, str(error), _untouched(ddp, optimizer, groups_before)
    return "no error", "", _untouched(ddp, optimizer, groups_before)


def linear_map_step(ddp, optimizer, rank, step, reachable) -> None:
    """One step of fitting a 64 x 64 linear map: on a batch every rank shares, to a map it can
    reach (``reachable``), or on this rank's own batch of noise targets."""
    generator = torch.Generator().manual_seed(step if reachable else 1000 * step + rank + 1)
    x = torch.randn(32, 64, generator=generator)
    target = x @ torch.ones(64, 64) / 8 if reachable else torch.randn(32, 64, generator=generator)
    optimizer.zero_grad()
    nn.functional.mse_loss(ddp(x), target).backward()
    optimizer.step()


def with_step_scale(ddp, optimizer):
    """The AdamW recipe's state with ``scale_sign_step=True``, registered on ``ddp`` and
    fitting ``optimizer``, as ``compress`` registers the recipe."""
    from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
    from hetero_comm.recipes import recipe_for
    state = SegmentSparseState(process_group=ddp.process_group, scale_sign_step=True,
                               **recipe_for(optimizer).settings)
    ddp.register_comm_hook(state, segment_sparse_hook)
    state.prepare_optimizer(optimizer)
    return state


def step_scale_steps(rank, world_size, agreeing, steps=40, scheduled=False):
    """The AdamW recipe with the step scale on a 64 x 64 linear map whose ranks see the same
    batch (``agreeing``) or batches of independent noise targets: the step scale's factors,
    the parameters (every rank's), and the factor a resumed state restores."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // 10)) \
        if scheduled else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = with_step_scale(ddp, optimizer)
    factors = []
    for step in range(steps):
        linear_map_step(ddp, optimizer, rank, step, agreeing)
        if schedule is not None:
            schedule.step()
        factors.append(state.stats()["sign_step_scale"])
    saved = state.state_dict()
    return dict(factors=factors, saved=saved["step_scale"],
                params=torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist())


def step_scale_resume(rank, world_size, bucket_cap_mb=25, steps=12, resume_at=7):
    """The AdamW recipe with the step scale, noisy per-rank targets, straight and
    resumed at ``resume_at`` into new objects from rank 0's checkpoint: whether the parameters
    and the step scale's factors end equal, and the factors."""
    def run(resume):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
                                      bucket_cap_mb=bucket_cap_mb)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        state = with_step_scale(ddp, optimizer)
        factors = []
        for step in range(steps):
            if resume and step == resume_at:
                saved = [dict(model=ddp.module.state_dict(), optimizer=optimizer.state_dict(),
                              hook=state.state_dict())]
                dist.broadcast_object_list(saved, src=0)  # every rank loads rank 0's
                saved = copy.deepcopy(saved[0])
                module = copy.deepcopy(ddp.module)
                module.load_state_dict(saved["model"])
                ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
                optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
                state = with_step_scale(ddp, optimizer)
                optimizer.load_state_dict(saved["optimizer"])
                state.load_state_dict(saved["hook"])
            generator = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 64, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), torch.randn(16, 8, generator=generator)).backward()
            optimizer.step()
            factors.append(state.stats()["sign_step_scale"])
        return torch.cat([p.detach().flatten() for p in ddp.parameters()]), factors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small model's coarse-segment warning
        straight, straight_factors = run(False)
        resumed, resumed_factors = run(True)
    return dict(equal=torch.equal(straight, resumed), factors=straight_factors,
                resumed_factors=resumed_factors)


def large_gradient_steps(rank, world_size, falling, steps=140, ratio=None):
    """The SGD recipe (momentum 0.9) on a 64 x 64 linear map fitting a map it can reach
    (``falling``: the gradient falls as it fits) or each rank's own noise targets (the
    gradient stays large): per step ``stats()``'s density and large-gradient flag, and the
    warnings given."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(64, 64))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hetero_comm.compress(ddp, optimizer, ratio=ratio)
        densities, large = [], []
        for step in range(steps):
            linear_map_step(ddp, optimizer, rank, step, falling)
            stats = state.stats()
            densities.append(stats["density"])
            large.append(stats.get("large_gradient"))
    return dict(densities=densities, large=large, stats=state.stats(),
                warnings=[str(w.message) for w in caught if "gradient is still large" in str(w.message)],
                params=torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist())


def leave_on_set_up_error(rank, port):
    """A script's rank on 127.0.0.1:``port`` (2 ranks): rank 0 calls ``compress`` and lets its
    error end the process as a script would; rank 1 never calls it and trains a step."""
    from hetero_comm import _agreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    _agreement.SETUP_TIMEOUT_SECONDS = 3.0
    ddp = make_ddp()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    if rank == 0:
        hetero_comm.compress(ddp, optimizer)
    regression_steps(ddp, optimizer, rank, 0, 1)
