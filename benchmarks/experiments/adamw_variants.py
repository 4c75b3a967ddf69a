"""Issue 17 experiments (not part of the package): two ways to make AdamW survive a sparse
gradient exchange, on the transformer workload of bench_convergence.py (gpt_adamw, 2 ranks,
the same data order, warm-up and cosine schedule, clipping 1.0). Prints the validation loss
after each epoch.

* ``update_ef DENSITY``: every rank runs AdamW on its OWN gradient, and the parameter update
  (not the gradient) goes through error feedback and the agreed top-k segment selection; no
  DDP gradient exchange at all.
* ``frozen_v DENSITY WARMUP``: AdamW whose second moment stops updating after WARMUP steps
  (then the step is linear in the gradient, as in 1-bit Adam), with segment_sparse_hook
  sending dense for the same WARMUP steps and compressed after them. DENSITY 1.0 measures
  what freezing alone costs.

Usage: python benchmarks/experiments/adamw_variants.py update_ef 0.01
       python benchmarks/experiments/adamw_variants.py frozen_v 0.03 100
"""

import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm import ops
from hetero_comm.hetero import HeteroSampler
from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
from lab.data import make_workload
from lab.launch import run_ranks
from lab.training import TrainConfig

LR, SEGMENT = 3e-3, 256


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose second moment is frozen after ``freeze_after`` steps."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, freeze_after=100):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.freeze_after, self.steps = freeze_after, 0

    @torch.no_grad()
    def step(self):
        self.steps += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(m=torch.zeros_like(p), v=torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if self.steps <= self.freeze_after:
                    state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                v_hat = state["v"] / (1 - beta2 ** min(self.steps, self.freeze_after))
                m_hat = state["m"] / (1 - beta1 ** self.steps)
                p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])


def update_ef_step(params, optimizer, residual, k, world):
    """Local AdamW step, then the shared parameters move by the agreed top-k of the residual."""
    before = torch.cat([p.detach().reshape(-1) for p in params])
    optimizer.step()
    delta = (torch.cat([p.detach().reshape(-1) for p in params]) - before) / world
    importance = ops.segment_accumulate_(residual, delta, SEGMENT)
    dist.all_reduce(importance)
    indices = ops.select_segments(importance, k)
    packed = ops.pack_segments_(residual, indices, SEGMENT)
    dist.all_reduce(packed)
    shared = before + ops.unpack_segments(packed, indices, SEGMENT, before.numel())
    with torch.no_grad():
        for p, value in zip(params, shared.split([p.numel() for p in params])):
            p.copy_(value.view_as(p))
    return 4 * (importance.numel() + packed.numel())


def worker(rank, world, mode, density, warmup, epochs=4):
    config = TrainConfig(model="gpt", hidden=128, optimizer="adamw", lr=LR, weight_decay=0.01,
                         lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=epochs,
                         global_batch=16 * world, workers=world)
    torch.manual_seed(0)
    x_train, y_train, x_val, y_val, model = make_workload("gpt", 128, 0)
    params = list(model.parameters())
    sampler = HeteroSampler(len(x_train), config.global_batch, rank, world, seed=0, drop_last=True)
    total = epochs * sampler.num_steps()
    if mode == "update_ef":
        forward, (optimizer, schedule) = model, config.make_optimizer(params, total)
        residual = torch.zeros(sum(p.numel() for p in params))
        k = max(1, math.ceil(density * ops.num_segments(residual.numel(), SEGMENT)))
    else:
        forward = DistributedDataParallel(model)
        forward.register_comm_hook(SegmentSparseState(density=density, warmup_steps=warmup), segment_sparse_hook)
        optimizer = FrozenVarianceAdamW(params, lr=LR, freeze_after=warmup)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor(total))
    losses, sent = [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for index in sampler:
            optimizer.zero_grad()
            nn.functional.cross_entropy(forward(x_train[index]).flatten(0, -2), y_train[index].flatten()).backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            if mode == "update_ef":
                sent += update_ef_step(params, optimizer, residual, k, world)
            else:
                optimizer.step()
            schedule.step()
        with torch.no_grad():
            losses.append(float(nn.functional.cross_entropy(model(x_val).flatten(0, -2), y_val.flatten())))
    return losses


if __name__ == "__main__":
    mode, density = sys.argv[1], float(sys.argv[2])
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    losses = run_ranks(2, worker, mode, density, warmup, timeout=7200)[0]
    print(f"{mode} density {density} warm-up {warmup}: val loss per epoch {['%.3f' % l for l in losses]}")
