"""Rank targets for test_launch.py (ranks import them from here)."""

import os

import torch
import torch.distributed as dist


def environment_value(rank, world_size, name):
    return os.environ.get(name)


def summed_rank(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return rank, value.item()


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)  # dies without reporting, as a crashed rank does
    return rank


def parent_and_test(rank, world_size, name):
    return os.getppid(), os.environ.get("PYTEST_CURRENT_TEST"), os.environ.get(name)


def imported_package(rank, world_size):
    import hetero_comm
    from hetero_comm._backend import extension_loaded
    return hetero_comm.__file__, extension_loaded()
