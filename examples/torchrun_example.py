"""hetero_comm with plain PyTorch DDP, launched by torchrun:

    torchrun --nproc_per_node 2 examples/torchrun_example.py

Trains a small model with the sparse hook (1% of the segments), saves a checkpoint (the hook
state's dict is gathered on every rank and written by rank 0) and resumes from it.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook


def train(ddp, optimizer, steps, rank):
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = DistributedDataParallel(model)
    state = SegmentSparseState(density=0.01)
    ddp.register_comm_hook(state, segment_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train(ddp, optimizer, 20, rank)

    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "hook": state.state_dict()}  # state_dict() on every rank: it gathers
    path = os.path.join(tempfile.gettempdir(), "hetero_comm_torchrun_example.pt")
    if rank == 0:
        torch.save(checkpoint, path)
    dist.barrier()

    # Resume: a new model, DDP and hook state, every rank loading rank 0's file.
    restored = torch.load(path, weights_only=False)
    model.load_state_dict(restored["model"])
    ddp = DistributedDataParallel(model)
    state = SegmentSparseState(density=0.01)
    state.load_state_dict(restored["hook"])
    ddp.register_comm_hook(state, segment_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(restored["optimizer"])
    train(ddp, optimizer, 10, rank)
    stats = state.stats()
    if rank == 0:
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
