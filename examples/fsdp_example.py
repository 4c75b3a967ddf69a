"""hetero_comm with FSDP2, launched by torchrun: a model sharded inside each machine, its
gradients compressed between machines.

    torchrun --nproc_per_node 4 examples/fsdp_example.py --optimizer adamw
    torchrun --nproc_per_node 4 examples/fsdp_example.py --optimizer sgd
    torchrun --nnodes 2 --nproc_per_node 8 ... examples/fsdp_example.py --machines 2

The ranks form a (machines, ranks per machine) mesh (on one host, ``--machines`` splits them,
default 2). Each block and the root are sharded with ``fully_shard`` on ``mesh["shard"]``;
``hetero_comm.compress(model, optimizer, mesh=mesh)`` picks the recipe for the optimizer and
sums each shard across machines with it. Halfway, model, optimizer and the exchange's state
(each rank's error feedback) are saved with ``torch.distributed.checkpoint`` to a folder in the
temporary directory (printed) and loaded into new objects, which train on.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hetero_comm


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, width=128, depth=4):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make(mesh, optimizer_name):
    """The sharded model, its optimizer set up as for dense training, and the exchange."""
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    state = hetero_comm.compress(model, optimizer, mesh=mesh)
    return model, optimizer, state


def train(model, optimizer, steps, first, rank):
    teacher = torch.Generator().manual_seed(7)
    target = torch.randn(64, 8, generator=teacher) / 8  # a fixed linear map, unit-variance targets
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optimizer.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--machines", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.machines, world_size // args.machines),
                            mesh_dim_names=("replicate", "shard"))
    model, optimizer, state = make(mesh, args.optimizer)
    half = args.steps // 2
    first_loss = train(model, optimizer, 1, 0, rank)
    train(model, optimizer, half - 1, 1, rank)

    folder = os.path.join(tempfile.gettempdir(), f"hetero_comm_fsdp_example_{os.environ['MASTER_PORT']}")
    model_dict, optimizer_dict = get_state_dict(model, optimizer)
    dcp.save({"model": model_dict, "optimizer": optimizer_dict, "exchange": state}, checkpoint_id=folder)

    # Resume: new model, optimizer and exchange (compress first: it reads the optimizer as set up).
    model, optimizer, state = make(mesh, args.optimizer)
    model_dict, optimizer_dict = get_state_dict(model, optimizer)
    loaded = {"model": model_dict, "optimizer": optimizer_dict, "exchange": state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optimizer"])
    if rank == 0:
        print(f"checkpoint after step {half} (model, optimizer, exchange): {folder}; resumed from it")
    last_loss = train(model, optimizer, args.steps - half, half, rank)
    stats = state.stats()
    if rank == 0:
        print(f"{args.optimizer}: loss {first_loss:.3f} -> {last_loss:.3f}")
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x between machines")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
