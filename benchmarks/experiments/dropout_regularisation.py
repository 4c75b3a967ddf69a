"""How well does unit dropout (the same units dropped for the whole batch on every rank)
regularise, against standard per-sample dropout? The digits MLP (hidden 1024), 2 ranks, dense
allreduce, at several optimizers and learning rates; test accuracy / test loss per cell.
Results: benchmarks/results/dropout_regularisation.txt.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/dropout_regularisation.py
"""

from lab.training import TrainConfig, run_training

SETTINGS = [  # (optimizer, lr, epochs)
    ("sgd", 0.05, 16), ("sgd", 0.02, 16), ("sgd", 0.1, 8), ("adamw", 1e-3, 16),
]
ROWS = [("none", dict(dropout=0.0)), ("std.5", dict(dropout=0.5)),
        ("unit.5", dict(dropout=0.5, dropout_kind="unit")), ("std.2", dict(dropout=0.2)),
        ("unit.2", dict(dropout=0.2, dropout_kind="unit"))]


def run(optimizer: str, lr: float, epochs: int, **options) -> str:
    config = TrainConfig(model="mlp", hidden=1024, optimizer=optimizer, lr=lr, momentum=0.9,
                         weight_decay=0.01 if optimizer == "adamw" else 0.0, global_batch=64,
                         epochs=epochs, hook="dense", **options)
    record = run_training(config, timeout=3600)
    return f"{100 * record['final_accuracy']:.1f}/{record['epochs']['test_loss'][-1]:.3f}"


def main() -> None:
    print("PYTHONPATH=benchmarks python benchmarks/experiments/dropout_regularisation.py", flush=True)
    for optimizer, lr, epochs in SETTINGS:
        cells = [f"{name} {run(optimizer, lr, epochs, **options)}" for name, options in ROWS]
        print(f"{optimizer} lr {lr} epochs {epochs}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
