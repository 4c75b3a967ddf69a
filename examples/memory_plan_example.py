"""Train a model in less activation memory with the memory planner:

    python examples/memory_plan_example.py                      # 0.75 of the step's peak, on the CPU
    python examples/memory_plan_example.py --budget-share 0.7 --device cuda

Profiles each block of a small residual CNN (with BatchNorm), asks for a plan under a share of
the unplanned step's predicted peak, lets ``tune_memory_plan`` run the best few plans in turns on
a copy of the model, then trains with the chosen plan and prints the measured peak and step time
against the unplanned step, and whether the trained weights equal the unplanned run's bit for bit.
"""

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from hetero_comm.memory import MemoryMeter, apply_memory_plan, predict, profile_memory, tune_memory_plan


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def make_model(width: int) -> nn.Sequential:
    """Blocks that chain (one tensor in, one out): what the planner swaps or recomputes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()),
                         Residual(width), Residual(width), nn.MaxPool2d(2), Residual(width), Residual(width),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)))


def train(model, images, labels, steps, meter):
    """``steps`` SGD steps; the median peak above each step's start and the median seconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    peaks, seconds = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        meter.reset()
        start = time.perf_counter()
        F.cross_entropy(model(images), labels).backward()
        if images.device.type == "cuda":
            torch.cuda.synchronize(images.device)
        seconds.append(time.perf_counter() - start)
        peaks.append(meter.added_peak_bytes())
        optimizer.step()
    return sorted(peaks)[len(peaks) // 2], sorted(seconds)[len(seconds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-share", type=float, default=0.75,
                        help="the budget as a share of the unplanned step's predicted peak")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
    model = make_model(args.width).to(device)

    profile = profile_memory(model, images)  # leaves weights, statistics and gradients as they were
    unplanned_peak, _ = predict(profile, ("keep",) * profile.num_blocks)
    budget = args.budget_share * unplanned_peak

    trial_model = copy.deepcopy(model)  # tuning trains what it runs: tune a copy
    trial_optimizer = torch.optim.SGD(trial_model.parameters(), lr=0.05)

    def step():
        trial_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(trial_model(images), labels).backward()
        trial_optimizer.step()

    tuned = tune_memory_plan(trial_model, profile, budget, step, candidates=2, steps=2)
    print(tuned.format())

    meter = MemoryMeter(device)
    plain = copy.deepcopy(model)
    plain_peak, plain_s = train(plain, images, labels, args.steps, meter)
    with apply_memory_plan(model, tuned.plan):
        peak, seconds = train(model, images, labels, args.steps, meter)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    print(f"unplanned: peak {plain_peak / 2**20:.1f} MiB, step {plain_s * 1e3:.1f} ms")
    print(f"planned:   peak {peak / 2**20:.1f} MiB ({peak / plain_peak:.2f}x), "
          f"step {seconds * 1e3:.1f} ms ({seconds / plain_s:.2f}x)")
    print(f"weights and BatchNorm statistics equal to the unplanned run's: {same}")


if __name__ == "__main__":
    main()
