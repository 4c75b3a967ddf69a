"""Two machines of two ranks on a real slow link: time to the dense run's final loss for flat
dense, the flat recipe, the two-level sync (the recipe fixed, at other fixed ratios, and
automatic) and ZeRO++'s int4 scheme (issue 36).

The network (:class:`lab.netlab.RateLimitedNetwork` with sites): each machine's two
ranks on an unshaped bridge of their own, the machines joined by uplinks shaped to the link's
rate in both directions. Links: ``100mbit``, ``1gbit``, and ``100mbit>1gbit`` (each run starts
on the first rate and the uplinks change to the second when it reaches half its steps).

Rows (``--rows``):

* ``dense``: flat dense allreduce (the target: its final validation loss).
* ``flat``: ``hetero_comm.compress`` on every rank alike (the recipe of the optimizer).
* ``two_level``: ``compress(machines=2)``: dense inside each machine, the recipe between them.
* ``two_level_auto``: ``compress(machines=2, ratio="auto")``: the density chosen from the link.
* ``two_level_16x``, ``two_level_64x``: fixed ratios at the automatic range's ends (with
  ``two_level``, the fixed densities the automatic setting is measured against).
* ``int4``: ZeRO++ qgZ's scheme, int4 between machines without error feedback (a baseline
  written from the paper: DeepSpeed's own is CUDA-only), with the dense optimizer.

Workloads: ``gpt_adamw``, bench_convergence's byte-level transformer (0.83M parameters, AdamW at
3e-3, 4 epochs, warm-up and cosine); ``mlp_sgd``, the digits MLP with SGD at 0.05, momentum 0.9,
8 epochs. The global batch is the workload's (8 or 16 samples per rank).

Each run evaluates every ``--evaluate-every`` steps (outside the timed training). "to dense
loss": the training seconds at which its validation loss first came within 2% of the dense
run's final loss on the same link and seed. With ``--seeds N`` every row runs from seeds
0..N-1 and the table shows means over the seeds; the time to dense loss is the mean over the
seeds in which every row of the link that reached it at all reached it (a seed whose dense run
ended unusually low can leave every row short), with how many seeds each row reached where not
all. One table; ``--json`` keeps every record (written after
each link). ``--dense-from PATH`` takes the dense targets from an earlier ``--json`` instead of
running dense again: dense training is deterministic, its losses the same on every link (the
dense row's time does need the link: run it to show it). ``--first-seed F --merge PATH`` adds
seeds F.. to an earlier ``--json`` of the same code (its records of the other seeds are kept; the
table covers the seeds from 0 that every row has). Root
only.

Usage: python benchmarks/bench_two_level.py [--workloads gpt_adamw,mlp_sgd]
       [--links 100mbit,1gbit,100mbit>1gbit] [--rows dense,flat,...] [--seeds N] [--quick]
       [--json PATH] [--dense-from PATH] [--first-seed N --merge PATH]
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from netbench import _wait_all as wait_all, keyed_records  # this folder is on sys.path as a script

WORKLOADS = {
    "gpt_adamw": dict(model="gpt", hidden=128, optimizer="adamw", lr=3e-3, weight_decay=0.01,
                      lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=4,
                      global_batch=32, evaluate_every=30),
    "mlp_sgd": dict(model="mlp", optimizer="sgd", lr=0.05, momentum=0.9, epochs=8,
                    global_batch=64, evaluate_every=5),
}
ROWS = {
    "dense": ("flat dense allreduce", dict(hook="dense")),
    "flat": ("flat recipe (compress)", dict(hook="recipe")),
    "two_level": ("two-level recipe (compress, machines=2)", dict(hook="recipe", hook_settings=dict(machines=2))),
    "two_level_auto": ("two-level, ratio='auto'", dict(hook="recipe", hook_settings=dict(machines=2, ratio="auto"))),
    "two_level_16x": ("two-level, ratio=16", dict(hook="recipe", hook_settings=dict(machines=2, ratio=16.0))),
    "two_level_64x": ("two-level, ratio=64", dict(hook="recipe", hook_settings=dict(machines=2, ratio=64.0))),
    "int4": ("ZeRO++ qgZ int4 between machines (baseline)", dict(hook="int4_qgz", hook_settings=dict(machines=2))),
}
LINKS = ("100mbit", "1gbit", "100mbit>1gbit")
SITES = [0, 0, 1, 1]
PORT = 29500
TARGET_GAP = 0.02  # "reached dense's final loss": within 2% of it


def worker() -> None:
    """One rank: every configuration of ``HC_CONFIGS`` in turn; rank 0 prints a JSON line each."""
    import torch
    import torch.distributed as dist

    from lab.training import TrainConfig, train_rank

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
                            rank=rank, world_size=len(SITES), timeout=datetime.timedelta(minutes=10))
    for entry in json.loads(os.environ["HC_CONFIGS"]):
        record = train_rank(rank, TrainConfig(**entry["config"]))
        if rank == 0:
            keep = ("history", "evaluations", "epochs", "final_accuracy", "steps", "ranks_identical",
                    "auto_density_history")
            stats = record["hook_stats"] or {}
            print(json.dumps({"key": entry["key"], **{k: record[k] for k in keep},
                              "hook_stats": {k: v for k, v in stats.items() if k != "pool"}}),
                  flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as multiprocessing's children do: gloo's thread destructors can abort an exit


def follow_progress(net, progress_file: str, rates, done: threading.Event) -> None:
    """Keep the uplinks at ``rates[0]`` in a run's first half and ``rates[1]`` in its second
    (rank 0 writes "<step> <total>" to ``progress_file`` after every step)."""
    current = rates[0]
    while not done.wait(0.02):
        try:
            with open(progress_file) as f:
                step, total = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
        wanted = rates[1] if 2 * step >= total else rates[0]
        if wanted != current:
            net.set_inter_site_rate(wanted)
            current = wanted


def run_link(link: str, entries: list) -> dict:
    """Run ``entries`` on the four ranks over ``link``; rank 0's records by key."""
    from lab.netlab import RateLimitedNetwork

    rates = link.split(">")
    argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile("w+") as output:
        progress = os.path.join(folder, "progress")
        for entry in entries:
            entry["config"]["progress_file"] = progress
        env = dict(HC_CONFIGS=json.dumps(entries))
        done = threading.Event()
        with RateLimitedNetwork(len(SITES), None, sites=SITES, inter_site_rate=rates[0]) as net:
            follower = threading.Thread(target=follow_progress, daemon=True,
                                        args=(net, progress, rates * 2 if len(rates) == 1 else rates, done))
            follower.start()
            try:
                processes = [net.popen(rank, argv, env=dict(env, RANK=rank, MASTER_ADDR=net.address(0)),
                                       stdout=output if rank == 0 else subprocess.DEVNULL)
                             for rank in range(len(SITES))]
                wait_all(processes)  # one failing worker stops the others at once
            finally:
                done.set()
                follower.join()
        output.seek(0)
        return keyed_records(output)


def seconds_to_loss(record: dict, target: float):
    for seconds, loss in zip(record["evaluations"]["seconds"], record["evaluations"]["test_loss"]):
        if loss <= target:
            return seconds
    return None


def summary(record: dict, dense: dict) -> dict:
    final = record["epochs"]["test_loss"][-1]
    target = dense["epochs"]["test_loss"][-1] * (1 + TARGET_GAP)
    stats = record["hook_stats"] or {}
    steps = record["steps"]
    return dict(final_loss=final, final_accuracy=record["final_accuracy"],
                seconds=sum(record["epochs"]["seconds"]), to_dense_loss=seconds_to_loss(record, target),
                step_ms=1000 * statistics.median(record["history"]["seconds"][3:]),
                bytes_per_step=stats.get("bytes_sent", 0) / steps if stats else None,
                density=stats.get("density"), ranks_identical=record["ranks_identical"])


def seed_key(row: str, seed: int) -> str:
    return row if seed == 0 else f"{row} seed {seed}"  # seed 0 keeps the older records' keys


def mean_summary(records: dict, row: str, seeds: int, common=None) -> dict:
    """``summary`` of ``row`` averaged over the seeds, each seed against dense of that seed;
    the time to dense's loss over the seeds in ``common`` (default: all), where it is known
    for each (``None`` otherwise)."""
    summaries = [summary(records[seed_key(row, seed)], records[seed_key("dense", seed)])
                 for seed in range(seeds)]
    mean = {key: statistics.mean(s[key] for s in summaries)
            for key in ("final_loss", "final_accuracy", "seconds", "step_ms")}
    for key in ("bytes_per_step", "density"):
        values = [s[key] for s in summaries if s[key] is not None]
        mean[key] = statistics.mean(values) if values else None
    timed = [summaries[seed]["to_dense_loss"] for seed in (range(seeds) if common is None else common)]
    mean["to_dense_loss"] = statistics.mean(timed) if timed and None not in timed else None
    mean["reached_seeds"] = {seed for seed, s in enumerate(summaries) if s["to_dense_loss"] is not None}
    return mean


def with_dense_targets(results: dict, earlier: dict) -> dict:
    """``results`` with every dense record it lacks taken from ``earlier`` (a ``--json`` file's
    contents) for the same workload and seed, from whichever link ran it."""
    merged = {}
    for (workload, link), records in results.items():
        dense = {key: record for name, old in earlier.items() if name.split(" ")[0] == workload
                 for key, record in old.items() if key.split(" ")[0] == "dense"}
        merged[workload, link] = {**dense, **records}
    return merged


def seeds_present(results: dict, rows) -> int:
    """How many seeds from 0 on have a record of every row on every link (``--merge`` can add
    seeds on either side of the ones run)."""
    count = 0
    while all(seed_key(row, count) in records for records in results.values() for row in rows):
        count += 1
    return max(count, 1)


def table(results: dict, rows, seeds: int = 1) -> str:
    lines = ["| workload | link | hook | final val loss | val acc | training s | to dense loss (+2%), s "
             "| vs flat recipe | ms/step (median) | bytes/step, rank 0 | last density |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, link), records in results.items():
        if any(seed_key("dense", seed) not in records for seed in range(seeds)):
            continue  # every row is judged against dense of its seed
        present = [row for row in rows if all(seed_key(row, seed) in records for seed in range(seeds))]
        # the rows' times to dense's loss are compared over the seeds in which every row that
        # reached it at all reached it
        reached = {row: mean_summary(records, row, seeds)["reached_seeds"] for row in present}
        some = [seeds_ for seeds_ in reached.values() if seeds_]
        common = sorted(set.intersection(*some)) if some else []
        summaries = {row: mean_summary(records, row, seeds, common) for row in present}
        flat = summaries.get("flat", {}).get("to_dense_loss")
        for row, s in summaries.items():
            reach = s["to_dense_loss"]
            versus = f"{flat / reach:.2f}x" if flat and reach else ""
            sent = f"{s['bytes_per_step']:,.0f}" if s["bytes_per_step"] is not None else ""
            density = f"{s['density']:.3f}" if s["density"] is not None else ""
            if reach is None:
                timed = "not reached" if seeds == 1 else f"{len(reached[row])} of {seeds} seeds reached"
            else:
                timed = f"{reach:.2f}" if reach < 10 else f"{reach:.0f}"
                if len(common) < seeds:
                    timed += f" ({len(reached[row])} of {seeds} reached)"
            lines.append(f"| {workload} | {link} | {ROWS[row][0]} | {s['final_loss']:.3f} | "
                         f"{100 * s['final_accuracy']:.1f}% | {s['seconds']:.0f} | {timed} | "
                         f"{versus} | {s['step_ms']:.0f} | {sent} | {density} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--epochs", type=int, default=None, help="override every workload's epochs")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per row: the table shows means")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="run seeds FIRST_SEED.. (with --merge: more seeds for an earlier run)")
    parser.add_argument("--merge", default=None, metavar="PATH",
                        help="an earlier --json's records of the same workloads and links, for the "
                             "seeds this run does not run; the table covers the seeds from 0 that "
                             "every row has")
    parser.add_argument("--quick", action="store_true", help="20 steps per run (a smoke test)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dense-from", default=None,
                        help="an earlier --json whose dense records are the targets (dense not rerun)")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    from lab.netlab import netlab_unavailable
    reason = netlab_unavailable()
    if reason is not None:
        print(f"bench_two_level needs rate-limited links: {reason}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: delete the namespaces
    rows = args.rows.split(",")
    if args.seeds < 1 or args.first_seed < 0:
        parser.error(f"--seeds must be at least 1 and --first-seed at least 0; got {args.seeds}, "
                     f"{args.first_seed}")
    for name, chosen, known in (("workloads", args.workloads, WORKLOADS), ("links", args.links, LINKS),
                                ("rows", args.rows, ROWS)):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    print("python " + " ".join(sys.argv))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} "
          f"logical CPUs; 2 machines x 2 ranks (network namespaces), unshaped inside", flush=True)
    results = {}
    for workload in args.workloads.split(","):
        config = dict(WORKLOADS[workload], workers=len(SITES))
        if args.epochs:
            config["epochs"] = args.epochs
        if args.quick:
            config.update(epochs=1, max_steps=20, evaluate_every=5, lr_warmup_steps=0)
        for link in args.links.split(","):
            entries = [dict(key=seed_key(row, seed), config=dict(config, seed=seed, **ROWS[row][1]))
                       for seed in range(args.first_seed, args.first_seed + args.seeds) for row in rows]
            began = time.perf_counter()
            results[workload, link] = run_link(link, entries)
            print(f"  {workload} over {link}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
            if args.json:  # after every link: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({f"{w} {l}": records for (w, l), records in results.items()}, f)
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        results = {(workload, link): {**earlier.get(f"{workload} {link}", {}), **records}
                   for (workload, link), records in results.items()}
    if args.dense_from:
        with open(args.dense_from) as f:
            results = with_dense_targets(results, json.load(f))
    print(table(results, rows, seeds_present(results, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
