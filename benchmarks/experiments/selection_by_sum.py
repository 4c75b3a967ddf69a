"""Why does error feedback help the DCT-sign recipe less at 4 ranks? One candidate: the ranks
agree on segments by the sum of their own norms, sum_r |a_r|, which counts each rank's noise,
while what is sent is the sum, whose norm |sum_r a_r| is what matters. With more ranks the
noise weighs more. The transformer of bench_convergence.py (gpt_adamw), the recipe at 5.5%,
with the selection replaced (monkeypatched in each rank) by:
  - "oracle": the norm of the summed coefficients (a full allreduce: a measurement, not a method);
  - "sketch<p>": p random +-1 projections of every segment (the same on every rank, new each
    step), summed over ranks: sum_j (sum_r s_j . a_r)^2 / p estimates |sum_r a_r|^2.
And, once the selection was ruled out, density at equal bytes:
  - "bf16_<density>": the recipe at another density;
  - "int8_<density>_<clip>": an int8 wire simulated in float32 (a step shared by the ranks,
    clipping at <clip> RMS, the error kept in the residual), the prototype of
    ``wire_dtype="int8"``.
Prints one line per run. Results: benchmarks/results/selection_by_sum.txt.

Usage: python benchmarks/experiments/selection_by_sum.py [--cases recipe,oracle,sketch4,int8_0.11_4]
       [--ranks 4] [--lr 3e-3]
"""

import argparse
import dataclasses
import sys

import torch
import torch.distributed as dist

from hetero_comm.lab.training import TrainConfig, run_training

GPT = dict(model="gpt", hidden=128, optimizer="adamw", weight_decay=0.01, lr_warmup_steps=30,
           lr_schedule="cosine", clip_norm=1.0, epochs=4)
RECIPE = dict(density=0.055, segment_size=512, wire_dtype="bfloat16", basis="dct", output="sign")


def _select_by_sum(projections: int) -> None:
    """Replace the agreement on importance: 0 projections = the oracle (the whole sum)."""
    from hetero_comm import ops
    from hetero_comm.hooks import segment_sparse

    def agree_and_select(state, plan_bucket, importance, k, index, step, space):
        segments = space.vector.view(-1, state.segment_size)
        if projections == 0:
            total = space.vector.clone()
            dist.all_reduce(total, group=state.process_group)
            torch.linalg.vector_norm(total.view_as(segments), dim=1, out=importance)
        else:
            generator = torch.Generator().manual_seed(1000003 * step + index)
            signs = torch.randint(0, 2, (state.segment_size, projections), generator=generator)
            sketch = segments @ (signs.float() * 2 - 1)
            dist.all_reduce(sketch, group=state.process_group)
            torch.linalg.vector_norm(sketch, dim=1, out=importance)
        indices = state.pool.acquire(k, torch.int64, importance.device)
        return ops.select_segments(importance, k, out=indices), None

    segment_sparse._agree_and_select = agree_and_select


def _integer_wire(clip: float) -> None:
    """Simulate an int8 wire whose sum cannot overflow: every rank rounds a selected segment
    to a step shared by all ranks (from the agreed importance, sum_r |a_r|), at most
    127 // W steps each way, and keeps the rounding (and clipping) error in its residual.
    Sent as float32 here; the bytes are counted as one per value."""
    from hetero_comm import ops
    from hetero_comm.hooks import segment_sparse

    agreed = {}
    original_select, original_pack = segment_sparse._agree_and_select, ops.pack_segments_

    def agree_and_select(state, plan_bucket, importance, k, index, step, space):
        indices, finite = original_select(state, plan_bucket, importance, k, index, step, space)
        agreed["importance"] = importance[indices].clone()
        return indices, finite

    def pack(vector, indices, segment, out):
        original_pack(vector, indices, segment, out=out)  # out = the values, sent ones zeroed
        world = dist.get_world_size()
        levels = 127 // world
        rms = agreed["importance"] / (world * segment ** 0.5)  # a rank's typical value
        step = (clip * rms / levels).clamp_(min=1e-30).repeat_interleave(segment)
        rounded = torch.round(out / step).clamp_(-levels, levels).mul_(step)
        error = ops.unpack_segments(out - rounded, indices, segment, vector.numel())
        vector.add_(error)
        return out.copy_(rounded)

    segment_sparse._agree_and_select = agree_and_select
    ops.pack_segments_ = pack


@dataclasses.dataclass
class SelectionConfig(TrainConfig):
    projections: int = -1  # -1: the recipe's selection
    integer_clip: float = 0.0  # > 0: the simulated int8 wire, clipping at this many rms

    def make_optimizer(self, parameters, total_steps: int):
        if self.projections >= 0:  # runs in each rank's process
            _select_by_sum(self.projections)
        if self.integer_clip > 0:
            _integer_wire(self.integer_clip)
        return super().make_optimizer(parameters, total_steps)


def case(name: str, lr: float, ranks: int) -> TrainConfig:
    options = dict(GPT, lr=lr, workers=ranks, global_batch=16 * ranks)  # 16 windows per rank
    if name == "dense":
        return TrainConfig(hook="dense", **options)
    if name == "recipe":
        return TrainConfig(hook="sparse", hook_settings=RECIPE, **options)
    if name.startswith("int8_"):  # int8_<density>_<clip>: the simulated int8 wire
        density, clip = (float(x) for x in name[len("int8_"):].split("_"))
        settings = dict(RECIPE, density=density, wire_dtype="float32")
        return SelectionConfig(hook="sparse", hook_settings=settings, integer_clip=clip, **options)
    if name.startswith("bf16_"):  # bf16_<density>: the recipe at another density
        return TrainConfig(hook="sparse", hook_settings=dict(RECIPE, density=float(name[5:])), **options)
    projections = 0 if name == "oracle" else int(name[len("sketch"):])
    return SelectionConfig(hook="sparse", hook_settings=RECIPE, projections=projections, **options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="recipe,oracle,sketch4")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    print("python " + " ".join(sys.argv), flush=True)
    for name in args.cases.split(","):
        record = run_training(case(name, args.lr, args.ranks), timeout=3600)
        print(f"{name:>8} lr {args.lr:g} ranks {args.ranks}: val loss "
              f"{record['epochs']['test_loss'][-1]:.3f} ({record['steps']} steps)", flush=True)


if __name__ == "__main__":
    main()
