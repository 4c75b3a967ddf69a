"""The lagged selection against the current one on the int8 wire, with both recipes' settings,
on the digits MLP and CNN, 2 and 4 ranks, against dense (one seed each, final test accuracy).
Also momentum correction in the DCT basis against the element basis (SGD recipe otherwise).

Each row: dense, the recipe with ``selection="current"``, the same with ``"lagged"``; the
optimizer is prepared by the hook state, as ``hetero_comm.compress`` does.
Results: benchmarks/results/lagged_int8.txt.

Usage: python benchmarks/experiments/lagged_int8.py
"""

from lab.training import TrainConfig, run_training

SGD_RECIPE = dict(density=0.08, segment_size=512, wire_dtype="int8", min_segments_per_bucket=150,
                  momentum=0.9)
ADAMW_RECIPE = dict(density=0.10, segment_size=512, wire_dtype="int8", basis="dct", output="sign")
MODELS = {"mlp": dict(model="mlp", epochs=8), "cnn": dict(model="cnn", hidden=64, epochs=12)}
# (model, ranks, optimizer settings, recipe, a label)
CASES = [
    ("mlp", 2, dict(optimizer="sgd", lr=0.02, momentum=0.9), SGD_RECIPE, "SGD recipe"),
    ("mlp", 2, dict(optimizer="sgd", lr=0.1, momentum=0.9), SGD_RECIPE, "SGD recipe"),
    ("mlp", 4, dict(optimizer="sgd", lr=0.05, momentum=0.9), SGD_RECIPE, "SGD recipe"),
    ("cnn", 2, dict(optimizer="sgd", lr=0.05, momentum=0.9), SGD_RECIPE, "SGD recipe"),
    ("mlp", 2, dict(optimizer="adamw", lr=1e-3, weight_decay=0.01), ADAMW_RECIPE, "AdamW recipe"),
    ("mlp", 2, dict(optimizer="adamw", lr=3e-3, weight_decay=0.01), ADAMW_RECIPE, "AdamW recipe"),
    ("cnn", 2, dict(optimizer="adamw", lr=3e-3, weight_decay=0.01), ADAMW_RECIPE, "AdamW recipe"),
]


def accuracy(hook: str, options: dict, settings: dict) -> tuple:
    record = run_training(TrainConfig(hook=hook, hook_settings=settings,
                                      prepare_optimizer=hook == "sparse", **options), timeout=1800)
    return 100 * record["final_accuracy"], record["dense_bytes_per_step"] / record["bytes_per_step"]


def main() -> None:
    print("| model | ranks | optimizer, lr | recipe | dense | current | lagged | compression |")
    print("|---|---|---|---|---|---|---|---|")
    for model, ranks, optimizer, recipe, label in CASES:
        options = dict(MODELS[model], workers=ranks, global_batch=32 * ranks, **optimizer)
        dense, _ = accuracy("dense", options, {})
        current, ratio = accuracy("sparse", options, recipe)
        lagged, _ = accuracy("sparse", options, dict(recipe, selection="lagged"))
        print(f"| {model} | {ranks} | {optimizer['optimizer']} {optimizer['lr']:g} | {label} | "
              f"{dense:.1f}% | {current:.1f}% | {lagged:.1f}% | {ratio:.1f}x |", flush=True)
    print("\nMomentum correction's basis (SGD recipe, mlp, 2 ranks, lr 0.05):")
    options = dict(MODELS["mlp"], workers=2, global_batch=64, optimizer="sgd", lr=0.05, momentum=0.9)
    dct = dict(SGD_RECIPE, basis="dct", dct_block_size=64, min_segments_per_bucket=150)
    for name, settings in (("elements", SGD_RECIPE), ("dct", dct)):
        acc, ratio = accuracy("sparse", options, settings)
        print(f"  {name}: {acc:.1f}% at {ratio:.1f}x", flush=True)


if __name__ == "__main__":
    main()
