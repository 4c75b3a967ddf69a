"""The SGD recipe with weight decay, before and after the recipes kept dense's decay.

bench_generality's ResNet (38K parameters, GroupNorm, 20 epochs, 2 gloo ranks) with SGD
(momentum 0.9, lr 0.05) and weight decay: dense, the recipe (``hetero_comm.compress``, which
now decays parameters at dense momentum SGD's ``lr * wd / (1 - m)``), and the recipe at
``0.21 * wd``, which under the new scaling is the decay the recipe applied before the change
(the step's 2.1x factor with the momentum in the hook: ``2.11 * (1 - m) = 0.21`` of dense's).
Prints each seed's test loss and accuracy and their means. Results:
``benchmarks/results/sgd_weight_decay.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/sgd_weight_decay.py [--weight-decay 5e-4] [--seeds 5]
"""

import argparse
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_generality  # noqa: E402  (the workload's settings)
from hetero_comm.hooks.segment_sparse import momentum_correction_lr_scale  # noqa: E402
from lab.training import TrainConfig, run_training  # noqa: E402
from hetero_comm.recipes import SGD_DENSITY  # noqa: E402

MOMENTUM = 0.9
# the recipe's rate factor times (1 - momentum): its decay before, as a share of dense's
OLD_DECAY_FACTOR = momentum_correction_lr_scale(SGD_DENSITY, MOMENTUM) * (1 - MOMENTUM)


def run(hook: str, weight_decay: float, seed: int, lr: float):
    options = dict(bench_generality.MODELS["resnet"], optimizer="sgd", momentum=MOMENTUM, lr=lr,
                   weight_decay=weight_decay, workers=2, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the call's warning for SGD on normalised models
        record = run_training(TrainConfig(hook=hook, **options), timeout=3600)
    return record["epochs"]["test_loss"][-1], record["final_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    wd = args.weight_decay
    runs = {"dense": ("dense", wd), "recipe": ("recipe", wd),
            f"recipe at {OLD_DECAY_FACTOR:.2f} wd (as before)": ("recipe", OLD_DECAY_FACTOR * wd)}
    results = {name: [] for name in runs}
    for seed in range(args.seeds):
        cells = []
        for name, (hook, decay) in runs.items():
            results[name].append(run(hook, decay, seed, args.lr))
            cells.append(f"{name} {results[name][-1][0]:.4f} / {results[name][-1][1]:.1%}")
        print(f"seed {seed}: " + ", ".join(cells), flush=True)
    print(f"means over {args.seeds} seeds (test loss / accuracy), lr {args.lr:g}, weight decay {wd:g}:")
    for name, values in results.items():
        print(f"  {name}: {statistics.mean(v[0] for v in values):.4f} / "
              f"{statistics.mean(v[1] for v in values):.2%}")


if __name__ == "__main__":
    main()
