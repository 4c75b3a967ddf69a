"""Dropout-aware synchronisation: what unit dropout with shared masks saves, and what it costs.

Workload: the digits MLP (64 -> H -> H -> 10, H = --hidden) with dropout p after each hidden
layer, SGD lr 0.02 with momentum 0.9, 16 epochs, 2 gloo ranks, fixed seeds (dropout helps
there: no dropout ends about a point under standard dropout). Rows:

* no dropout (does dropout matter here?) and standard per-sample ``nn.Dropout``;
* unit dropout (whole units, the same mask on every rank), computed masked;
* the same, the hook sending only what kept units touch (``skip_dropped_units``);
* the same, also computed on the kept units only (``SlicedLinear``);
* the same with ``segment_sparse_hook`` at 10% instead of the dense allreduce.

Columns: final test accuracy and loss (loopback run, ``--epochs``); bytes each rank hands to
collectives per step; median step time on loopback and on a rate-limited link
(``--link``, netlab: network namespaces + tbf, root only, else "n/a"), over ``--steps``
steps after 3 warm-up steps; forward + backward time of one rank's batch in one process
(the median of 5 rounds over every row of a median of 20), and its share of the masked unit
dropout's.

``--compute`` prints instead where computing only the kept units pays: forward + backward
time of masked and sliced unit dropout at several widths and drop rates (one process).

Usage: python benchmarks/bench_dropout.py [--hidden 1024] [--p 0.5] [--epochs 16]
       [--link 100mbit] [--steps 12] [--quick]
       python benchmarks/bench_dropout.py --compute
"""

import argparse
import os
import statistics
import sys
import time

import torch

from lab.data import make_model
from lab.netlab import netlab_unavailable
from lab.training import TrainConfig, run_training
from hetero_comm.nn import convert_dropout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netbench import WARMUP_STEPS, run_workers, step_summary  # noqa: E402 (one way to run a link)

ROWS = [
    ("no dropout", dict(dropout=0.0)),
    ("standard dropout", dict(dropout_kind="standard")),
    ("unit dropout", dict(dropout_kind="unit")),
    ("unit dropout, bytes skipped", dict(dropout_kind="unit", skip_dropped=True)),
    ("unit dropout, bytes + compute skipped", dict(dropout_kind="sliced", skip_dropped=True)),
    ("the same + sparse 10%", dict(dropout_kind="sliced", skip_dropped=True, hook="sparse",
                                    hook_settings=dict(density=0.1))),
]
BATCH_PER_RANK = 32


def config(row: dict, args, **extra) -> TrainConfig:
    options = dict(model="mlp", hidden=args.hidden, dropout=args.p, optimizer="sgd", lr=0.02,
                   momentum=0.9, global_batch=2 * BATCH_PER_RANK, epochs=args.epochs, hook="dense")
    options.update(row)
    options.update(extra)
    return TrainConfig(**options)


def compute_ms(row: dict, args, repeats: int = 50, batch: int = BATCH_PER_RANK) -> float:
    """Forward + backward of one rank's batch, one process, median ms (new masks each time)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as each rank runs
    p = row.get("dropout", args.p)
    model = make_model(args.hidden, "mlp", p)
    units = None
    kind = row.get("dropout_kind", "standard")
    if p and kind != "standard":
        units = convert_dropout(model, seed=0, skip_compute=kind == "sliced")
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    times = []
    for i in range(repeats + 5):
        began = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i >= 5:
            times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=True)
        if units is not None:
            units.next_step()
    return 1000 * statistics.median(times)


def compute_table(args) -> None:
    """Masked against sliced compute, by width, batch and drop rate."""
    header = ["hidden", "batch", "p", "masked ms", "sliced ms", "sliced / masked"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for hidden in (256, 1024, 2048):
        for batch in (32, 256):
            for p in (0.5, 0.8):
                args.hidden, args.p = hidden, p
                masked = compute_ms(dict(dropout_kind="unit"), args, batch=batch)
                sliced = compute_ms(dict(dropout_kind="sliced"), args, batch=batch)
                print(f"| {hidden} | {batch} | {p} | {masked:.3f} | {sliced:.3f} | {sliced / masked:.2f} |",
                      flush=True)


def compute_by_row(args, rounds: int = 5) -> dict:
    """Each row's compute ms: the median over ``rounds`` rounds that visit every row in turn,
    so that a slow moment of the machine does not land on one row only."""
    samples = {title: [] for title, _ in ROWS}
    for _ in range(rounds):
        for title, row in ROWS:
            samples[title].append(compute_ms(row, args, repeats=20))
    return {title: statistics.median(values) for title, values in samples.items()}


def step_times(args) -> dict:
    """Median step time of every row on loopback and on ``args.link`` (when netlab runs)."""
    entries = [{"key": title, "config": config(row, args, epochs=1, max_steps=WARMUP_STEPS + args.steps).__dict__}
               for title, row in ROWS]
    links = ["loopback"] + ([args.link] if netlab_unavailable() is None else [])
    times = {}
    for link in links:
        for key, record in run_workers(2, link, entries).items():
            times.setdefault(key, {})[link] = step_summary(record)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--p", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="2 epochs, 6 timed steps")
    parser.add_argument("--compute", action="store_true", help="only the compute table")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.steps = 2, 6
    print("python " + " ".join(sys.argv), flush=True)
    if args.compute:
        compute_table(args)
        return
    if netlab_unavailable() is not None:
        print(f"(no rate-limited link: {netlab_unavailable()})", flush=True)
    times = step_times(args)
    compute = compute_by_row(args)
    masked_ms = compute["unit dropout"]
    header = ["row", "test acc", "test loss", "bytes/step", "vs dense", "loopback ms",
              f"{args.link} ms", "compute ms", "vs masked"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    dense_bytes = None
    for title, row in ROWS:
        record = run_training(config(row, args), timeout=3600)
        summary = times[title]
        bytes_per_step = summary["loopback"]["bytes_per_step"]
        dense_bytes = dense_bytes or bytes_per_step
        link = summary.get(args.link)
        ms = compute[title]
        cells = [title, f"{100 * record['final_accuracy']:.1f}%", f"{record['epochs']['test_loss'][-1]:.3f}",
                 f"{bytes_per_step:,.0f}", f"{bytes_per_step / dense_bytes:.2f}",
                 f"{1000 * summary['loopback']['step_seconds']:.1f}",
                 "n/a" if link is None else f"{1000 * link['step_seconds']:.1f}",
                 f"{ms:.2f}", f"{ms / masked_ms:.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
