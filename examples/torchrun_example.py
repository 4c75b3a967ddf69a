"""hetero_comm with plain PyTorch DDP, launched by torchrun:

    torchrun --nproc_per_node 2 examples/torchrun_example.py --optimizer adamw
    torchrun --nproc_per_node 2 examples/torchrun_example.py --optimizer sgd
    torchrun --nnodes 2 --nproc_per_node 4 ... examples/torchrun_example.py --machines auto

Trains a small network on a synthetic task with the optimizer set up as for dense training;
``hetero_comm.compress`` picks the recipe for it (with ``--machines``, the two-level sync:
dense inside each machine, the recipe between machines; ``--ratio auto`` sizes it to the
link; on a single host ``--machines auto`` finds one machine and keeps the dense allreduce,
``--machines 1`` treats each rank as a machine). Halfway, it saves a checkpoint (the hook
state's dict, gathered on every rank and written by rank 0) and resumes from it in new objects.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm


def make_optimizer(name, parameters):
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def train(ddp, optimizer, steps, first, rank):
    teacher = torch.Generator().manual_seed(7)
    target = torch.randn(64, 8, generator=teacher) / 8  # a fixed linear map, unit-variance targets
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        loss.backward()
        optimizer.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--machines", default=None,
                        help="'auto' (torchrun's LOCAL_WORLD_SIZE) or ranks per machine")
    parser.add_argument("--ratio", default=None, help="a compression ratio, or 'auto'")
    args = parser.parse_args()
    machines = int(args.machines) if args.machines and args.machines.isdigit() else args.machines
    ratio = float(args.ratio) if args.ratio not in (None, "auto") else args.ratio
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(args.optimizer, ddp.parameters())
    state = hetero_comm.compress(ddp, optimizer, ratio=ratio, machines=machines)
    half = args.steps // 2
    first_loss = train(ddp, optimizer, 1, 0, rank)
    train(ddp, optimizer, half - 1, 1, rank)

    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "hook": state.state_dict()}  # state_dict() on every rank: it gathers
    path = os.path.join(tempfile.gettempdir(), "hetero_comm_torchrun_example.pt")
    if rank == 0:
        torch.save(checkpoint, path)
    dist.barrier()

    # Resume: new DDP model, optimizer and state, every rank loading rank 0's file.
    restored = torch.load(path, weights_only=False)
    model.load_state_dict(restored["model"])
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(args.optimizer, ddp.parameters())
    # compress first: it reads the optimizer as you set it up
    state = hetero_comm.compress(ddp, optimizer, ratio=ratio, machines=machines)
    optimizer.load_state_dict(restored["optimizer"])
    state.load_state_dict(restored["hook"])
    last_loss = train(ddp, optimizer, args.steps - half, half, rank)
    stats = state.stats()
    if rank == 0:
        print(f"{args.optimizer}: loss {first_loss:.3f} -> {last_loss:.3f}")
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
