"""DDP hooks on real rate-limited links: step time, bytes, accuracy, and where each one pays.

Every rank runs in its own network namespace; the ranks are joined by veth links (through a
bridge namespace for more than two), each shaped by a token-bucket qdisc to the link's rate
(:class:`lab.netlab.RateLimitedNetwork`), and gloo talks over them. "loopback" is the
unshaped case: the same workers on 127.0.0.1. Root only: elsewhere this says why and exits.
Everything it creates is deleted on exit, also on Ctrl-C, SIGTERM or a failing rank.

Two phases, in one run:

1. Step time: for every rank count and link, one set of workers trains each workload with
   every hook for a few steps; the median step time after the warm-up (dense first step,
   DDP's bucket rebuild, PowerSGD's start) and the bytes each rank hands to collectives per
   step are recorded.
2. Accuracy: at the slowest link with 2 ranks, every hook trains each workload for
   ``--epochs``; test accuracy after every epoch against the wall time of training.

Workloads (scikit-learn's digits, shipped with the package; fixed seeds): ``cnn_wide``, two
convolutions and a wide fully connected layer (4.2M parameters, 17 MB of float32 gradient a
step), and the demo's MLP (85K parameters). Output: one table per workload and rank count, the
break-even bandwidth of every hook against float32 allreduce, a PNG and a JSON of every number.

Usage: python benchmarks/netbench.py [--quick] [--ranks 2,3] [--links loopback,10gbit,1gbit,100mbit]
       [--epochs 8] [--target 0.9] [--workloads cnn_wide,mlp] [--hooks "sparse 1%,..."]
       [--out netbench_out]
"""

import argparse
import datetime
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HOOK_RUNS = [
    ("float32 allreduce", dict(hook="dense")),
    # The compute alone: each bucket handed back as it is (what a hook that hides all of its
    # communication would cost).
    ("no communication", dict(hook="none")),
    ("torch fp16_compress", dict(hook="fp16")),
    ("torch PowerSGD rank 1", dict(hook="powersgd", hook_settings=dict(matrix_approximation_rank=1))),
    ("torch PowerSGD rank 4", dict(hook="powersgd", hook_settings=dict(matrix_approximation_rank=4))),
    # hetero_comm.compress on the workload's SGD (momentum 0.9): the SGD recipe.
    ("hetero_comm.compress", dict(hook="recipe")),
    ("sparse 10%", dict(hook="sparse", hook_settings=dict(density=0.1))),
    ("sparse 1%", dict(hook="sparse", hook_settings=dict(density=0.01))),
    ("sparse 0.1%", dict(hook="sparse", hook_settings=dict(density=0.001))),
    ("dct keep 1/8, 8 bit", dict(hook="dct", hook_settings=dict(keep_ratio=0.125, bits=8))),
    ("dct keep 1/4, 16 bit", dict(hook="dct", hook_settings=dict(keep_ratio=0.25, bits=16))),
]
QUICK_HOOKS = ("float32 allreduce", "torch fp16_compress", "torch PowerSGD rank 4",
               "hetero_comm.compress", "sparse 1%",
               "dct keep 1/8, 8 bit")
WORKLOADS = {"cnn_wide": dict(model="cnn_wide", hidden=1024), "mlp": dict(model="mlp", hidden=256)}
# Steps per step-time run: the MLP's steps take milliseconds, so more of them.
STEP_SCALE = {"cnn_wide": 1, "mlp": 3}
WARMUP_STEPS = 3  # dense first step, DDP's rebuilt buckets, PowerSGD's start_powerSGD_iter=2
GLOBAL_BATCH_PER_RANK = 32
# One DDP bucket for every model here (an explicit cap also sets the first bucket's, else
# 1 MB). PyTorch's powerSGD_hook issues its later allreduces from future callbacks; with two
# buckets on gloo they interleave differently on different ranks and the run aborts with a
# collective mismatch (seen with the 4.2M-parameter model).
BUCKET_CAP_MB = 25
PORT = 29500


# ------------------------------------------------------------------------------- worker
def worker() -> None:
    """One rank: run every configuration in ``HC_CONFIGS`` (JSON) in turn in one gloo group;
    rank 0 prints one JSON line per run."""
    import torch
    import torch.distributed as dist

    from lab.training import TrainConfig, train_rank

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A bounded timeout: if another rank dies, this one fails instead of waiting 30 minutes.
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10))
    for entry in json.loads(os.environ["HC_CONFIGS"]):
        record = train_rank(rank, TrainConfig(**entry["config"]))
        if rank == 0:
            keep = ("history", "epochs", "final_accuracy", "steps", "dense_bytes_per_step",
                    "ranks_identical", "hook_stats")
            print(json.dumps({"key": entry["key"], **{k: record[k] for k in keep}}), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    # As multiprocessing's children do: a normal exit can abort in gloo's thread destructors.
    os._exit(0)


def run_workers(num_ranks: int, link: str, entries: list) -> dict:
    """Run ``entries`` on ``num_ranks`` workers over ``link``; rank 0's records by key."""
    return run_script_ranks(os.path.abspath(__file__), num_ranks,
                            dict(WORLD_SIZE=num_ranks, HC_CONFIGS=json.dumps(entries)), link)


def run_script_ranks(script: str, num_ranks: int, env: dict, link: str = "loopback",
                     sites=None) -> dict:
    """Run ``python script --worker`` as ``num_ranks`` ranks (``env`` added to each one's
    environment, with ``RANK`` and ``MASTER_ADDR``): on loopback, or in a
    :class:`lab.netlab.RateLimitedNetwork` whose every link runs at ``link`` (with ``sites``:
    whose links between sites do, the ranks of a site unshaped). Rank 0's records by key
    (:func:`keyed_records`)."""
    from lab.netlab import RateLimitedNetwork

    argv = [sys.executable, script, "--worker"]
    with tempfile.TemporaryFile("w+") as output:
        if link == "loopback":
            processes = [subprocess.Popen(
                argv, stdout=output if rank == 0 else subprocess.DEVNULL,
                env={**os.environ, **{k: str(v) for k, v in env.items()}, "RANK": str(rank),
                     "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"})
                for rank in range(num_ranks)]
            try:
                _wait_all(processes)
            finally:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
        else:
            network = (RateLimitedNetwork(num_ranks, None, sites=sites, inter_site_rate=link)
                       if sites is not None else RateLimitedNetwork(num_ranks, link))
            with network as net:  # kills its processes on exit
                processes = [net.popen(rank, argv, env=dict(env, RANK=rank,
                                                            MASTER_ADDR=net.address(0)),
                                       stdout=output if rank == 0 else subprocess.DEVNULL)
                             for rank in range(num_ranks)]
                _wait_all(processes)
        output.seek(0)
        return keyed_records(output)


def keyed_records(lines) -> dict:
    """The JSON records among ``lines`` (those starting with ``{``), by their ``"key"``."""
    records = {}
    for line in lines:
        if line.startswith("{"):
            record = json.loads(line)
            records[record.pop("key")] = record
    return records


def _wait_all(processes) -> None:
    """Wait for every worker; as soon as one fails, stop the others and raise."""
    while any(p.poll() is None for p in processes):
        failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
        if failed:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            raise RuntimeError(f"a worker exited with code {failed[0]} (its output is above)")
        time.sleep(0.2)
    failed = [p.returncode for p in processes if p.returncode != 0]
    if failed:
        raise RuntimeError(f"a worker exited with code {failed[0]} (its output is above)")


# ----------------------------------------------------------------------------- analysis
def rate_mbit(link: str) -> float:
    from lab.netlab import parse_rate
    return float("inf") if link == "loopback" else parse_rate(link) / 1e6


def step_summary(record: dict) -> dict:
    seconds = record["history"]["seconds"][WARMUP_STEPS:]
    cumulative = record["history"]["bytes"]
    steps = len(cumulative) - WARMUP_STEPS
    bytes_per_step = (cumulative[-1] - cumulative[WARMUP_STEPS - 1]) / steps
    stats = record.get("hook_stats") or {}
    hook_ms = (1000 * (stats["encode_seconds"] + stats["decode_seconds"]) / stats["steps"]
               if stats.get("steps") else None)  # hetero_comm's hooks only
    return dict(step_seconds=statistics.median(seconds), bytes_per_step=bytes_per_step,
                compression=(record["dense_bytes_per_step"] / bytes_per_step if bytes_per_step
                             else float("inf")),
                hook_ms_per_step=hook_ms)


def break_even_mbit(times: dict, dense: dict):
    """The bandwidth below which the hook's step is faster than float32 allreduce's, from a
    least-squares fit ``t = a + b / bandwidth`` of each over the shaped links.

    Returns ``(value, how)``: ``how`` is ``"fit"``, ``"always"`` (faster at every rate the
    fit covers) or ``"never"``."""
    shaped = [link for link in times if link != "loopback"]
    if len(shaped) < 2:
        return None, "needs two shaped links"

    def fit(series):
        xs = [1 / rate_mbit(link) for link in shaped]
        ys = [series[link] for link in shaped]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) /
                 sum((x - mean_x) ** 2 for x in xs))
        return mean_y - slope * mean_x, slope

    a_hook, b_hook = fit(times)
    a_dense, b_dense = fit(dense)
    if b_hook >= b_dense:  # sends at least as much: slower wherever the link matters
        return None, "never"
    if a_hook <= a_dense:
        return None, "always"
    return (b_dense - b_hook) / (a_hook - a_dense), "fit"


def time_to_target(record: dict, target: float):
    elapsed = 0.0
    for seconds, accuracy in zip(record["epochs"]["seconds"], record["epochs"]["test_accuracy"]):
        elapsed += seconds
        if accuracy >= target:
            return elapsed
    return None


# ------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="2,3", help="comma-separated rank counts")
    parser.add_argument("--links", default="loopback,10gbit,1gbit,100mbit")
    parser.add_argument("--steps", type=int, default=12,
                        help="steps per step-time run (3x for the MLP)")
    parser.add_argument("--epochs", type=int, default=8,
                        help="epochs per accuracy run (0: no accuracy runs)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of: {','.join(WORKLOADS)}")
    parser.add_argument("--hooks", default=None,
                        help="comma-separated hook names of the table (default: all; "
                             "'float32 allreduce' is always run, as the baseline)")
    parser.add_argument("--target", type=float, default=0.9, help="target test accuracy")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_CAP_MB,
                        help=f"DDP's bucket_cap_mb (default {BUCKET_CAP_MB}: one bucket per model, "
                             f"which PyTorch's PowerSGD hook needs on gloo; smaller buckets let a "
                             f"hook overlap the backward pass)")
    parser.add_argument("--quick", action="store_true",
                        help="2 ranks, loopback/1gbit/100mbit, 5 hooks, 8 steps, 2 epochs")
    parser.add_argument("--out", default="netbench_out", help="folder for JSON and PNG")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    from lab.netlab import netlab_unavailable
    reason = netlab_unavailable()
    if reason is not None:
        print(f"netbench: skipped: real rate-limited links are not possible here ({reason}); "
              f"a slow link is never faked.")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: delete the namespaces
    chosen = QUICK_HOOKS if args.quick else (
        None if args.hooks is None else {"float32 allreduce", *args.hooks.split(",")})
    unknown = sorted(set(chosen or ()) - {name for name, _ in HOOK_RUNS})
    workloads = args.workloads.split(",")
    if unknown or not set(workloads) <= set(WORKLOADS):
        parser.error(f"unknown hook(s) {unknown} or workload(s) in {workloads}")
    hooks = [(name, overrides) for name, overrides in HOOK_RUNS if chosen is None or name in chosen]
    ranks = [2] if args.quick else [int(r) for r in args.ranks.split(",")]
    links = (["loopback", "1gbit", "100mbit"] if args.quick else args.links.split(","))
    steps, epochs = (8, 2) if args.quick else (args.steps, args.epochs)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()

    results = {"step_time": {}, "accuracy": {}}
    for num_ranks in ranks:
        for link in links:
            entries = [dict(key=f"{workload}|{name}", config=dict(
                workers=num_ranks, global_batch=GLOBAL_BATCH_PER_RANK * num_ranks, epochs=10,
                max_steps=steps * STEP_SCALE[workload], bucket_cap_mb=args.bucket_mb,
                **WORKLOADS[workload],
                **overrides))
                for workload in workloads for name, overrides in hooks]
            records = run_workers(num_ranks, link, entries)
            for key, record in records.items():
                workload, name = key.split("|")
                results["step_time"].setdefault(workload, {}).setdefault(str(num_ranks), {}) \
                    .setdefault(name, {})[link] = step_summary(record)
            print(f"  step times: {num_ranks} ranks, {link} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    accuracy_link = links[-1]
    entries = [dict(key=f"{workload}|{name}", config=dict(
        workers=2, global_batch=GLOBAL_BATCH_PER_RANK * 2, epochs=epochs,
        bucket_cap_mb=args.bucket_mb, **WORKLOADS[workload], **overrides))
        for workload in workloads for name, overrides in hooks] if epochs else []
    for key, record in (run_workers(2, accuracy_link, entries) if entries else {}).items():
        workload, name = key.split("|")
        results["accuracy"].setdefault(workload, {})[name] = dict(
            final_accuracy=record["final_accuracy"], epochs=record["epochs"],
            ranks_identical=record["ranks_identical"],
            time_to_target=time_to_target(record, args.target))
    print(f"  accuracy runs at {accuracy_link} ({time.perf_counter() - started:.0f} s)",
          file=sys.stderr, flush=True)

    report(results, hooks, links, accuracy_link, args.target, epochs)
    with open(os.path.join(args.out, "netbench.json"), "w") as f:
        json.dump(dict(args=vars(args), links=links, results=results), f, indent=1)
    print(f"\nnumbers: {os.path.join(args.out, 'netbench.json')}")
    print(f"plot:    {plot(results, hooks, links, accuracy_link, os.path.join(args.out, 'netbench.png'))}")
    print(f"total time: {time.perf_counter() - started:.0f} s")
    return 0


def report(results, hooks, links, accuracy_link, target, epochs) -> None:
    for workload, by_ranks in results["step_time"].items():
        accuracy = results["accuracy"].get(workload, {})
        for num_ranks, by_hook in by_ranks.items():
            dense = by_hook["float32 allreduce"]
            print(f"\n{workload}, {num_ranks} ranks: step time median (ms) | bytes/step | "
                  f"compression | speedup vs float32 allreduce; accuracy after {epochs} epochs "
                  f"and time to {100 * target:.0f}% from the {accuracy_link} runs (2 ranks)")
            header = ["hook", "bytes/step", "compression", f"encode+decode ms ({links[0]})"] + \
                [f"{link} ms (speedup)" for link in links] + \
                ["break-even", "test acc", f"time to {100 * target:.0f}%"]
            print("| " + " | ".join(header) + " |")
            print("|" + "|".join("---" for _ in header) + "|")
            for name, _ in hooks:
                row = by_hook[name]
                first = row[links[0]]
                hook_ms = first.get("hook_ms_per_step")
                compression = ("-" if math.isinf(first["compression"])
                               else f"{first['compression']:.1f}x")
                cells = [name, f"{first['bytes_per_step']:,.0f}", compression,
                         "-" if hook_ms is None else f"{hook_ms:.1f}"]
                for link in links:
                    speedup = dense[link]["step_seconds"] / row[link]["step_seconds"]
                    cells.append(f"{1000 * row[link]['step_seconds']:.1f} ({speedup:.2f}x)")
                value, how = break_even_mbit({k: v["step_seconds"] for k, v in row.items()},
                                             {k: v["step_seconds"] for k, v in dense.items()})
                cells.append("-" if name == "float32 allreduce" else
                             f"< {value:,.0f} Mbit/s" if how == "fit" else how)
                acc = accuracy.get(name)
                if acc is None or num_ranks != "2":
                    cells += ["", ""]
                else:
                    reached = acc["time_to_target"]
                    cells += [f"{100 * acc['final_accuracy']:.1f}%",
                              f"{reached:.1f} s" if reached is not None else "not reached"]
                print("| " + " | ".join(cells) + " |")
    print("\nstep time: median over the steps after the warm-up; bytes/step: what each rank "
          "hands to collectives (all of it, importance and scales included); encode+decode: "
          "time inside hetero_comm's hooks around the collectives per step (PyTorch's hooks "
          "do not report it); break-even: the "
          "hook is faster than float32 allreduce below this bandwidth, from a fit "
          "t = a + b / bandwidth over the shaped links (\"always\": faster at every shaped "
          "rate; \"never\": sends at least as much).")


def plot(results, hooks, links, accuracy_link, path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shaped = [link for link in links if link != "loopback"]
    workloads = list(results["step_time"])
    figure, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 9),
                                squeeze=False)
    for column, workload in enumerate(workloads):
        by_hook = results["step_time"][workload]["2"]
        for name, _ in hooks:
            axes[0][column].plot([rate_mbit(link) for link in shaped],
                                 [1000 * by_hook[name][link]["step_seconds"] for link in shaped],
                                 marker="o", label=name)
            run = results["accuracy"].get(workload, {}).get(name)
            if run is not None:
                elapsed = list(itertools.accumulate(run["epochs"]["seconds"]))
                axes[1][column].plot(elapsed, run["epochs"]["test_accuracy"], marker="o",
                                     label=name)
        axes[0][column].set(xscale="log", yscale="log", xlabel="link bandwidth (Mbit/s)",
                            ylabel="step time (ms)", title=f"{workload}, 2 ranks")
        axes[1][column].set(xscale="log", xlabel=f"training wall time at {accuracy_link} (s)",
                            ylabel="test accuracy", title=f"{workload}, 2 ranks, {accuracy_link}")
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    sys.exit(main())
