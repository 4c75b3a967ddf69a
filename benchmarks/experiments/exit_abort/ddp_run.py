"""One of the exit-abort experiments (docs/design/hooks.md): 20 DDP steps on 2 gloo ranks under
torchrun, then a normal interpreter exit. FRAMEWORK=torch|accelerate; HC=1 registers
segment_sparse_hook (HC=0: hetero_comm is not imported); DESTROY=1 tears the process group
down first (destroy_process_group, or Accelerate's end_training)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn

accelerate = os.environ.get("FRAMEWORK", "torch") == "accelerate"
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
if accelerate:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
else:
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if os.environ.get("HC") == "1":
    from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
    model.register_comm_hook(SegmentSparseState(density=0.01), segment_sparse_hook)
for step in range(20):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss) if accelerate else loss.backward()
    optimizer.step()
if os.environ.get("DESTROY") == "1":
    accelerator.end_training() if accelerate else dist.destroy_process_group()
