"""Does a compressed recipe keep the user's AdamW learning rate? The transformer of
bench_convergence.py (gpt_adamw), 2 ranks, at several learning rates: dense AdamW, the
DCT-sign recipe (AdamW betas (0, 0); bfloat16 5.5% or int8 10%), and candidates that keep
AdamW's betas (the int8 recipe with AdamW's default betas among them); ``prepared_int8``: the
int8 recipe run as users do, dense AdamW at the dense rate handed to
``state.prepare_optimizer`` (betas (0, 0), 1.5x the rate inside each step). Prints one line
per run. Results: benchmarks/results/lr_transfer.txt (its ``signum<beta>`` rows, a momentum
of the agreed sums before the sign, came from a case that replaced a private function of the
hook; it is at commit 4031498).

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/lr_transfer.py [--cases dense,recipe] [--lrs 1e-3,3e-3]
       [--ranks 2]
"""

import argparse
import dataclasses
import math
import sys

import torch

from lab.training import TrainConfig, run_training

GPT = dict(model="gpt", hidden=128, optimizer="adamw", weight_decay=0.01, lr_warmup_steps=30,
           lr_schedule="cosine", clip_norm=1.0, epochs=4, global_batch=32)
SPARSE = dict(density=0.055, segment_size=512, wire_dtype="bfloat16", basis="dct")
SPARSE_INT8 = dict(density=0.10, segment_size=512, wire_dtype="int8", basis="dct")


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW whose second moment stops updating after ``freeze_step`` steps (1-bit Adam's
    observation: the update is then linear in the gradient, which error feedback needs)."""

    def __init__(self, params, lr: float, betas, weight_decay: float, freeze_step: int,
                 eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.freeze_step = freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["m"].lerp_(p.grad, 1 - beta1)
                if t <= self.freeze_step:
                    state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                v_hat = state["v"] / (1 - beta2 ** min(t, self.freeze_step))
                m_hat = state["m"] / (1 - beta1 ** t)
                p.addcdiv_(m_hat, v_hat.sqrt_().add_(group["eps"]), value=-group["lr"])


@dataclasses.dataclass
class FrozenConfig(TrainConfig):
    """TrainConfig with :class:`FrozenVarianceAdamW` (the hook's dense warm-up sets the freeze)."""

    freeze_step: int = 10

    def make_optimizer(self, parameters, total_steps: int):
        optimizer = FrozenVarianceAdamW(parameters, lr=self.lr, betas=(0.9, 0.999),
                                        weight_decay=self.weight_decay, freeze_step=self.freeze_step)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor(total_steps))


@dataclasses.dataclass
class SignConfig(TrainConfig):
    """AdamW with betas (0, 0) after any hook: a sign step of the (dense) sum."""

    def adam_betas(self):
        return (0.0, 0.0)


@dataclasses.dataclass
class DefaultBetasConfig(TrainConfig):
    """The recipe run by a user who keeps AdamW's default betas (0.9, 0.999)."""

    def adam_betas(self):
        return (0.9, 0.999)


def case(name: str, lr: float, ranks: int) -> TrainConfig:
    # the same per-rank batch at every world size, as bench_convergence.py
    options = dict(GPT, lr=lr, workers=ranks, global_batch=GPT["global_batch"] // 2 * ranks)
    if name == "dense":
        return TrainConfig(hook="dense", **options)
    if name == "densesign":  # the sign step without compression
        return SignConfig(hook="dense", **options)
    if name == "recipe":
        return TrainConfig(hook="sparse", hook_settings=dict(SPARSE, output="sign"), **options)
    if name == "recipe_int8":  # the README's recipe: 10% on the int8 wire
        return TrainConfig(hook="sparse", hook_settings=dict(SPARSE_INT8, output="sign"), **options)
    if name == "prepared_int8":  # the recipe as users run it: dense AdamW, prepare_optimizer
        return TrainConfig(hook="sparse", hook_settings=dict(SPARSE_INT8, output="sign"),
                           prepare_optimizer=True, **options)
    if name == "recipe_int8_userbetas":  # the same, AdamW left at its default betas
        return DefaultBetasConfig(hook="sparse", hook_settings=dict(SPARSE_INT8, output="sign"), **options)
    if name.startswith("frozen"):  # frozen<N>: N dense steps, then the sparse sum
        warmup = int(name[len("frozen"):])
        return FrozenConfig(hook="sparse", hook_settings=dict(SPARSE, warmup_steps=warmup),
                            freeze_step=warmup, **options)
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="dense,recipe")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    print("python " + " ".join(sys.argv), flush=True)
    for lr in (float(x) for x in args.lrs.split(",")):
        for name in args.cases.split(","):
            record = run_training(case(name, lr, args.ranks), timeout=3600)
            loss = record["epochs"]["test_loss"][-1]
            ratio = record["dense_bytes_per_step"] / record["bytes_per_step"]
            print(f"{name:>10} lr {lr:g} ranks {args.ranks}: val loss {loss:.3f} "
                  f"({ratio:.1f}x, {record['steps']} steps)"
                  + ("" if math.isfinite(loss) else " diverged"), flush=True)


if __name__ == "__main__":
    main()
