"""The AdamW recipe at a constant rate: does scaling each coordinate's sign step by how
consistent its recent signs were (as Adam's m / sqrt(v) shrinks where the gradient is noise)
close the gap to dense? Digits MLP, AdamW at a constant rate, 2 gloo ranks.

Variants: ``dense``; ``recipe`` (``hetero_comm.compress``); ``gate`` (the recipe's state built
by hand, its hook's delivered signs passed through a per-coordinate gate that moves a
coordinate on a share ``|EMA(sign)|`` of the steps, deterministically, so AdamW with betas
(0, 0) still sees only signs and zeros).

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/sign_consistency.py [--lrs 3e-3]
       [--seeds 0,1,2] [--steps 200] [--variants dense,recipe,gate] [--beta 0.9]
"""

import argparse
import statistics
import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm
from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
from hetero_comm.recipes import recipe_for
from lab.data import make_workload
from lab.launch import run_ranks


class SignGate:
    """Per bucket: an EMA of the handed signs and an accumulator that lets a coordinate move
    on a share ``|EMA|`` of the steps."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.buffers = {}
        self.steps = {}
        self.zero_share = []

    def __call__(self, state, bucket):
        future = segment_sparse_hook(state, bucket)
        key = (bucket.index(), bucket.buffer().numel())

        def gate(done):
            signs = done.value()
            if isinstance(signs, list):
                signs = signs[0]
            if key not in self.buffers:
                self.buffers[key] = (torch.zeros_like(signs), torch.zeros_like(signs))
            average, credit = self.buffers[key]
            self.steps[key] = self.steps.get(key, 0) + 1
            average.mul_(self.beta).add_(signs, alpha=1 - self.beta)
            credit.add_(average.abs(), alpha=1.0 / (1 - self.beta ** self.steps[key]))
            move = credit >= 1.0
            credit.sub_(move.to(credit.dtype))
            self.zero_share.append(float((signs == 0).float().mean()))
            return signs * move

        return future.then(gate)


def train(rank, world_size, variant, lr, seed, steps, beta, model_name, hidden):
    torch.manual_seed(seed)
    x, y, x_test, y_test, model = make_workload(model_name, hidden, seed)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.01)
    gate = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "recipe":
            hetero_comm.compress(ddp, optimizer)
        elif variant == "gate":
            state = SegmentSparseState(process_group=ddp.process_group,
                                       **recipe_for(optimizer).settings)
            gate = SignGate(beta)
            ddp.register_comm_hook(state, lambda state, bucket: gate(state, bucket))
            state.prepare_optimizer(optimizer)
    generator = torch.Generator().manual_seed(seed * 1000)
    batch = 32
    order = torch.randperm(len(x), generator=generator)
    position = 0
    for step in range(steps):
        if position + batch * world_size > len(x):
            order, position = torch.randperm(len(x), generator=generator), 0
        index = order[position + rank * batch: position + (rank + 1) * batch]
        position += batch * world_size
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x[index]), y[index])
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        logits = model(x_test)
        test_loss = float(nn.functional.cross_entropy(logits, y_test))
        accuracy = float((logits.argmax(-1) == y_test).float().mean())
    zero = statistics.mean(gate.zero_share) if gate and gate.zero_share else None
    return dict(test_loss=test_loss, accuracy=accuracy, zero_share=zero)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="3e-3,1e-3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default="dense,recipe,gate")
    parser.add_argument("--beta", type=float, default=0.9)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    for lr in map(float, args.lrs.split(",")):
        for variant in args.variants.split(","):
            results = [run_ranks(args.ranks, train, variant, lr, seed, args.steps, args.beta,
                                 args.model, args.hidden)[0]
                       for seed in map(int, args.seeds.split(","))]
            losses = [r["test_loss"] for r in results]
            accuracies = [100 * r["accuracy"] for r in results]
            print(f"{args.model} lr {lr:g} {variant:8s} test loss "
                  f"{' / '.join(f'{v:.3f}' for v in losses)} (mean {statistics.mean(losses):.3f})"
                  f"  acc {' / '.join(f'{v:.1f}' for v in accuracies)}"
                  + (f"  zero share {results[0]['zero_share']:.2f}" if results[0]['zero_share'] is not None else ""),
                  flush=True)


if __name__ == "__main__":
    main()
