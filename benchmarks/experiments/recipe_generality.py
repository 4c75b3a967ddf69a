"""Does the DCT-sign recipe (README: "Compression with AdamW") hold beyond the configuration
bench_convergence.py measures (the transformer at AdamW lr 3e-3)? AdamW on the digits MLP at
two learning rates, on the digits CNN (also at higher density), and on the transformer at lr
1e-3; each against dense and torch's PowerSGD rank 4, 2 ranks. Prints one line per case.
Results: benchmarks/results/recipe_generality.txt.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/recipe_generality.py [--wire int8] [--density 0.1]
       [--models mlp,cnn,gpt] [--no-peers] [--workers 2] [--weight-decay 0.01] [--lrs 1.5e-3,...]
       [--segment-size 512]
(--wire int8: the recipe at 10% on the int8 wire instead of 5.5% in bfloat16; --no-peers: the
recipe's rows only, dense and PowerSGD being deterministic and already measured; --workers:
ranks, the global batch unchanged; --weight-decay 0: Adam without weight decay; --lrs: run each
model at these learning rates instead of its cases' own.)
"""

import argparse
import sys

from lab.training import TrainConfig, run_training

RECIPE = dict(density=0.055, segment_size=512, wire_dtype="bfloat16", basis="dct", output="sign")
INT8_RECIPE = dict(RECIPE, density=0.10, wire_dtype="int8")
CASES = [
    ("mlp", dict(model="mlp", optimizer="adamw", lr=1e-3, weight_decay=0.01, epochs=8, global_batch=64), ()),
    ("mlp", dict(model="mlp", optimizer="adamw", lr=3e-3, weight_decay=0.01, epochs=8, global_batch=64), ()),
    ("cnn", dict(model="cnn", hidden=64, optimizer="adamw", lr=1e-3, weight_decay=0.01, epochs=6,
                 global_batch=64),
     (("recipe at 20%, segments of 64", dict(RECIPE, density=0.2, segment_size=64)),
      ("plain sparse 5.5%", dict(density=0.055)))),
    ("gpt", dict(model="gpt", hidden=128, optimizer="adamw", lr=1e-3, weight_decay=0.01,
                 lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=4, global_batch=32), ()),
]


def measure(hook: str, settings: dict, options: dict) -> str:
    extra = dict(bucket_cap_mb=64) if hook == "powersgd" else {}  # torch's hook on gloo: one bucket
    record = run_training(TrainConfig(hook=hook, hook_settings=settings, **options, **extra), timeout=3600)
    return (f"loss {record['epochs']['test_loss'][-1]:.3f} acc {100 * record['final_accuracy']:.1f} "
            f"({record['dense_bytes_per_step'] / record['bytes_per_step']:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wire", choices=("bfloat16", "int8"), default="bfloat16")
    parser.add_argument("--density", type=float, help="the recipe's density (default: 0.055 bfloat16, 0.1 int8)")
    parser.add_argument("--models", default="mlp,cnn,gpt")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--weight-decay", type=float, help="instead of each case's 0.01")
    parser.add_argument("--lrs", help="comma-separated learning rates instead of the cases' own")
    parser.add_argument("--segment-size", type=int, help="the recipe's segment_size (default 512)")
    args = parser.parse_args()
    print("python " + " ".join(sys.argv), flush=True)
    recipe = INT8_RECIPE if args.wire == "int8" else RECIPE
    if args.density is not None:
        recipe = dict(recipe, density=args.density)
    if args.segment_size is not None:
        recipe = dict(recipe, segment_size=args.segment_size)
    peers = [] if args.no_peers else [("dense", "dense", {}),
                                      ("PowerSGD rank 4", "powersgd", dict(matrix_approximation_rank=4))]
    cases = CASES
    if args.lrs:  # each model's first case at every given rate
        firsts = {}
        for model, options, more in CASES:
            firsts.setdefault(model, (options, more))
        cases = [(model, dict(options, lr=float(lr)), more) for model, (options, more) in firsts.items()
                 for lr in args.lrs.split(",")]
    for model, options, more in cases:
        if model not in args.models.split(","):
            continue
        options = dict(options, workers=args.workers)
        if args.weight_decay is not None:
            options["weight_decay"] = args.weight_decay
        tuned = args.wire == "int8" or args.density is not None or args.segment_size is not None
        extra = [] if tuned else [(name, "sparse", s) for name, s in more]
        rows = peers + [("recipe", "sparse", recipe)] + extra
        cells = [f"{name}: {measure(hook, settings, options)}" for name, hook, settings in rows]
        print(f"{model} AdamW lr {options['lr']} wd {options['weight_decay']}, {args.workers} ranks: "
              + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
