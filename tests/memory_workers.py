"""Rank functions for the memory planner's multi-rank tests (tests/test_memory.py), run on gloo
ranks by :func:`lab.launch.run_ranks`."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.memory import predict, profile_memory, tune_memory_plan


def tune_under_ddp(rank, world_size, budget_shares, candidates, directory):
    """Profile four MLP blocks, then tune a memory plan with DDP training steps, rank ``r`` at
    ``budget_shares[r]`` of the way from recomputing every block to keeping every block (below 0:
    nothing fits) and ``candidates[r]`` candidates. Returns the error's type and message (or
    the tuned plan's choices), the steps each rank ran, and whether the replicas' parameters
    are equal afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                            for _ in range(4)])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    inputs = torch.randn(256, 128, generator=torch.Generator().manual_seed(rank))
    calls = []

    def step():
        calls.append(1)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(ddp(inputs), inputs).backward()
        optimizer.step()

    profile = profile_memory(model, inputs, swap_directory=directory, swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    least, most = (predict(profile, (choice,) * profile.num_blocks)[0] for choice in ("recompute", "keep"))
    budget = least + budget_shares[rank] * (most - least)
    try:
        outcome = ("tuned", tune_memory_plan(model, profile, budget, step, candidates=candidates[rank],
                                             steps=1, warmup=1, swap_directory=directory).plan.choices)
    except (ValueError, RuntimeError) as error:
        outcome = (type(error).__name__, str(error))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, flat)
    return outcome + (len(calls), all(torch.equal(gathered[0], other) for other in gathered))


def tune_alone_on_rank_0(rank, world_size, directory):
    """Rank 0 tunes a plain (not DDP) model with ``process_group=None`` while rank 1 waits at
    a barrier; both then meet. Returns rank 0's tuned choices (None on rank 1)."""
    choices = None
    if rank == 0:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                                for _ in range(4)])
        inputs = torch.randn(256, 128)

        def step():
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(inputs), inputs).backward()

        profile = profile_memory(model, inputs, swap_directory=directory, swap_bytes_per_s=1e9,
                                 repeats=1, min_sample_s=0)
        most = predict(profile, ("keep",) * profile.num_blocks)[0]
        choices = tune_memory_plan(model, profile, most * 2, step, candidates=1, steps=1, warmup=1,
                                   swap_directory=directory, process_group=None).plan.choices
    torch.distributed.barrier()
    return choices
