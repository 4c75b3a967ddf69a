"""Rank functions for tests/test_fsdp.py: FSDP2 on a (machines, ranks per machine) mesh of
gloo ranks, run by :func:`lab.launch.run_ranks` (spawned processes import them from here)."""

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hetero_comm
from hetero_comm.fsdp import FSDPSparseState, has_all_reduce_hook
from hetero_comm.recipes import recipe_for

MESH_SHAPE = (2, 2)  # 2 machines x 2 ranks


def make_mesh(shape=MESH_SHAPE, device: str = "cpu"):
    if device == "cuda":  # every rank on the one GPU of a test machine
        torch.cuda.set_device(0)
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))


class Block(nn.Module):
    """A pre-norm transformer block (attention and MLP)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A next-token model on a 32-symbol vocabulary."""

    def __init__(self, width: int = 32, layers: int = 2, heads: int = 2, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(kind: str, seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "transformer":
        return TinyTransformer().to(dtype)
    return nn.Sequential(nn.Linear(20, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                         nn.Linear(96, 5)).to(dtype)


def blocks_of(model: nn.Module):
    return list(model.blocks) if isinstance(model, TinyTransformer) else [model[0], model[2], model[4]]


def shard(model: nn.Module, mesh, native_hsdp: bool = False, **kwargs) -> nn.Module:
    on = mesh if native_hsdp else mesh["shard"]
    for block in blocks_of(model):
        fully_shard(block, mesh=on, **kwargs)
    fully_shard(model, mesh=on, **kwargs)
    return model


def batch(kind: str, step: int, rank: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "transformer":
        start = torch.randint(0, 32, (8, 1), generator=g)
        tokens = (start + torch.arange(13)) % 32  # counting sequences: learnable
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(16, 20, generator=g, dtype=dtype)
    w = torch.linspace(-1, 1, 100, dtype=dtype).reshape(20, 5)
    return x, torch.tanh(x @ w)


def loss_of(kind: str, model, inputs, targets):
    out = model(inputs)
    if kind == "transformer":
        return nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1))
    return nn.functional.mse_loss(out, targets)


def make_optimizer(name: str, model, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if name == "sgd_nesterov":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    if name == "sgd_plain":
        return torch.optim.SGD(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train(kind, model, optimizer, rank, first, count, accumulate: int = 1, dtype=torch.float32,
          device: str = "cpu"):
    """Steps ``first .. first + count - 1`` on this rank's own batches; the loss of each."""
    losses = []
    for step in range(first, first + count):
        optimizer.zero_grad()
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            inputs, targets = batch(kind, accumulate * step + micro, rank, dtype)
            inputs, targets = inputs.to(device), targets.to(device)
            loss = loss_of(kind, model, inputs, targets)
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_parameters(model):
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def local_shards(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def replicas_equal(model, mesh) -> bool:
    """Whether this rank's shards equal those of the rank holding the same shard on every
    other machine."""
    group = mesh["replicate"].get_group()
    flat = torch.cat([p.to_local().detach().reshape(-1).double().cpu() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], other) for other in gathered)


# ---------------------------------------------------------------------------- workers
def dense_equals_native(rank, world_size, dtype_name, steps=4, shape=MESH_SHAPE, device="cpu"):
    """The exchange sending every value (dense throughout) against native HSDP: final
    parameters, bitwise."""
    dtype = getattr(torch, dtype_name)
    mesh = make_mesh(shape, device)
    results = {}
    for native in (True, False):
        model = shard(make_model("mlp", dtype=dtype).to(device), mesh, native_hsdp=native)
        optimizer = make_optimizer("sgd", model, 0.05)
        if not native:
            FSDPSparseState(model, mesh, warmup_steps=10**6).register(optimizer)
        train("mlp", model, optimizer, rank, 0, steps, dtype=dtype, device=device)
        results[native] = full_parameters(model)
    return all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


def recipe_against_dense(rank, world_size, kind, optimizer_name, lr, steps, shape=MESH_SHAPE,
                         device="cpu", int8_sum=None):
    """Loss curves of native HSDP (dense) and of compress on the same model; whether the
    replicas of each shard agree bitwise; the exchange's stats and residual size. ``int8_sum``:
    the recipe's state built by hand (as compress builds it) with its int8 wire summed that way
    between machines."""
    mesh = make_mesh(shape, device)
    out = {}
    for compressed in (False, True):
        model = shard(make_model(kind).to(device), mesh, native_hsdp=not compressed)
        optimizer = make_optimizer(optimizer_name, model, lr)
        state = None
        if compressed and int8_sum is None:
            state = hetero_comm.compress(model, optimizer, mesh=mesh)
        elif compressed:
            settings = dict(recipe_for(optimizer).settings, int8_sum=int8_sum)
            state = FSDPSparseState(model, mesh, **settings)
            state.register(optimizer)
            state.sparse.prepare_optimizer(optimizer)
        losses = train(kind, model, optimizer, rank, 0, steps, device=device)
        out["compressed" if compressed else "dense"] = losses
        if compressed:
            out["replicas_equal"] = replicas_equal(model, mesh)
            out["stats"] = state.stats()
            out["residual_numel"] = state.residual_numel()
            out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
            out["full_numel"] = sum(p.numel() for p in model.parameters())
            out["parameters"] = full_parameters(model)
    return out


def resume_through_dcp(rank, world_size, optimizer_name, directory):
    """Train 6 steps, save model, optimizer and exchange with torch.distributed.checkpoint,
    train 4 more; a fresh model, optimizer and exchange load the checkpoint and train the same
    4: whether the two end bitwise equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = make_mesh()

    def fresh():
        model = shard(make_model("transformer", seed=1), mesh)
        optimizer = make_optimizer(optimizer_name, model, 3e-3)
        return model, optimizer, hetero_comm.compress(model, optimizer, mesh=mesh)

    model, optimizer, state = fresh()
    train("transformer", model, optimizer, rank, 0, 6)
    model_dict, optimizer_dict = get_state_dict(model, optimizer)
    dcp.save({"model": model_dict, "optimizer": optimizer_dict, "exchange": state}, checkpoint_id=directory)
    uninterrupted = train("transformer", model, optimizer, rank, 6, 4)
    expected = local_shards(model)

    model, optimizer, state = fresh()
    model_dict, optimizer_dict = get_state_dict(model, optimizer)
    loaded = {"model": model_dict, "optimizer": optimizer_dict, "exchange": state}
    dcp.load(loaded, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optimizer"])
    step_after_load = state.step
    resumed = train("transformer", model, optimizer, rank, 6, 4)
    result = dict(equal=all(torch.equal(a, b) for a, b in zip(expected, local_shards(model))),
                  losses_equal=uninterrupted == resumed, step_after_load=step_after_load,
                  final_step=state.step)

    # the same resume without the exchange's state (its step and error feedback start afresh)
    model, optimizer, state = fresh()
    model_dict, optimizer_dict = get_state_dict(model, optimizer)
    loaded = {"model": model_dict, "optimizer": optimizer_dict}
    dcp.load(loaded, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optimizer"])
    train("transformer", model, optimizer, rank, 6, 4)
    result["equal_without_exchange"] = all(torch.equal(a, b)
                                           for a, b in zip(expected, local_shards(model)))
    return result


class WithUnusedParameter(nn.Module):
    """The MLP times a learnt scale, next to a layer the forward pass never uses: the root's
    FSDP group holds the scale (a gradient every step) and that layer (none)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model("mlp")
        self.scale = nn.Parameter(torch.ones(1))
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x) * self.scale


class BranchByRank(nn.Module):
    """The MLP, then one of two heads: machine 0's ranks use the first, machine 1's the second
    (conditional control flow: the ranks holding a shard use different parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model("mlp")
        self.heads = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))

    def forward(self, x):
        return self.heads[dist.get_rank() // 2](self.body(x))


def unused_parameter(rank, world_size, kind="unused"):
    """Four steps of a model whose root group has a parameter without a gradient (``unused``),
    or whose ranks use different parameters (``branch``), or one that unfreezes a layer after
    two steps (``unfreeze``), or shards two blocks with one fully_shard call (``grouped``)."""
    mesh = make_mesh()
    model = BranchByRank() if kind == "branch" else WithUnusedParameter()
    blocks = blocks_of(model.body)
    if kind == "unfreeze":
        blocks[1].requires_grad_(False)
    if kind == "grouped":
        fully_shard(blocks[:2], mesh=mesh["shard"])
        fully_shard(blocks[2], mesh=mesh["shard"])
    else:
        for block in blocks:
            fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hetero_comm.compress(model, optimizer, mesh=mesh)
        train("mlp", model, optimizer, rank, 0, 2)
        if kind == "unfreeze":
            blocks[1].requires_grad_(True)  # (the optimizer holds it already)
        train("mlp", model, optimizer, rank, 2, 2)
    return dict(replicas_equal=replicas_equal(model, mesh),
                dense_fallbacks=state.stats()["dense_fallbacks"],
                warnings=[str(w.message) for w in caught if "hetero_comm" in str(w.message)])


def accumulation_and_precision(rank, world_size, case):
    """A variant FSDP users run, trained next to native HSDP: the two loss curves, the
    exchange's step count, the replicas' agreement and the warnings given."""
    mesh = make_mesh()
    kwargs, accumulate = {}, 1
    if case == "accumulate":
        accumulate = 3
    elif case == "bf16 params, fp32 reduce":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif case == "bf16 reduce":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    elif case == "no reshard after forward":
        kwargs["reshard_after_forward"] = False
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for compressed in (False, True):
            model = make_model("transformer")
            if case == "checkpointed blocks":
                for block in model.blocks:
                    block.forward = _checkpointed(block.forward)
            shard(model, mesh, native_hsdp=not compressed, **kwargs)
            optimizer = make_optimizer("adamw", model, 3e-3)
            state = hetero_comm.compress(model, optimizer, mesh=mesh) if compressed else None
            out["compressed" if compressed else "dense"] = train(
                "transformer", model, optimizer, rank, 0, 12, accumulate=accumulate)
            if compressed:
                out["steps"] = state.step
                out["replicas_equal"] = replicas_equal(model, mesh)
                out["dense_fallbacks"] = state.stats()["dense_fallbacks"]
                out["bytes_dense"] = state.stats()["bytes_dense"]
                out["residual_numel"] = state.residual_numel()
    out["warnings"] = [str(w.message) for w in caught if "hetero_comm" in str(w.message)]
    return out


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False)
    return run


BAD_CALLS = {
    "not sharded": lambda mesh: (make_model("mlp"), None, dict(mesh=mesh)),
    "native HSDP": lambda mesh: (shard(make_model("mlp"), mesh, native_hsdp=True), None,
                                 dict(mesh=mesh)),
    "one-dimensional mesh": lambda mesh: (shard(make_model("mlp"), mesh), None,
                                          dict(mesh=mesh["shard"])),
    "mesh dims misnamed": lambda mesh: (shard(make_model("mlp"), mesh), None, dict(
        mesh=init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "fsdp")))),
    "not a mesh": lambda mesh: (shard(make_model("mlp"), mesh), None, dict(mesh="cpu")),
    "sharded on another mesh": lambda mesh: (shard(make_model("mlp"), make_mesh((1, 4))), None,
                                             dict(mesh=mesh)),
    "no mesh": lambda mesh: (shard(make_model("mlp"), mesh), None, {}),
    "machines with mesh": lambda mesh: (shard(make_model("mlp"), mesh), None,
                                        dict(mesh=mesh, machines=2)),
    "auto ratio": lambda mesh: (shard(make_model("mlp"), mesh), None, dict(mesh=mesh, ratio="auto")),
    "ratio too large": lambda mesh: (shard(make_model("mlp"), mesh), None, dict(mesh=mesh, ratio=1000)),
    "unsupported optimizer": lambda mesh: (
        shard(make_model("mlp"), mesh), "rmsprop", dict(mesh=mesh)),
    "foreign parameters": lambda mesh: (shard(make_model("mlp"), mesh), "foreign", dict(mesh=mesh)),
}


def bad_calls(rank, world_size):
    """Each bad call: the exception's type and message, and whether nothing was changed
    (no all-reduce hook set, the optimizer's step not wrapped and its groups as before); then
    what a second call on a compressed model raises."""
    mesh = make_mesh()
    results = {}
    for name, make in BAD_CALLS.items():
        model, optimizer_kind, kwargs = make(mesh)
        if optimizer_kind == "rmsprop":
            optimizer = torch.optim.RMSprop(model.parameters())
        elif optimizer_kind == "foreign":
            optimizer = torch.optim.AdamW(list(model.parameters()) + [nn.Parameter(torch.zeros(3))])
        else:
            optimizer = torch.optim.AdamW(model.parameters())
        before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                for g in optimizer.param_groups])
        try:
            hetero_comm.compress(model, optimizer, **kwargs)
            results[name] = ("no error", "", False)
        except (TypeError, ValueError) as error:
            after = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            untouched = ("step" not in vars(optimizer) and after == before
                         and not has_all_reduce_hook(model))
            results[name] = (type(error).__name__, str(error), untouched)
    model = shard(make_model("mlp"), mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    hetero_comm.compress(model, optimizer, mesh=mesh)
    try:
        hetero_comm.compress(model, optimizer, mesh=mesh)
        results["second call"] = ("no error", "", False)
    except ValueError as error:
        results["second call"] = ("ValueError", str(error), True)
    return results


def ranks_disagree(rank, world_size):
    """Rank 3 asks for another ratio: every rank raises, naming each rank's value."""
    mesh = make_mesh()
    model = shard(make_model("mlp"), mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        hetero_comm.compress(model, optimizer, mesh=mesh, ratio=16 if rank == 3 else 32)
    except ValueError as error:
        return str(error)
    return "no error"


def direct_states_disagree(rank, world_size):
    """FSDPSparseState built by hand, rank 3 with another density: register raises on every
    rank, naming it."""
    mesh = make_mesh()
    model = shard(make_model("mlp"), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = FSDPSparseState(model, mesh, density=0.2 if rank == 3 else 0.1, segment_size=16)
    try:
        state.register(optimizer)
    except ValueError as error:
        return str(error)
    return "no error"


def recipe_on_mesh(rank, world_size, shape, optimizer_name, steps=8, schedule=False):
    """compress on a mesh of ``shape``: the losses, whether the replicas agree, the steps and
    the warnings given (``schedule``: a one-cycle rate schedule, stepped after each step)."""
    mesh = make_mesh(tuple(shape))
    model = shard(make_model("transformer"), mesh)
    lr = 3e-3 if optimizer_name.startswith("adam") else 0.05
    optimizer = make_optimizer(optimizer_name, model, lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hetero_comm.compress(model, optimizer, mesh=mesh)
        scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                         cycle_momentum=False) if schedule else None)
        losses = []
        for step in range(steps):
            losses += train("transformer", model, optimizer, rank, step, 1)
            if scheduler is not None:
                scheduler.step()
    return dict(losses=losses, replicas_equal=replicas_equal(model, mesh), steps=state.step,
                dense_fallbacks=state.stats()["dense_fallbacks"],
                warnings=[str(w.message) for w in caught if "hetero_comm" in str(w.message)])


def one_machine(rank, world_size):
    """A (1, 2) mesh: compress warns and leaves training as plain FSDP's, bitwise."""
    mesh = make_mesh((1, 2))
    results = {}
    for compressed in (False, True):
        model = shard(make_model("mlp"), mesh)
        optimizer = make_optimizer("adamw", model, 1e-3)
        before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if compressed:
                hetero_comm.compress(model, optimizer, mesh=mesh)
        after = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        train("mlp", model, optimizer, rank, 0, 4)
        results[compressed] = (local_shards(model), [str(w.message) for w in caught], before == after)
    return dict(equal=all(torch.equal(a, b) for a, b in zip(results[False][0], results[True][0])),
                warnings=results[True][1], optimizer_untouched=results[True][2])
