"""Rank functions for the group synchronisation tests (:mod:`hetero_comm.sync`), run on real
gloo ranks by :func:`lab.launch.run_ranks`."""

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from hetero_comm.sync import GroupFailedError, Grouping, GroupSync

ROWS = 4  # rows per rank and step (times ``row_factor`` for a group that is given more work)
LR = 0.05


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def batch(step: int, rank: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64), \
        torch.randn(rows, 2, generator=g, dtype=torch.float64)


def reference_training(world_size: int, steps: int, momentum: float) -> torch.Tensor:
    """Synchronous training on every rank's rows at once (the mean loss over the global batch)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for step in range(steps):
        parts = [batch(step, rank) for rank in range(world_size)]
        inputs, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return parameters_to_vector(model.parameters()).detach()


def _train(rank, sync, model, optimizer, steps, first_step=0, rows=ROWS):
    ddp = DDP(model, process_group=sync.process_group)
    for step in range(first_step, first_step + steps):
        inputs, targets = batch(step, rank, rows)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.step()
    return ddp


def train_against_reference(rank, world_size, groups, steps, momentum, max_staleness):
    """Train with GroupSync (period 1) and return this rank's final parameters and the
    synchronous reference's, and the stats."""
    sync_model = make_model()
    sync = GroupSync(sync_model, Grouping(groups), max_staleness=max_staleness)
    optimizer = torch.optim.SGD(sync_model.parameters(), lr=LR * sync.lr_scale, momentum=momentum)
    _train(rank, sync, sync_model, optimizer, steps)
    before_close = parameters_to_vector(sync_model.parameters()).detach().clone()
    sync.close()
    return dict(params=before_close, reference=reference_training(world_size, steps, momentum),
                stats=sync.stats())


def train_plain_ddp(rank, world_size, steps):
    model = make_model()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        inputs, targets = batch(step, rank)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return parameters_to_vector(model.parameters()).detach()


def one_group_against_ddp(rank, world_size, steps):
    """One group: GroupSync must not change anything; returns both runs' parameters."""
    model = make_model()
    sync = GroupSync(model, Grouping((tuple(range(world_size)),)), period=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * sync.lr_scale, momentum=0.9)
    _train(rank, sync, model, optimizer, steps)
    sync.close()
    return parameters_to_vector(model.parameters()).detach(), train_plain_ddp(rank, world_size, steps)


def conservation_run(rank, world_size, groups, steps, row_factors, max_staleness, wire_dtype,
                     layer_deadline=False):
    """Asynchronous training; every applied contribution (or part) is recorded (source, version,
    part, scale, payload) with this group's own optimizer-step deltas. Returns the records, the
    parts' offsets, the parameters after close(), and the stats."""
    model = make_model()
    grouping = Grouping(groups)
    # part_bytes=8: each layer its own part
    sync = GroupSync(model, grouping, max_staleness=max_staleness, wire_dtype=wire_dtype,
                     layer_deadline=layer_deadline, part_bytes=8)
    applied, accept = [], sync.book.accept

    def recording_accept(contribution):
        tau, scale = accept(contribution)
        part = sync.parts[contribution.part]
        values = sync.wire.decode(contribution.payload, part.end - part.start)
        applied.append((contribution.source, contribution.version, contribution.part, tau, scale,
                        values.double().numpy().copy()))
        return tau, scale

    sync.book.accept = recording_accept
    sent_log, encode = [], sync.wire.encode_

    def recording_encode(values, payload):  # what this group counts as sent
        sent = encode(values, payload)
        sent_log.append(sent.double().numpy().copy())
        return sent

    sync.wire.encode_ = recording_encode
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * sync.lr_scale, momentum=0.9)
    own = torch.zeros_like(parameters_to_vector(model.parameters()))
    ddp = DDP(model, process_group=sync.process_group)
    rows = ROWS * row_factors[grouping.group_of(rank)]
    for step in range(steps):
        inputs, targets = batch(step, rank, rows)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        before = parameters_to_vector(model.parameters()).detach().clone()
        optimizer.step()
        optimizer.zero_grad()
        own += parameters_to_vector(model.parameters()).detach() - before
        sync.step()
    sync.close()
    # numpy arrays travel by value (many tensors would go through shared file descriptors)
    return dict(applied=applied, own=own.numpy(), made=sync.book.made, stats=sync.stats(),
                sent=sent_log,
                checkpoint=sync.state_dict(),  # close() flushed: every part is in
                parts=[(part.start, part.end) for part in sync.parts],
                final=parameters_to_vector(model.parameters()).detach().numpy(),
                initial=parameters_to_vector(make_model().parameters()).detach().numpy())


def checkpoint_run(rank, world_size, groups, directory, first_steps, second_steps, mode,
                   wire_dtype=None):
    """``mode="through"``: first_steps, flush, second_steps without stopping. ``"save"``: first
    steps, flush, save a checkpoint per rank. ``"resume"``: load it, second_steps. Lockstep
    (max_staleness 0, period 2) makes the runs deterministic. Returns the final parameters."""
    model = make_model()
    sync = GroupSync(model, Grouping(groups), period=2, max_staleness=0, wire_dtype=wire_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * sync.lr_scale, momentum=0.9)
    path = os.path.join(directory, f"rank{rank}.pt")
    if mode == "resume":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        sync.load_state_dict(saved["sync"])
        _train(rank, sync, model, optimizer, second_steps, first_step=first_steps)
    else:
        _train(rank, sync, model, optimizer, first_steps)
        sync.flush()
        if mode == "save":
            torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                            sync=sync.state_dict()), path)
        else:
            _train(rank, sync, model, optimizer, second_steps, first_step=first_steps)
    result = parameters_to_vector(model.parameters()).detach().clone()
    sync.close()
    return result


def stalled_group(rank, world_size):
    """Group 1 stops after its first step (it waits on a barrier that group 0 joins only after
    its error); group 0 must raise GroupFailedError within the stall timeout."""
    # DDP's first construction imports torch._dynamo, seconds on a loaded machine: import it
    # before the 3 s stall clock starts, so that only the stalled group stalls.
    import torch._dynamo  # noqa: F401
    model = make_model()
    sync = GroupSync(model, Grouping(((0,), (1,))), max_staleness=1, stall_timeout_s=3.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    message = None
    if rank == 1:
        _train(rank, sync, model, optimizer, 1)
    else:
        try:
            _train(rank, sync, model, optimizer, 10)
        except GroupFailedError as error:
            message = str(error)
    dist.barrier()
    return message


def bad_settings(rank, world_size):
    """Every setting GroupSync refuses, with its message."""
    model = make_model()
    messages = {}
    cases = dict(
        world_size=lambda: GroupSync(model, Grouping(((0,), (1,), (2,)))),
        period=lambda: GroupSync(model, Grouping(((0,), (1,))), period=0),
        periods=lambda: GroupSync(model, Grouping(((0,), (1,))), period=[4]),
        period_of_other_group=lambda: GroupSync(model, Grouping(((0,), (1,))), period=[4, 0]),
        max_staleness=lambda: GroupSync(model, Grouping(((0,), (1,))), max_staleness=-1),
        wire_dtype=lambda: GroupSync(model, Grouping(((0,), (1,))), wire_dtype="int4"),
        lr_scale=lambda: GroupSync(model, Grouping(((0,), (1,))), lr_scale=0.0),
        grouping_type=lambda: GroupSync(model, [[0], [1]]),
        no_parameters=lambda: GroupSync(nn.Tanh(), Grouping(((0,), (1,)))),
        layer_deadline=lambda: GroupSync(model, Grouping(((0,), (1,))), layer_deadline="yes"),
        part_bytes=lambda: GroupSync(model, Grouping(((0,), (1,))), layer_deadline=True,
                                     part_bytes=0),
    )
    for name, make in cases.items():
        try:
            make()
        except ValueError as error:
            messages[name] = str(error)
    sync = GroupSync(model, Grouping(((0,), (1,))))
    sync.step()
    try:
        sync.state_dict()
    except RuntimeError as error:
        messages["state_dict_before_flush"] = str(error)
    sync.close()
    return messages


def with_dynamic_batches(rank, world_size, steps):
    """Two groups of two ranks in lockstep, each group with the batch controller (unequal sizes
    from the start, re-planned from measured speed every 2 steps) on its own process group.
    Returns this rank's parameters and a single-process reference: SGD on the mean loss of both
    groups' global batches (each group's batches from its own shuffle)."""
    from hetero_comm.hetero import DynamicBatchController, HeteroSampler
    from hetero_comm.hooks import AllreduceState, allreduce_hook

    data = torch.randn(40, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    targets = torch.randn(40, 2, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    grouping = Grouping(((0, 1), (2, 3)))
    group = grouping.group_of(rank)
    model = make_model()
    sync = GroupSync(model, grouping, max_staleness=0)
    ddp = DDP(model, process_group=sync.process_group)
    sampler = HeteroSampler(40, 8, dist.get_rank(sync.process_group), 2, batch_sizes=[2, 6],
                            seed=group)
    controller = DynamicBatchController(sampler, AllreduceState(process_group=sync.process_group),
                                        replan_every=2)
    controller.register_comm_hook(ddp, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * sync.lr_scale, momentum=0.9)
    controller.set_epoch(0)
    sizes = []
    for _, rows in zip(range(steps), sampler):
        sizes.append(len(rows))
        with controller.step(len(rows)):
            nn.functional.mse_loss(ddp(data[rows]), targets[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.step()
    result = parameters_to_vector(model.parameters()).detach().clone()
    sync.close()

    reference = make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    orders = [torch.randperm(40, generator=torch.Generator().manual_seed(g)) for g in range(2)]
    for step in range(steps):
        loss = sum(nn.functional.mse_loss(reference(data[order[8 * step: 8 * step + 8]]),
                                          targets[order[8 * step: 8 * step + 8]])
                   for order in orders) / 2
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return result, parameters_to_vector(reference.parameters()).detach(), sizes


def link_messages():
    """Group 0's messages in :func:`link_exchange`: a contribution in two parts, a flush's
    contribution, then a close."""
    from hetero_comm.sync.link import Message, MessageKind
    payloads = [torch.arange(6, dtype=torch.uint8), torch.arange(10, 13, dtype=torch.uint8)]
    for version, kind in enumerate((MessageKind.CONTRIBUTION, MessageKind.FLUSH)):
        for part, payload in enumerate(payloads):
            yield Message(kind, 0, version, part, (version, 0), payload + version)
    yield Message(MessageKind.CLOSE, 0, 2, 0, (2, 0), torch.empty(0, dtype=torch.uint8))


def link_exchange(rank, world_size):
    """Two groups of one rank: group 0's leader sends :func:`link_messages` on a LeaderLink, then
    (on a second link) a frame of an unknown kind. Group 1 returns what it received, in order:
    the messages (payloads as copies), then the error the bad frame caused."""
    from hetero_comm.sync.link import Framing, GroupFailedError, LeaderLink, Message, MessageKind
    grouping = Grouping(((0,), (1,)))
    links = [LeaderLink(grouping, rank, Framing(2, (6, 3)), timeout_s=30.0) for _ in range(2)]
    close = Message(MessageKind.CLOSE, rank, 0, 0, (0, 0), torch.empty(0, dtype=torch.uint8))
    if rank == 0:
        *messages, last = link_messages()
        for message in messages:
            links[0].send(message)
        links[0].close(last)  # returns once group 1's close is in
        bad = torch.zeros(links[1].framing.frame_bytes(0), dtype=torch.uint8)
        bad[:8] = torch.tensor([7], dtype=torch.int64).view(torch.uint8)
        dist.send(bad, 1, group=links[1].process_group)
        assert links[1].receive(timeout=30.0).kind is MessageKind.CLOSE
        return None
    received = []
    while not received or received[-1].kind is not MessageKind.CLOSE:
        message = links[0].receive(timeout=30.0)
        received.append(dataclasses.replace(message, payload=message.payload.clone()))
    links[0].close(close)
    try:
        links[1].receive(timeout=30.0)
    except GroupFailedError as error:
        received.append(str(error))
    links[1].close(close)  # its receiver has stopped at the bad frame
    return received


def sparseloco_run(rank, world_size, sites, steps):
    """The SparseLoCo baseline: DDP inside each site, a round every 2 steps. Returns this rank's
    parameters at the end, the initial ones, and the bytes its leader sent."""
    from lab.baselines import SparseLoCo
    model = make_model()
    baseline = SparseLoCo(model, sites, period=2, density=0.25, chunk=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    _train(rank, baseline, model, optimizer, steps)  # it has GroupSync's process_group and step()
    return dict(final=parameters_to_vector(model.parameters()).detach().numpy(),
                initial=parameters_to_vector(make_model().parameters()).detach().numpy(),
                bytes_sent=baseline.bytes_sent)


def ranks_disagree(rank, world_size, what):
    """Rank 1 builds its GroupSync with another grouping or period: what each rank raised."""
    model = make_model()
    groups, period = [[0, 1], [2]], 2
    if rank == 1 and what == "groups":
        groups = [[0], [1, 2]]
    if rank == 1 and what == "period":
        period = 3
    try:
        GroupSync(model, Grouping(groups), period=period, stall_timeout_s=30.0)
    except ValueError as error:
        return str(error)
    return "no error"
