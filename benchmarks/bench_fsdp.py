"""FSDP2 on two machines of two ranks: ``hetero_comm.compress(model, optimizer, mesh=mesh)``
against dense HSDP and HSDP with a bfloat16 reduction, for convergence and, on a real slow link
between the machines, time to dense's final loss (issue 62).

Rows (``--rows``), each on a ("replicate", "shard") mesh of 2 x 2 gloo ranks:

* ``dense``: native HSDP (``fully_shard`` given the 2-D mesh): a float32 reduce-scatter inside
  each machine and a float32 all-reduce between them.
* ``bf16``: native HSDP with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: torch's own
  way to halve the bytes (the reduce-scatter and the all-reduce in bfloat16).
* ``recipe``: ``fully_shard`` on ``mesh["shard"]`` and ``hetero_comm.compress(..., mesh=mesh)``:
  the reduce-scatter inside each machine as dense's, the recipe for the optimizer between.

Workloads (models no other benchmark trains), each at two learning rates (``--lrs`` overrides):

* ``transformer_adamw``: a causal transformer (width 96, 3 blocks of 4-head attention and a
  GELU MLP, learnt positions, 0.36M parameters) on the byte-level pydoc text, AdamW (weight decay
  0.01), 30 warm-up steps and a cosine decay, 2 epochs, a global batch of 32 windows; rates
  1e-3 and 3e-3.
* ``cnn_sgd``: a CNN without normalisation (convolutions of 64, 128 and 128 channels, a 2x2
  pool, a linear classifier; 0.24M parameters) on the digits, SGD with momentum 0.9 at a
  constant rate, 20 epochs, a global batch of 64; rates 0.02 and 0.05.

Each block (transformer) or convolution (CNN) and the root are sharded. Verdict: "ok" where the
recipe compresses 25x or more and comes within 2% of dense's final validation loss
(transformer) or 1 point of its accuracy (CNN: on 256 images a point is 2.6 images, and the
loss of a classifier near 99% rests on its few errors). Validation loss every
``evaluate_every`` steps (outside the timed training) on the first 256 validation windows or
images. "to dense loss":
the training seconds at which the validation loss first came within 2% of the dense row's final
loss on the same link. "bytes/step": bytes each rank sends between machines a step (the
recipe's ``stats()``; dense and bfloat16: its shard of the gradient at 4 and 2 bytes a value).

Links (``--links``): ``loopback`` (no shaping: the convergence table), ``100mbit``, ``1gbit``
(the machines joined by uplinks shaped in both directions, each machine's ranks unshaped on a
bridge of their own; root only).

Usage: python benchmarks/bench_fsdp.py [--workloads transformer_adamw,cnn_sgd] [--lrs ...]
       [--links loopback,100mbit,1gbit] [--rows dense,bf16,recipe] [--seed N] [--quick] [--json PATH]
       python benchmarks/bench_fsdp.py --json PATH --table   (the table of saved records)
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

from netbench import run_script_ranks  # this folder is on sys.path when run as a script

WORKLOADS = {
    "transformer_adamw": dict(lrs=(1e-3, 3e-3), epochs=2, global_batch=32, evaluate_every=40),
    "cnn_sgd": dict(lrs=(0.02, 0.05), epochs=20, global_batch=64, evaluate_every=22),
}
ROWS = {"dense": "dense HSDP (float32)", "bf16": "HSDP, bfloat16 reduction",
        "recipe": "hetero_comm.compress(mesh=)"}
LINKS = ("loopback", "100mbit", "1gbit")
MACHINES, RANKS_PER_MACHINE = 2, 2
WORLD = MACHINES * RANKS_PER_MACHINE
PORT = 29531
TARGET_GAP = 0.02
VALIDATION_WINDOWS = 256


# ------------------------------------------------------------------------------ models
def _transformer(torch, nn):
    class Block(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x, mask):
            h = self.norm1(x)
            x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class CausalTransformer(nn.Module):
        def __init__(self, width=96, layers=3, heads=4, context=64):
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.position = nn.Parameter(torch.randn(context, width) * 0.02)
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, 256)
            self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1),
                                 persistent=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x, self.mask[: tokens.shape[1], : tokens.shape[1]])
            return self.head(self.norm(x)).clone()

        def shard_units(self):
            return list(self.blocks)

    return CausalTransformer()


def _cnn(torch, nn):
    class PlainCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 64, 3, padding=1)
            self.conv2 = nn.Conv2d(64, 128, 3, padding=1)
            self.conv3 = nn.Conv2d(128, 128, 3, padding=1)
            self.classify = nn.Linear(128 * 16, 10)

        def forward(self, x):
            x = torch.relu(self.conv1(x.view(-1, 1, 8, 8)))
            x = torch.relu(self.conv2(x))
            x = nn.functional.max_pool2d(torch.relu(self.conv3(x)), 2)
            return self.classify(x.flatten(1))

        def shard_units(self):
            return [self.conv2, self.conv3]

    return PlainCNN()


def make_run(workload: str, lr: float, row: str, seed: int, mesh):
    """The sharded model, its optimizer, its schedule, the exchange's state (recipe) and the data."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import hetero_comm

    torch.manual_seed(seed)
    if workload == "transformer_adamw":
        from lab.text import load_text_split
        data = load_text_split()
        model = _transformer(torch, nn)
    else:
        from lab.data import load_digits_split
        data = load_digits_split(seed)
        model = _cnn(torch, nn)
    kwargs = {}
    if row == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    on = mesh["shard"] if row == "recipe" else mesh
    for unit in model.shard_units():
        fully_shard(unit, mesh=on, **kwargs)
    fully_shard(model, mesh=on, **kwargs)
    if workload == "transformer_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = hetero_comm.compress(model, optimizer, mesh=mesh) if row == "recipe" else None
    return model, optimizer, state, data


def _schedule(torch, optimizer, workload: str, total_steps: int):
    if workload != "transformer_adamw":
        return None
    warmup = 30

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _loss(nn, workload, output, targets):
    if workload == "transformer_adamw":
        return nn.functional.cross_entropy(output.reshape(-1, 256), targets.reshape(-1))
    return nn.functional.cross_entropy(output, targets)


def _evaluate(torch, nn, workload, model, x_val, y_val):
    with torch.no_grad():
        output = model(x_val)
        loss = _loss(nn, workload, output, y_val).item()
        accuracy = (output.argmax(-1) == y_val).float().mean().item()
    return loss, accuracy


def train_rank(rank: int, entry: dict, mesh) -> dict:
    """One configuration on this rank: losses over training seconds, final loss and accuracy,
    step times, bytes between machines."""
    import torch
    import torch.nn as nn

    workload, lr, row, seed = entry["workload"], entry["lr"], entry["row"], entry["seed"]
    spec = WORKLOADS[workload]
    model, optimizer, state, (x_train, y_train, x_val, y_val) = make_run(workload, lr, row, seed, mesh)
    x_val, y_val = x_val[:VALIDATION_WINDOWS], y_val[:VALIDATION_WINDOWS]
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    parameters = sum(p.numel() for p in model.parameters())
    per_rank = spec["global_batch"] // WORLD
    steps_per_epoch = len(x_train) // spec["global_batch"]
    total = entry.get("max_steps") or spec["epochs"] * steps_per_epoch
    schedule = _schedule(torch, optimizer, workload, total)
    evaluate_every = entry.get("evaluate_every") or spec["evaluate_every"]
    evaluations = {"seconds": [], "loss": [], "accuracy": []}
    step_seconds, trained = [], 0.0
    for step in range(total):
        epoch, within = divmod(step, steps_per_epoch)
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        start = within * spec["global_batch"] + rank * per_rank
        index = order[start: start + per_rank]
        began = time.perf_counter()
        optimizer.zero_grad()
        _loss(nn, workload, model(x_train[index]), y_train[index]).backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        step_seconds.append(time.perf_counter() - began)
        trained += step_seconds[-1]
        if (step + 1) % evaluate_every == 0 or step + 1 == total:
            loss, accuracy = _evaluate(torch, nn, workload, model, x_val, y_val)
            for key, value in zip(evaluations, (trained, loss, accuracy)):
                evaluations[key].append(value)
    if state is not None:
        stats = state.stats()
        bytes_per_step = stats["bytes_sent"] / max(1, stats["steps"])
        ratio = stats["compression_ratio"]
    else:
        bytes_per_step = shard_numel * (2 if row == "bf16" else 4)
        ratio = 4 * shard_numel / bytes_per_step
    return dict(evaluations=evaluations, steps=total, seconds=trained,
                step_ms=1000 * statistics.median(step_seconds[3:] or step_seconds),
                final_loss=evaluations["loss"][-1], final_accuracy=evaluations["accuracy"][-1],
                bytes_per_step=bytes_per_step, compression=ratio,
                parameters=parameters)


def worker() -> None:
    """One rank: every configuration of ``HC_CONFIGS`` in turn; rank 0 prints a JSON line each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=10))
    mesh = init_device_mesh("cpu", (MACHINES, RANKS_PER_MACHINE), mesh_dim_names=("replicate", "shard"))
    for entry in json.loads(os.environ["HC_CONFIGS"]):
        record = train_rank(rank, entry, mesh)
        if rank == 0:
            print(json.dumps({"key": entry["key"], **record}), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as multiprocessing's children do: gloo's thread destructors can abort an exit


def run_link(link: str, entries: list) -> dict:
    """Run ``entries`` on the four ranks over ``link`` (between the machines); rank 0's records
    by key."""
    sites = [rank // RANKS_PER_MACHINE for rank in range(WORLD)]
    return run_script_ranks(os.path.abspath(__file__), WORLD,
                            dict(HC_CONFIGS=json.dumps(entries)), link, sites=sites)


def seconds_to_loss(record: dict, target: float):
    for seconds, loss in zip(record["evaluations"]["seconds"], record["evaluations"]["loss"]):
        if loss <= target:
            return seconds
    return None


def table(results: dict, rows) -> str:
    lines = ["| workload | lr | link | row | final val loss | val acc | loss gap | acc gap | "
             "compression | bytes/step between machines | ms/step | to dense loss (+2%), s | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, lr, link), records in results.items():
        dense = records.get("dense")
        for row in rows:
            record = records.get(row)
            if record is None:
                continue
            gap = acc_gap = reach = verdict = ""
            if dense is not None:
                gap_value = record["final_loss"] / dense["final_loss"] - 1
                acc_value = 100 * (dense["final_accuracy"] - record["final_accuracy"])
                gap, acc_gap = f"{100 * gap_value:+.1f}%", f"{-acc_value:+.1f}"
                seconds = seconds_to_loss(record, dense["final_loss"] * (1 + TARGET_GAP))
                reach = "not reached" if seconds is None else f"{seconds:.1f}"
                if row == "recipe":  # the transformer judged by its loss, the CNN by its accuracy
                    close = (gap_value <= TARGET_GAP if workload == "transformer_adamw"
                             else acc_value <= 1.0)
                    verdict = "ok" if close and record["compression"] >= 25 else "not yet"
            lines.append(f"| {workload} | {lr:g} | {link} | {ROWS[row]} | {record['final_loss']:.3f} | "
                         f"{100 * record['final_accuracy']:.1f}% | {gap} | {acc_gap} | "
                         f"{record['compression']:.1f}x | {record['bytes_per_step']:,.0f} | "
                         f"{record['step_ms']:.0f} | {reach} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--lrs", default=None, help="comma-separated rates for every workload")
    parser.add_argument("--links", default="loopback")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 steps a run (a smoke test)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--table", action="store_true", help="print the table of --json's records only")
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    if args.table:
        with open(args.json) as f:
            saved = json.load(f)
        results = {}
        for key, records in saved.items():
            workload, lr, link = key.split(" ")
            results[workload, float(lr), link] = records
        print(table(results, [row for row in ROWS if any(row in r for r in results.values())]))
        return 0
    rows = args.rows.split(",")
    for name, chosen, known in (("workloads", args.workloads, WORKLOADS), ("links", args.links, LINKS),
                                ("rows", args.rows, ROWS)):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    links = args.links.split(",")
    if any(link != "loopback" for link in links):
        from lab.netlab import netlab_unavailable
        reason = netlab_unavailable()
        if reason is not None:
            print(f"bench_fsdp needs rate-limited links for {args.links}: {reason}")
            return 0
    print("python " + " ".join(sys.argv if argv is None else ["benchmarks/bench_fsdp.py", *argv]))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} "
          f"logical CPUs; {MACHINES} machines x {RANKS_PER_MACHINE} ranks (gloo)", flush=True)
    results = {}
    for workload in args.workloads.split(","):
        lrs = [float(lr) for lr in args.lrs.split(",")] if args.lrs else WORKLOADS[workload]["lrs"]
        for lr in lrs:
            for link in links:
                entries = [dict(key=row, workload=workload, lr=lr, row=row, seed=args.seed,
                                **(dict(max_steps=12, evaluate_every=4) if args.quick else {}))
                           for row in rows]
                began = time.perf_counter()
                results[workload, lr, link] = run_link(link, entries)
                print(f"  {workload} at {lr:g} over {link}: {time.perf_counter() - began:.0f} s",
                      file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({f"{w} {l} {k}": r for (w, l, k), r in results.items()}, f)
    print(table(results, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
