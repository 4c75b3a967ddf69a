"""Would selective recomputation (torch's ``create_selective_checkpoint_contexts``: keep the
matrix products' outputs, recompute the elementwise ops) bring bench_memory's transformer to
half its unplanned peak within 10% of its step time, where whole-block plans cost 1.20x?

Each configuration names a mode per block of the model (embedding, four transformer blocks,
head): ``k`` keep, ``s`` selective, ``r`` recompute the whole block. They run in turns
(``--rounds``), ``--steps`` AdamW steps each, on one thread; the table shows the median peak
above the step's start and the median step time, each against keeping everything.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/selective_recompute.py [--rounds 3] [--steps 3]
       [--configs kkkkkk,ksssskk,...]
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_memory  # noqa: E402  (the benchmark's workload and step loop)
from hetero_comm.memory import MemoryMeter  # noqa: E402

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten.convolution.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


def keep_products(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def forward_in_modes(model, modes: str):
    """The model's forward with block ``i`` kept, selectively or wholly recomputed by ``modes[i]``."""
    selective = functools.partial(create_selective_checkpoint_contexts, keep_products)

    def forward(x):
        for block, mode in zip(model, modes.ljust(len(model), "k")):
            if mode == "s":
                x = checkpoint(block, x, use_reentrant=False, context_fn=selective)
            elif mode == "r":
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x
    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default="kkkkkk,kssssk,krrrrk,kssrrk,krrssk,ksrsrk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, inputs, targets = bench_memory.transformer_workload(torch.device("cpu"))
    meter = MemoryMeter(torch.device("cpu"))
    configs = args.configs.split(",")
    samples = {config: [] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            samples[config].append(bench_memory.run_steps(model, inputs, targets,
                                                          forward_in_modes(model, config),
                                                          args.steps, 1, meter))
    medians = {config: (statistics.median(p for p, _ in runs), statistics.median(s for _, s in runs))
               for config, runs in samples.items()}
    base_peak, base_s = medians[configs[0]]
    print(f"{'modes':<10}{'peak MiB':>10}{'/ ' + configs[0]:>14}{'step ms':>10}{'/ ' + configs[0]:>14}")
    for config, (peak, seconds) in medians.items():
        print(f"{config:<10}{peak / 2**20:>10.1f}{peak / base_peak:>14.2f}{seconds * 1e3:>10.0f}"
              f"{seconds / base_s:>14.3f}")


if __name__ == "__main__":
    main()
