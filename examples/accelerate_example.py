"""hetero_comm with Hugging Face Accelerate, on two CPU processes:

    torchrun --nproc_per_node 2 examples/accelerate_example.py

(``accelerate launch --cpu`` starts ONE process; ``accelerate launch --multi_gpu
--num_processes 2`` starts two, on GPUs or CPUs.)
"""

import os
import tempfile

import torch
import torch.nn as nn
from accelerate import Accelerator

from hetero_comm.hooks import DCTQuantState, dct_quant_hook
from hetero_comm.integrations.accelerate import register_comm_hook


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = DCTQuantState(block_size=256, keep_ratio=0.125, bits=8)
    register_comm_hook(accelerator, model, state, dct_quant_hook)
    rank = accelerator.process_index
    for step in range(30):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if step == 19:  # a checkpoint, hook state included (call save_state on every rank)
            accelerator.save_state(os.path.join(tempfile.gettempdir(), "hetero_comm_accelerate_example"))
    stats = state.stats()
    if accelerator.is_main_process:
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")


if __name__ == "__main__":
    main()
