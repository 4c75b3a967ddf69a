"""The AdamW recipe's sign step scaled by how much the ranks' gradients agree: does it close the
gap at a constant rate without costing the transformer under its cosine schedule?

Each step the ranks' gradients ``g_i`` give ``rho = |sum g_i|^2 / (W sum |g_i|^2)`` (1 where
they agree, 1/W where they are independent noise), from which the summed gradient's signal to
noise ``S = (W rho - 1) / (1 - rho)`` follows (``E|sum g_i|^2 = W^2 |G|^2 + W N`` and
``E sum |g_i|^2 = W |G|^2 + W N``). The recipe's rate factor becomes ``1.5 * phi`` with
``phi = sqrt(S / (1 + S))`` (the size of Adam's step for a coordinate of that signal to noise),
``S`` from a running mean of both sums (decay ``--decay``), relative to the largest
``phi`` seen so far with ``--relative``. This experiment measures ``rho`` with an extra dense
allreduce of each bucket (the hook itself would not).

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/noise_scaled_sign.py --model mlp
       [--lr 3e-3] [--schedule constant] [--steps 200] [--seeds 0,1,2] [--variants dense,recipe,scaled]
       [--relative] [--decay 0.9]
"""

import argparse
import math
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
from hetero_comm.hooks._optimizer import HandedSign, OptimizerFit, SIGN_LR_SCALE
from hetero_comm.recipes import recipe_for
from lab.data import make_workload
from lab.launch import run_ranks
from lab.training import TrainConfig


MIN_FACTOR = 0.05


class AgreementScale:
    """Per step: the ranks' gradients' agreement, and the rate factor it gives."""

    def __init__(self, world_size: int, decay: float, relative: bool,
                 floor: float = MIN_FACTOR) -> None:
        self.world_size, self.decay, self.relative, self.floor = world_size, decay, relative, floor
        self.step_sums = torch.zeros(2, dtype=torch.float64)  # |sum g|^2, sum |g|^2
        self.mean = torch.zeros(2, dtype=torch.float64)
        self.steps, self.best, self.factor, self.history = 0, 0.0, 1.0, []

    def hook(self, state, bucket):
        local = bucket.buffer().detach().double()
        summed = local.clone()
        dist.all_reduce(summed)
        own = torch.tensor([local.square().sum()], dtype=torch.float64)
        dist.all_reduce(own)
        self.step_sums += torch.stack([summed.square().sum(), own[0]])
        if bucket.is_last():
            self.end_step()
        return segment_sparse_hook(state, bucket)

    def end_step(self) -> None:
        self.steps += 1
        self.mean.mul_(self.decay).add_(self.step_sums, alpha=1 - self.decay)
        self.step_sums.zero_()
        together, apart = (self.mean / (1 - self.decay ** self.steps)).tolist()
        w = self.world_size
        rho = together / (w * apart) if apart > 0 else 1.0
        signal = (w * rho - 1) / max(1 - rho, 1e-9)
        phi = max(math.sqrt(max(signal, 0.0) / (1 + max(signal, 0.0))), self.floor)
        self.best = max(self.best, phi)
        self.factor = phi / self.best if self.relative and self.best > 0 else phi
        self.history.append((rho, phi, self.factor))


def train(rank, world_size, variant, options, seed, decay, relative, schedule_aware=False,
          floor=MIN_FACTOR):
    config = TrainConfig(**options, seed=seed, workers=world_size)
    torch.manual_seed(seed)
    x, y, x_test, y_test, model = make_workload(config.model, config.hidden, seed)
    ddp = DistributedDataParallel(model)
    optimizer, schedule = config.make_optimizer(ddp.parameters(), config.max_steps)
    scale = None
    if variant != "dense":
        state = SegmentSparseState(process_group=ddp.process_group, **recipe_for(optimizer).settings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if variant == "scaled":
                scale = AgreementScale(world_size, decay, relative, floor)
                ddp.register_comm_hook(state, lambda state, bucket: scale.hook(state, bucket))
            else:
                ddp.register_comm_hook(state, segment_sparse_hook)
        handed = HandedSign()
        settings, _ = handed.fit(optimizer)
        peak = [0.0]

        def factor():
            if scale is None:
                return SIGN_LR_SCALE
            if not schedule_aware:
                return SIGN_LR_SCALE * scale.factor
            rate = optimizer.param_groups[0]["lr"]
            peak[0] = max(peak[0], rate)
            return SIGN_LR_SCALE * min(1.0, scale.factor * peak[0] / rate)
        OptimizerFit(optimizer, settings, factor, check=handed.fit,
                     weight_decay_scale=handed.weight_decay_scale)
    batch = config.global_batch // world_size
    generator = torch.Generator().manual_seed(seed * 1000)
    order, position = torch.randperm(len(x), generator=generator), 0
    for _ in range(config.max_steps):
        if position + batch * world_size > len(x):
            order, position = torch.randperm(len(x), generator=generator), 0
        index = order[position + rank * batch: position + (rank + 1) * batch]
        position += batch * world_size
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(x[index])
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[index].reshape(-1)).backward()
        if config.clip_norm:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        losses, correct, count = [], 0, 0
        for start in range(0, len(x_test), 256):
            logits = model(x_test[start:start + 256])
            target = y_test[start:start + 256]
            losses.append(float(nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")))
            correct += int((logits.argmax(-1) == target).sum())
            count += target.numel()
    history = scale.history if scale else []
    return dict(loss=sum(losses) / count, accuracy=correct / count,
                factors=[h[2] for h in history[::max(1, len(history) // 10)]])


MODELS = {"mlp": dict(model="mlp", hidden=256, global_batch=64),
          "gpt": dict(model="gpt", hidden=128, global_batch=32, clip_norm=1.0),
          "resnet": dict(model="resnet", hidden=256, global_batch=64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--schedule", default="constant")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default="dense,recipe,scaled")
    parser.add_argument("--decay", type=float, default=0.9)
    parser.add_argument("--relative", action="store_true")
    parser.add_argument("--floor", type=float, default=MIN_FACTOR, help="the factor's least value")
    parser.add_argument("--schedule-aware", action="store_true",
                        help="the factor only where it shrinks the step more than the schedule has")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    options = dict(MODELS[args.model], optimizer="adamw", weight_decay=0.01, lr=args.lr,
                   lr_schedule=args.schedule, lr_warmup_steps=args.warmup, max_steps=args.steps)
    for variant in args.variants.split(","):
        results = [run_ranks(args.ranks, train, variant, options, seed, args.decay, args.relative,
                             args.schedule_aware, args.floor)[0]
                   for seed in map(int, args.seeds.split(","))]
        print(f"{args.model} {args.schedule} lr {args.lr:g} {variant:7s} loss "
              f"{' / '.join(format(r['loss'], '.3f') for r in results)} "
              f"(mean {statistics.mean(r['loss'] for r in results):.3f}) acc "
              f"{statistics.mean(100 * r['accuracy'] for r in results):.1f}"
              + (f"  factor over the run {' '.join(f'{f:.2f}' for f in results[0]['factors'])}"
                 if results[0]["factors"] else ""), flush=True)


if __name__ == "__main__":
    main()
