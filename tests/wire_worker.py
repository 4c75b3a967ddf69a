"""One rank of the on-the-wire check (run by tests/test_netlab.py inside a network namespace):
a few steps of the sparse hook across a rate-limited link, then the hook's own byte count and
the interface's kernel counters over exactly those steps, as one JSON line."""

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook


def interface_counters() -> dict:
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"
    return {name: int(open(f"{base}/{name}").read()) for name in ("tx_bytes", "rx_bytes")}


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29500",
                            rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    ddp = DistributedDataParallel(model)
    state = SegmentSparseState(density=float(os.environ["DENSITY"]), segment_size=256)
    ddp.register_comm_hook(state, segment_sparse_hook)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        ddp(torch.randn(32, 256, generator=generator)).square().mean().backward()
        model.zero_grad()

    for _ in range(3):  # the dense warm-up step and DDP's bucket rebuild
        step()
    dist.barrier()
    counters, sent = interface_counters(), state.stats()["bytes_sent"]
    for _ in range(int(os.environ["STEPS"])):
        step()
    dist.barrier()
    after = interface_counters()
    print(json.dumps({"rank": rank, "hook_bytes_sent": state.stats()["bytes_sent"] - sent,
                      **{name: after[name] - counters[name] for name in after}}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave as multiprocessing's children do: a normal interpreter exit can abort in the gloo
    # and DDP threads' static destructors ("terminate called without an active exception").
    os._exit(0)
