"""One rank of the on-the-wire check (run by tests/test_netlab.py inside a network namespace):
a few steps of the sparse hook across a rate-limited link, then the hook's own byte count and
the interface's kernel counters over exactly those steps, as one JSON line. With
``UNIT_DROPOUT=p``: the dense hook on a model with unit dropout, skipping dropped units'
bytes; the line then also holds the dense-equivalent bytes and the elements dropped. With
``MACHINES=n``: the two-level sync with n ranks per machine (its stats count the bytes
between machines). With ``FSDP_MACHINES=m``: the model sharded with FSDP2 inside each of m
machines and the sparse exchange between them (its stats count the bytes between machines)."""

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hooks import (AllreduceState, SegmentSparseState, TwoLevelState, allreduce_hook,
                               segment_sparse_hook, two_level_hook)
from hetero_comm.nn import convert_dropout


def interface_counters() -> dict:
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"
    return {name: int(open(f"{base}/{name}").read()) for name in ("tx_bytes", "rx_bytes")}


def pause_for_the_parent(rank: int, name: str) -> None:
    """A barrier; with ``PAUSE_DIR``, every rank then waits until the parent, told by the file
    ``<name>.reached``, has read its counters and created ``<name>.go``."""
    dist.barrier()
    folder = os.environ.get("PAUSE_DIR")
    if folder is None:
        return
    if rank == 0:
        open(os.path.join(folder, f"{name}.reached"), "w").close()
        while not os.path.exists(os.path.join(folder, f"{name}.go")):
            time.sleep(0.01)
    dist.barrier()


def fsdp_exchange(model: nn.Module, world_size: int, machines: int):
    """``model`` sharded inside each of ``machines`` machines, an optimizer that does not move
    it (its steps count the exchange's) and the sparse exchange between the machines."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hetero_comm.fsdp import FSDPSparseState

    mesh = init_device_mesh("cpu", (machines, world_size // machines),
                            mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[-1]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    state = FSDPSparseState(model, mesh, density=float(os.environ["DENSITY"]), segment_size=256)
    state.register(optimizer)
    return model, optimizer, state


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29500",
                            rank=rank, world_size=world_size)
    torch.manual_seed(0)
    p = float(os.environ.get("UNIT_DROPOUT", 0))
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), *([nn.Dropout(p)] if p else []),
                          nn.Linear(1024, 256))
    units = convert_dropout(model, seed=0) if p else None
    optimizer = None
    if "FSDP_MACHINES" in os.environ:
        ddp, optimizer, state = fsdp_exchange(model, world_size, int(os.environ["FSDP_MACHINES"]))
    elif p:
        ddp, state = DistributedDataParallel(model), AllreduceState()
        state.skip_dropped_units(units)
        ddp.register_comm_hook(state, allreduce_hook)
    elif "MACHINES" in os.environ:
        ddp = DistributedDataParallel(model)
        state = TwoLevelState(machines=int(os.environ["MACHINES"]), segment_size=256,
                              density=float(os.environ["DENSITY"]))
        ddp.register_comm_hook(state, two_level_hook)
    else:
        ddp = DistributedDataParallel(model)
        state = SegmentSparseState(density=float(os.environ["DENSITY"]), segment_size=256)
        ddp.register_comm_hook(state, segment_sparse_hook)
    generator = torch.Generator().manual_seed(rank)
    dropped = {"elements": 0}

    def step() -> None:
        ddp(torch.randn(32, 256, generator=generator)).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad()
        if units is not None:  # rows of the first layer (weight, bias), columns of the second
            dropped["elements"] += (1024 - units.kept_units(units.layers[0], "cpu").numel()) * (256 + 1 + 256)
            units.next_step()

    for _ in range(3):  # the dense warm-up step and DDP's bucket rebuild
        step()
    pause_for_the_parent(rank, "before")
    counters, before = interface_counters(), state.stats()
    dropped["elements"] = 0
    for _ in range(int(os.environ["STEPS"])):
        step()
    pause_for_the_parent(rank, "after")
    after, stats = interface_counters(), state.stats()
    print(json.dumps({"rank": rank, "hook_bytes_sent": stats["bytes_sent"] - before["bytes_sent"],
                      "hook_bytes_dense": stats["bytes_dense"] - before["bytes_dense"],
                      "dropped_elements": dropped["elements"],
                      **{name: after[name] - counters[name] for name in after}}), flush=True)
    # no destroy_process_group: no collective follows, and it hung at times (1 run in 5) after
    # the peer had left; os._exit below ends the process and its gloo threads


if __name__ == "__main__":
    main()
    # Leave as multiprocessing's children do: a normal interpreter exit can abort in the gloo
    # and DDP threads' static destructors ("terminate called without an active exception").
    os._exit(0)
