"""The lagged selection on the int8 wire against the current one, on the digits MLP (2 ranks,
SGD lr 0.02 momentum 0.9, 8 epochs), with the float32 wire at 1% and dense for reference.
Prints one line per run: final test accuracy, bytes per step and compression.

Usage: python benchmarks/experiments/lagged_int8.py
"""

from hetero_comm.lab.training import TrainConfig, run_training
def main():
    base = dict(workers=2, model="mlp", epochs=8, global_batch=64, optimizer="sgd", lr=0.02, momentum=0.9)
    for name, settings in [("current float32", dict(density=0.01)), ("lagged float32", dict(density=0.01, selection="lagged")),
                           ("current int8 4%", dict(density=0.04, wire_dtype="int8")), ("lagged int8 4%", dict(density=0.04, wire_dtype="int8", selection="lagged"))]:
        r = run_training(TrainConfig(hook="sparse", hook_settings=settings, **base), timeout=1200)
        print(f"{name:18s} acc {100*r['final_accuracy']:.1f}%  bytes/step {r['bytes_per_step']:.0f}  {r['dense_bytes_per_step']/r['bytes_per_step']:.1f}x", flush=True)
    r = run_training(TrainConfig(hook="dense", **base), timeout=1200)
    print(f"{'dense':18s} acc {100*r['final_accuracy']:.1f}%", flush=True)

if __name__ == "__main__":
    main()
