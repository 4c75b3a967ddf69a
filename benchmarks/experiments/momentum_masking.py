"""SGD with the sparse hook's momentum correction, which clears the velocity of a sent segment.

A gradient added to the velocity shortly before its segment is sent then counts once instead of
``1 / (1 - momentum)`` times: at ~1/density steps between sends, about half of momentum SGD's
step is lost. Variants:
- ``clear``: the hook's momentum correction at the rate given;
- ``none``: no momentum correction; error feedback on the gradient, and the optimizer's
  momentum applied to the agreed sum;
- ``prepared``: the recipe as a user runs it: the dense optimizer (momentum 0.9, the dense rate)
  handed to ``state.prepare_optimizer``, i.e. ``clear`` at
  ``momentum_correction_lr_scale(density, 0.9)`` times the rate (2.1 at 8%).
Two further variants (``keep``, never clearing; ``defer``, the cleared step put into the
residual), a simulated ternary wire and a ``smooth`` fit replaced the hook's private functions;
their results are in benchmarks/results/momentum_masking.txt and docs/design/recipes-sgd.md, and
the script that ran them is at commit 4031498.

The digits MLP of bench_convergence.py (SGD, momentum 0.9, 8 epochs), int8 wire, 8% of segments
of 512, at lr 0.02 / 0.05 / 0.1 and 2 / 4 ranks, over several seeds. Prints one line per run and
a table of means. Results: benchmarks/results/momentum_masking.txt.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/momentum_masking.py [--variants clear,none,prepared]
       [--lrs 0.02,0.05,0.1] [--ranks 2,4] [--seeds 0,1,2] [--model cnn]
       [--density 0.08] [--density-warmup STEPS] [--segment-size 512] [--hidden H] [--epochs E]
       (--model cnn: the digits CNN of recipe_generality.py, 6 epochs; --model gpt: the transformer)
"""

import argparse
import math
import statistics
import sys
from typing import Optional

from lab.training import TrainConfig, run_training

SPARSE = dict(density=0.08, momentum=0.9, wire_dtype="int8", segment_size=512)
DIGITS = dict(model="mlp", optimizer="sgd", momentum=0.9, epochs=8)
# Per model: TrainConfig settings and the batch per rank. The CNN is recipe_generality.py's; the
# transformer is bench_convergence.py's gpt_adamw with SGD (compare its per-run val loss).
MODELS = {"mlp": (dict(), 32), "cnn": (dict(model="cnn", hidden=64, epochs=6), 32),
          "gpt": (dict(model="gpt", hidden=128, epochs=4, lr_warmup_steps=30, lr_schedule="cosine",
                       clip_norm=1.0), 16)}


def case(variant: str, lr: float, ranks: int, seed: int, model: str = "mlp",
         density: float = SPARSE["density"], density_warmup: int = 0,
         segment_size: int = SPARSE["segment_size"], hidden: Optional[int] = None,
         epochs: Optional[int] = None) -> TrainConfig:
    settings, per_rank_batch = MODELS[model]
    overrides = dict(hidden=hidden, epochs=epochs)
    settings = dict(settings, **{k: v for k, v in overrides.items() if v is not None})
    options = dict(DIGITS, **settings, lr=lr, workers=ranks, global_batch=per_rank_batch * ranks, seed=seed)
    if variant == "dense":
        return TrainConfig(hook="dense", **options)
    sparse = dict(SPARSE, density=density, density_warmup_steps=density_warmup,
                  segment_size=segment_size)
    if variant == "none":  # no momentum correction: the optimizer's momentum, after the sum
        sparse["momentum"] = 0.0
    return TrainConfig(hook="sparse", hook_settings=sparse, prepare_optimizer=variant == "prepared",
                       **options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="clear,none,prepared")
    parser.add_argument("--lrs", default="0.02,0.05,0.1")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--density", type=float, default=SPARSE["density"])
    parser.add_argument("--density-warmup", type=int, default=0, metavar="STEPS",
                        help="the hook's density_warmup_steps (density falls from 1 over STEPS)")
    parser.add_argument("--segment-size", type=int, default=SPARSE["segment_size"])
    parser.add_argument("--hidden", type=int, help="the model's width instead of its default")
    parser.add_argument("--epochs", type=int, help="instead of the model's own")
    args = parser.parse_args()
    print("python " + " ".join(sys.argv), flush=True)
    accuracy = {}
    for ranks in (int(x) for x in args.ranks.split(",")):
        for lr in (float(x) for x in args.lrs.split(",")):
            for variant in ["dense"] + args.variants.split(","):
                for seed in (int(x) for x in args.seeds.split(",")):
                    record = run_training(case(variant, lr, ranks, seed, args.model,
                                               args.density, args.density_warmup,
                                               args.segment_size, args.hidden, args.epochs),
                                          timeout=3600)
                    acc, loss = 100 * record["final_accuracy"], record["epochs"]["test_loss"][-1]
                    ratio = record["dense_bytes_per_step"] / record["bytes_per_step"]
                    acc = acc if math.isfinite(loss) else float("nan")  # diverged
                    accuracy.setdefault((ranks, lr, variant), []).append(acc)
                    print(f"{variant:>6} lr {lr:g} ranks {ranks} seed {seed}: val acc {acc:.1f}% "
                          f"val loss {loss:.3f} ({ratio:.1f}x)", flush=True)
    print("\n| ranks | lr | " + " | ".join(["dense"] + args.variants.split(",")) + " |")
    print("|---" * (3 + len(args.variants.split(","))) + "|")
    for ranks, lr in sorted({key[:2] for key in accuracy}):
        cells = []
        for variant in ["dense"] + args.variants.split(","):
            values = [v for v in accuracy[(ranks, lr, variant)] if math.isfinite(v)]
            diverged = len(accuracy[(ranks, lr, variant)]) - len(values)
            if not values:
                cells.append("diverged")
                continue
            dense = statistics.mean(accuracy[(ranks, lr, "dense")])
            mean = statistics.mean(values)
            cells.append(f"{mean:.1f}%" + ("" if variant == "dense" else f" ({mean - dense:+.1f})")
                         + (f", {diverged} diverged" if diverged else ""))
        print(f"| {ranks} | {lr:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
