"""hetero_comm with Hugging Face Accelerate, on two CPU processes:

    torchrun --nproc_per_node 2 examples/accelerate_example.py --optimizer adamw
    torchrun --nproc_per_node 2 examples/accelerate_example.py --optimizer sgd

(``accelerate launch --cpu`` starts ONE process; ``accelerate launch --multi_gpu
--num_processes 2`` starts two, on GPUs or CPUs.) ``compress`` runs ``hetero_comm.compress``
on the prepared model and optimizer (set up as for dense training) and registers the hook
state with ``accelerator.save_state``.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
from accelerate import Accelerator

from hetero_comm.integrations.accelerate import compress


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = compress(accelerator, model, optimizer)
    target = torch.randn(64, 8, generator=torch.Generator().manual_seed(7)) / 8  # unit-variance targets
    rank = accelerator.process_index
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), x @ target)
        accelerator.backward(loss)
        optimizer.step()
        if step == args.steps // 2:  # a checkpoint, hook state included (save_state on every rank)
            accelerator.save_state(os.path.join(tempfile.gettempdir(), "hetero_comm_accelerate_example"))
    stats = state.stats()
    if accelerator.is_main_process:
        print(f"{args.optimizer}: last loss {loss.item():.3f}")
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")


if __name__ == "__main__":
    main()
