"""Equal against speed-proportional batches when one rank is really slower.

N local gloo ranks train a small CNN on scikit-learn's digits (its steps are bound by compute,
not by the gradient exchange; ``--model mlp`` for the demo's exchange-bound MLP). Every worker
is pinned to its own core when there are enough, and the last one runs under a cgroup CPU
quota (``--slow-cores`` of one core): the kernel stops it once it has used its share of every
5 ms (``--quota-period-us``), so it is slow for real, not by sleeping.
Root only: elsewhere the benchmark says why and exits.

Runs, in one invocation and on the same quota, repeated in ``--repeats`` rounds:

1. equal batches (``B / N`` each): the controller only measures every rank's compute speed
   ``v_i`` (samples per second of forward + backward, waiting excluded);
2. dynamic batches, re-planned once per epoch from the previous epoch's speeds (the seed);
3. dynamic batches re-planned every ``--replan-every`` steps with smoothing 0.5 and a 25% bound.

Ideal epoch time, from the speeds measured in run 1 (median over its epochs after the first):
``D / sum(v_i)``, every rank computing all the time, nothing else costing anything. The ideal
speedup is (equal epoch time) / (ideal epoch time); the share reached is the measured speedup
over it. The equal run's time that is not compute (gradient exchange, optimizer, Python) is
printed too: no batch split can remove it, so it bounds what dynamic batches can reach.
Ratios are taken within a round (this shared machine drifts between minutes) and the medians
over the rounds are printed, with each round's share of the ideal.

Usage: python benchmarks/bench_hetero.py [--workers 2] [--slow-cores 0.3] [--epochs 8]
       [--repeats 3] [--quick] [--json PATH]
"""

import argparse
import json
import signal
import statistics
import sys

from lab.throttle import PERIOD_US, cpu_quota_unavailable
from lab.training import TrainConfig, run_training


def steady(values):
    """Median over the epochs after the first (the first is an equal split and warms up)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def per_epoch(record, field):
    """Per epoch, every rank's total of ``field`` (samples or compute seconds) over the
    controller's measurement windows in that epoch."""
    totals = {}
    for plan in record["speed_history"]:
        epoch = totals.setdefault(plan["epoch"], [0.0] * len(plan[field]))
        for rank, value in enumerate(plan[field]):
            epoch[rank] += value
    return [totals[e] for e in sorted(totals)]


def rank_speeds(record):
    """Per epoch, every rank's compute speed (samples/s) measured by the controller."""
    return [[n / t for n, t in zip(samples, seconds)] for samples, seconds in
            zip(per_epoch(record, "samples"), per_epoch(record, "compute_seconds"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slow-cores", type=float, default=0.3,
                        help="CPU quota of the last worker, in cores")
    parser.add_argument("--quota-period-us", type=int, default=PERIOD_US,
                        help="the quota's accounting period (the kernel's default is 100000)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: the largest multiple of --workers up to 256")
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                        help="cnn: compute-bound steps; mlp: short, exchange-bound steps")
    parser.add_argument("--hidden", type=int, default=512, help="model width (see make_model)")
    parser.add_argument("--hook", default="dense", choices=("dense", "sparse", "dct"))
    parser.add_argument("--replan-every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all configurations")
    parser.add_argument("--quick", action="store_true", help="3 epochs, 1 round")
    parser.add_argument("--json", help="save the numbers here")
    args = parser.parse_args()
    reason = cpu_quota_unavailable()
    if reason is not None:
        print(f"bench_hetero: skipped: a real slow rank is not possible here ({reason}); "
              f"nothing is measured without one.")
        return 0
    # A terminated benchmark still leaves no cgroup behind: SIGTERM unwinds like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    epochs = 3 if args.quick else args.epochs
    if args.quick:
        args.repeats = 1
    if args.global_batch is None:
        args.global_batch = 256 - 256 % args.workers

    runs = [("equal", dict(batching="equal")),
            ("dynamic, per epoch", dict(batching="dynamic")),
            (f"dynamic, every {args.replan_every} steps", dict(
                batching="dynamic", replan_every=args.replan_every, smoothing=0.5,
                max_change=0.25))]
    # Rounds of one run per configuration: this shared machine drifts by tens of percent over
    # minutes, so ratios are taken within a round and their median is reported.
    rounds = []
    for round_index in range(args.repeats):
        records = {}
        for name, overrides in runs:
            config = TrainConfig(hook=args.hook, workers=args.workers, epochs=epochs,
                                 global_batch=args.global_batch, model=args.model,
                                 hidden=args.hidden, slow_worker_cores=args.slow_cores,
                                 slow_worker_period_us=args.quota_period_us,
                                 **overrides)
            records[name] = run_training(config)
            print(f"  round {round_index + 1}/{args.repeats} done: {name}", file=sys.stderr,
                  flush=True)
        rounds.append(analyse(records, args.workers, epochs))

    median = statistics.median
    summary = {key: median(r[key] for r in rounds)
               for key in ("ideal", "equal_time", "equal_not_compute", "reachable")}
    speeds = [median(r["speeds"][rank] for r in rounds) for rank in range(args.workers)]
    print(f"\nHeterogeneous ranks: {args.workers} gloo ranks on 127.0.0.1, the last under a "
          f"CPU quota of {args.slow_cores} cores (period {args.quota_period_us} us); digits "
          f"{args.model.upper()} (hidden {args.hidden}), global "
          f"batch {args.global_batch}, {rounds[0]['samples_per_epoch']} samples an epoch, "
          f"{epochs} epochs, hook {args.hook}; medians over {args.repeats} rounds")
    print(f"compute speed per rank with equal batches (samples/s): "
          f"{', '.join(f'{v:,.0f}' for v in speeds)}")
    print(f"ideal epoch time D / sum(v_i): {summary['ideal']:.3f} s; equal batches: "
          f"{summary['equal_time']:.3f} s, of which {summary['equal_not_compute']:.3f} s is not "
          f"compute (gradient exchange, optimizer, Python: no split removes it); ideal plus "
          f"that: {summary['reachable']:.3f} s\n")
    header = ("batching", "batch sizes (last epoch)", "epoch s", "compute s per rank",
              "ideal s at this run's speeds", "speedup vs equal", "of ideal speedup",
              "of ideal speedup, per round", "test acc")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    rows = []
    for name, _ in runs:
        per_round = [r["rows"][name] for r in rounds]
        row = {key: median(p[key] for p in per_round)
               for key in ("epoch_seconds", "speedup", "of_ideal_speedup", "own_ideal",
                           "accuracy")}
        row["compute_seconds"] = [median(p["compute_seconds"][rank] for p in per_round)
                                  for rank in range(args.workers)]
        row.update(batching=name, batch_sizes=per_round[-1]["batch_sizes"], rounds=per_round)
        rows.append(row)
        shares = ", ".join(f"{100 * p['of_ideal_speedup']:.0f}%" for p in per_round)
        print(f"| {name} | {row['batch_sizes']} | {row['epoch_seconds']:.3f} | "
              f"{', '.join(f'{c:.3f}' for c in row['compute_seconds'])} | "
              f"{row['own_ideal']:.3f} | {row['speedup']:.2f}x | "
              f"{100 * row['of_ideal_speedup']:.0f}% | "
              f"{shares} | "
              f"{100 * row['accuracy']:.1f}% |")
    print("\nepoch s, compute s (forward + backward, waiting excluded) and speeds: medians over "
          "the epochs after the first (the first is an equal split), training only. ideal s at "
          "this run's speeds: D / sum(v_i) with the speeds the ranks had in that run (a rank's "
          "samples/s change with its batch size). speedup and of ideal speedup (measured "
          "speedup / ideal speedup, the issue's aim: >= 90%) are taken within each round.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), summary=summary, speeds=speeds, rows=rows), f,
                      indent=1)
    return 0


def analyse(records, workers, epochs):
    """One round: the ideal from the equal run's speeds, and every run against it."""
    equal = records["equal"]
    samples_per_epoch = sum(equal["epochs"]["batch_sizes"][0]) * (equal["steps"] // epochs)
    speeds = [steady([epoch[r] for epoch in rank_speeds(equal)]) for r in range(workers)]
    ideal = samples_per_epoch / sum(speeds)
    equal_time = steady(equal["epochs"]["seconds"])
    equal_not_compute = equal_time - max(samples_per_epoch / workers / v for v in speeds)
    rows = {}
    for name, record in records.items():
        seconds = record["epochs"]["seconds"]
        speedup = equal_time / steady(seconds)
        own_speeds = [steady([epoch[r] for epoch in rank_speeds(record)]) for r in range(workers)]
        rows[name] = dict(
            epoch_seconds=steady(seconds), epoch_seconds_all=seconds,
            compute_seconds=[steady([epoch[r] for epoch in per_epoch(record, "compute_seconds")])
                             for r in range(workers)],
            own_speeds=own_speeds, own_ideal=samples_per_epoch / sum(own_speeds),
            speedup=speedup, of_ideal_speedup=speedup / (equal_time / ideal),
            batch_sizes=record["epochs"]["batch_sizes"][-1],
            batch_sizes_all=record["epochs"]["batch_sizes"], accuracy=record["final_accuracy"])
    return dict(samples_per_epoch=samples_per_epoch, speeds=speeds, ideal=ideal,
                equal_time=equal_time, equal_not_compute=equal_not_compute,
                reachable=ideal + equal_not_compute, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
