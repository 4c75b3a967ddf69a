"""``hetero_comm.compress`` where the DDP model is compiled, or trains in bfloat16: 30 steps of a
regression on 2 gloo ranks (an MLP with a LayerNorm, 140K parameters), AdamW and SGD (momentum
0.9). Per case: whether the ranks end bitwise equal, the first and last training losses and the
compression ratio. The DDP settings users turn on (bucket views, static graph, unused
parameters, frozen layers) are tested in tests/test_compress.py; these cases take longer
(``torch.compile``) or train otherwise, so they are checked here. Results:
``benchmarks/results/ddp_variants.txt``.

    * ``fp32``: the plain case, for reference;
    * ``compiled``: ``torch.compile(ddp_model)`` (DDP's default buckets: torch's DDP optimizer
      needs the first bucket no larger than the others);
    * ``bf16``: the model's parameters in bfloat16 (bfloat16 gradients);
    * ``autocast``: float32 parameters, the forward under ``torch.autocast("cpu", bfloat16)``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/ddp_variants.py [--cases fp32,compiled,bf16,autocast]
"""

import argparse
import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm
from lab.launch import run_ranks

STEPS = 30


def train(rank, world_size, case, optimizer_kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256),
                          nn.GELU(), nn.Linear(256, 8))
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    ddp = DistributedDataParallel(model.to(dtype))
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=3e-3) if optimizer_kind == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SGD recipe's note on a LayerNorm model
        state = hetero_comm.compress(ddp, optimizer)
    forward = torch.compile(ddp) if case == "compiled" else ddp
    losses = []
    for step in range(STEPS):
        rows = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=rows), torch.randn(16, 8, generator=rows)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
            out = forward(x.to(dtype))
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return flat, losses, state.stats()["compression_ratio"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="fp32,compiled,bf16,autocast")
    args = parser.parse_args()
    print(f"{'optimizer':<9} {'case':<9} {'ranks equal':>11} {'finite':>6} {'first loss':>10} "
          f"{'last loss':>9} {'ratio':>6}")
    for optimizer_kind in ("adamw", "sgd"):
        for case in args.cases.split(","):
            ranks = run_ranks(2, train, case, optimizer_kind, timeout=900)
            flat, losses, ratio = ranks[0]
            print(f"{optimizer_kind:<9} {case:<9} {str(torch.equal(flat, ranks[1][0])):>11} "
                  f"{str(bool(torch.isfinite(flat).all())):>6} {losses[0]:>10.3f} {losses[-1]:>9.3f} "
                  f"{ratio:>5.1f}x", flush=True)


if __name__ == "__main__":
    main()
