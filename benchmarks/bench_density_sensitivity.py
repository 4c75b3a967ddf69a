"""How far the transformer's final loss moves when the two-level recipe's density moves a little.

bench_two_level compares the automatic density with fixed ones by the time each run takes to
come within 2% of dense's final loss. Its automatic rows never run the same densities twice (they
follow timings), so their spread over runs mixes what the density costs with how much any small
change moves this training. This benchmark measures the second part alone: deterministic density
schedules around the fixed 16x, on 4 gloo ranks over loopback (2 machines x 2 ranks, no link
shaping: no timing enters the results), the ``gpt_adamw`` workload of bench_two_level.

Rows (each a schedule of the density, every rank the same):
  fixed R      ``ratio=R`` (15, 16, 17 by default)
  pinned       ``ratio="auto"``, the automatic density's measurements and agreements running but
               its proposals replaced by the ceiling (= fixed 16: the machinery alone)
  dips F       ``ratio="auto"``, proposals replaced by the ceiling except 4 steps of every 100 at
               F x the ceiling (0.9 and 0.25 by default)

Usage: python benchmarks/bench_density_sensitivity.py [--seed 0] [--rows fixed16,pinned,...]
       [--json PATH] [--quick]

Each row takes about 3.5 minutes on this machine's 2 cores.
"""

import argparse
import json
import sys

DEFAULT_ROWS = "fixed15,fixed16,fixed17,pinned,dips0.9,dips0.25"
# A dip: proposals 40-43 of every 100 (agreements are every 4 proposals: one agreement's worth).
DIP_STEPS, DIP_PERIOD, DIP_BLOCK = 4, 100, 10


def scheduled_density(row: str, proposal_index: int, ceiling: float) -> float:
    """The density a scheduled row proposes at its ``proposal_index``-th proposal."""
    if row == "pinned":
        return ceiling
    factor = float(row[len("dips"):])
    in_dip = (proposal_index // DIP_STEPS) % (DIP_PERIOD // DIP_STEPS) == DIP_BLOCK
    return factor * ceiling if in_dip else ceiling


def train_row(rank: int, world_size: int, row: str, seed: int, max_steps, workload: dict) -> dict:
    from hetero_comm.hooks import _auto_density
    from lab.training import TrainConfig, train_rank

    if not row.startswith("fixed"):
        measured_propose = _auto_density.DensityController.propose

        def propose(self, window_seconds, compute_seconds, density):
            measured_propose(self, window_seconds, compute_seconds, density)  # keeps its clock
            return scheduled_density(row, self._steps - 1, self.ceiling)

        _auto_density.DensityController.propose = propose  # this rank's process only
    ratio = float(row[len("fixed"):]) if row.startswith("fixed") else "auto"
    record = train_rank(rank, TrainConfig(hook="recipe", hook_settings=dict(machines=2, ratio=ratio),
                                           seed=seed, max_steps=max_steps, workers=world_size,
                                           **workload))
    return dict(final_loss=record["epochs"]["test_loss"][-1], bytes_sent=record["hook_stats"]["bytes_sent"],
                losses=record["evaluations"]["test_loss"], ranks_identical=record["ranks_identical"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="20 steps per row (a smoke test)")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    for row in rows:
        if not (row == "pinned" or row.startswith("fixed") or row.startswith("dips")):
            parser.error(f"unknown row {row!r}: fixed<ratio>, pinned or dips<factor>")
    from bench_two_level import WORKLOADS  # the same training as bench_two_level's rows
    from lab.launch import run_ranks

    print("python " + " ".join(sys.argv))
    print(f"gpt_adamw, seed {args.seed}, 2 machines x 2 ranks over loopback; final test loss")
    results = {}
    print(f"{'row':<12}  {'final loss':>10}  {'bytes':>11}  {'identical':>9}")
    for row in rows:
        results[row] = run_ranks(4, train_row, row, args.seed, 20 if args.quick else None,
                                 WORKLOADS["gpt_adamw"], timeout=1800)[0]
        r = results[row]
        print(f"{row:<12}  {r['final_loss']:>10.4f}  {r['bytes_sent']:>11,}  {str(r['ranks_identical']):>9}",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
