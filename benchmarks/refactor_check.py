"""Behaviour-unchanged check for refactorings of hetero_comm/hooks/.

Runs a fixed set of short trainings (2 ranks, the digits MLP, a few steps) that between them
take every variant of the hooks, and saves each run's final parameters and the bytes it
handed to collectives. Run it once on the code before a refactoring (``save``), then after
every step (``compare``): every array must be bitwise equal and every byte count identical.

Usage: python benchmarks/refactor_check.py save /tmp/refactor_baseline.npz
       python benchmarks/refactor_check.py compare /tmp/refactor_baseline.npz
       python benchmarks/refactor_check.py list
"""

import json
import sys
import time

import numpy as np

from hetero_comm.hooks import DCT
from lab.launch import run_ranks
from lab.training import TrainConfig, train_rank

SPARSE = dict(density=0.1, segment_size=16)

# name -> TrainConfig keywords. Every run: 2 ranks, mlp, one epoch cut at max_steps.
CONFIGS = {
    "dense": dict(hook="dense"),
    "sparse_current": dict(hook="sparse", hook_settings=SPARSE),
    "sparse_bf16": dict(hook="sparse", hook_settings=dict(SPARSE, wire_dtype="bfloat16")),
    "sparse_fp16": dict(hook="sparse", hook_settings=dict(SPARSE, wire_dtype="float16")),
    "sparse_int8": dict(hook="sparse", hook_settings=dict(SPARSE, wire_dtype="int8")),
    "sparse_dct": dict(hook="sparse", hook_settings=dict(SPARSE, basis=DCT(16))),
    "sparse_sign_adamw": dict(hook="sparse", optimizer="adamw", lr=1e-3, prepare_optimizer=True,
                              hook_settings=dict(SPARSE, output="sign")),
    "sparse_dct_sign_int8_adamw": dict(hook="sparse", optimizer="adamw", lr=1e-3,
                                       prepare_optimizer=True, weight_decay=0.01,
                                       hook_settings=dict(SPARSE, basis="dct", output="sign",
                                                          wire_dtype="int8")),
    "sparse_sign_adamw_direct": dict(hook="sparse", optimizer="adamw", lr=1e-3,
                                     hook_settings=dict(SPARSE, output="sign")),
    "sparse_momentum_sgd": dict(hook="sparse", optimizer="sgd", momentum=0.9,
                                prepare_optimizer=True,
                                hook_settings=dict(SPARSE, momentum=0.9)),
    "sparse_momentum_int8_minseg": dict(hook="sparse", optimizer="sgd", momentum=0.9,
                                        prepare_optimizer=True,
                                        hook_settings=dict(density=0.08, segment_size=256,
                                                           momentum=0.9, wire_dtype="int8",
                                                           min_segments_per_bucket=150)),
    "sparse_minseg": dict(hook="sparse", hook_settings=dict(density=0.1, segment_size=1024,
                                                            min_segments_per_bucket=150)),
    "sparse_density_warmup": dict(hook="sparse", hook_settings=dict(SPARSE, density_warmup_steps=3,
                                                                    warmup_steps=2)),
    "sparse_small_buckets": dict(hook="sparse", bucket_cap_mb=0.01,
                                 hook_settings=dict(SPARSE, min_compress_numel=100)),
    "sparse_weighted": dict(hook="sparse", hook_settings=dict(SPARSE, rank_weight=0.5)),
    "sparse_skip_dropped": dict(hook="sparse", dropout=0.5, dropout_kind="unit",
                                skip_dropped=True, hook_settings=SPARSE),
    "dense_skip_dropped": dict(hook="dense", dropout=0.5, dropout_kind="unit", skip_dropped=True),
    "dct_quant": dict(hook="dct", hook_settings=dict(block_size=64, keep_ratio=0.25)),
    "recipe_sgd": dict(hook="recipe", optimizer="sgd", momentum=0.9),
    "recipe_adamw": dict(hook="recipe", optimizer="adamw", lr=1e-3, weight_decay=0.01),
}


def config_of(name: str) -> TrainConfig:
    settings = dict(workers=2, model="mlp", hidden=64, epochs=1, max_steps=7, global_batch=64)
    settings.update(CONFIGS[name])
    return TrainConfig(**settings)


def _worker(rank: int, world_size: int, names) -> dict:
    """Every run in this one gloo group (one launch: the machine is slow to start processes)."""
    results = {}
    for name in names:
        record = train_rank(rank, config_of(name))
        assert record["ranks_identical"], name
        stats = record["hook_stats"] or {}
        results[name] = {"parameters": np.asarray(record["final_parameters"]),
                         "bytes_total": int(record["bytes_total"]),
                         "bytes_sent": stats.get("bytes_sent"),
                         "bytes_dense": stats.get("bytes_dense")}
    return results


def main() -> None:
    mode = sys.argv[1]
    if mode == "list":
        print("\n".join(CONFIGS))
        return
    path = sys.argv[2] if sys.argv[2].endswith(".npz") else sys.argv[2] + ".npz"  # (as savez names it)
    names = sys.argv[3:] or list(CONFIGS)
    began = time.perf_counter()
    results = run_ranks(2, _worker, names, timeout=3000)[0]
    for name, r in results.items():
        print(f"{name:32s} bytes_total={r['bytes_total']:>9d}", flush=True)
    print(f"{len(results)} runs in {time.perf_counter() - began:.0f}s", flush=True)
    if mode == "save":
        np.savez(path, **{name: r["parameters"] for name, r in results.items()})
        counts = {name: {k: v for k, v in r.items() if k != "parameters"} for name, r in results.items()}
        with open(path + ".json", "w") as f:
            json.dump(counts, f, indent=1)
        print(f"saved {len(results)} runs to {path} and {path}.json")
        return
    saved = np.load(path)
    with open(path + ".json") as f:
        counts = json.load(f)
    failures = []
    for name, r in results.items():
        if not np.array_equal(saved[name], r["parameters"]) or saved[name].dtype != r["parameters"].dtype:
            failures.append(f"{name}: parameters differ")
        for key, value in r.items():
            if key != "parameters" and counts[name][key] != value:
                failures.append(f"{name}: {key} {value} != {counts[name][key]}")
    print("\n".join(failures) if failures else f"all {len(results)} runs bitwise equal, "
                                                f"byte counts identical")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
