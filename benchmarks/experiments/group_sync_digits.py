"""Does training with GroupSync reach synchronous DDP's accuracy? The digits MLP, 4 gloo ranks in
2 groups of 2, SGD momentum 0.9 (or AdamW), 8 epochs of global batches of 64 (16 rows per rank), against
plain DDP over the 4 ranks. No rate limit or CPU quota here: this checks convergence only, not
speed (that is ``bench_sync``'s job).

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/group_sync_digits.py [--lr 0.05] [--optimizer sgd|adamw]
       [--runs "DDP, 4 ranks;GroupSync async, period 4, bound 2"]  (a subset, ";" between names)
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lab.data import load_digits_split, make_model
from lab.launch import run_ranks
from hetero_comm.sync import GroupSync, SparseWire, groups_from_sites

ROWS, EPOCHS = 16, 8
CONFIGS = {  # name: GroupSync settings (None: plain DDP over every rank)
    "DDP, 4 ranks": None,
    "GroupSync lockstep, period 1": dict(period=1, max_staleness=0),
    "GroupSync async, period 1, bound 2": dict(period=1, max_staleness=2),
    "GroupSync async, period 4, bound 2": dict(period=4, max_staleness=2),
    "GroupSync async, period 4, bound 2, bfloat16": dict(period=4, max_staleness=2,
                                                          wire_dtype="bfloat16"),
    "GroupSync async, period 4, bound 2, int8": dict(period=4, max_staleness=2, wire_dtype="int8"),
    # parts of 4 KB: the MLP's two layers go as separate parts
    "GroupSync lockstep, period 1, layer deadline": dict(period=1, max_staleness=0,
                                                          layer_deadline=True, part_bytes=4096),
    "GroupSync async, period 4, bound 2, layer deadline": dict(period=4, max_staleness=2,
                                                                layer_deadline=True, part_bytes=4096),
    # sparse contributions: 176 rounds at period 1, 44 at period 4 (rounds x density 5.3, 1.3)
    "GroupSync async, period 1, bound 2, sparse 3% 2 bits": dict(
        period=1, max_staleness=2, wire_dtype=SparseWire(0.03, bits=2)),
    "GroupSync async, period 4, bound 2, sparse 3% 2 bits": dict(
        period=4, max_staleness=2, wire_dtype=SparseWire(0.03, bits=2)),
    "GroupSync async, period 4, bound 2, sparse 10% 2 bits": dict(
        period=4, max_staleness=2, wire_dtype=SparseWire(0.10, bits=2)),
}


def train(rank, world_size, settings, lr, optimizer_name):
    x_train, y_train, x_test, y_test = load_digits_split(0)
    torch.manual_seed(0)
    model = make_model(256, "mlp")
    sync = None
    if settings is None:
        ddp, scale = DDP(model), 1.0
    else:
        sync = GroupSync(model, groups_from_sites(["a", "a", "b", "b"]), **settings)
        ddp, scale = DDP(model, process_group=sync.process_group), sync.lr_scale
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr * scale, weight_decay=0.01)
                 if optimizer_name == "adamw" else
                 torch.optim.SGD(model.parameters(), lr=lr * scale, momentum=0.9))
    steps_per_epoch = len(x_train) // (ROWS * world_size)
    for epoch in range(EPOCHS):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            rows = order[(step * world_size + rank) * ROWS:(step * world_size + rank + 1) * ROWS]
            nn.functional.cross_entropy(ddp(x_train[rows]), y_train[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
            if sync is not None:
                sync.step()
    stats = None
    if sync is not None:
        sync.close()
        stats = sync.stats()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    dist.barrier()
    return accuracy, stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--runs", default=None, help="run names separated by ';' (default: all)")
    args = parser.parse_args()
    chosen = CONFIGS if args.runs is None else {n: CONFIGS[n] for n in args.runs.split(";")}
    name = "SGD momentum 0.9" if args.optimizer == "sgd" else "AdamW (weight decay 0.01)"
    print(f"digits MLP, 4 ranks (groups {{0, 1}}, {{2, 3}}), {name} lr {args.lr}, {EPOCHS} epochs")
    print("| run | test accuracy | mean staleness | max staleness | waits | late parts |")
    print("|---|---|---|---|---|---|")
    for name, settings in chosen.items():
        accuracy, stats = run_ranks(4, train, settings, args.lr, args.optimizer, timeout=600)[0]
        extra = ("| | | | |" if stats is None else
                 f"| {stats['mean_staleness']:.2f} | {stats['max_staleness_seen']} | {stats['waits']} "
                 f"| {stats['late_parts']} |")
        print(f"| {name} | {100 * accuracy:.1f}% {extra}", flush=True)


if __name__ == "__main__":
    main()
