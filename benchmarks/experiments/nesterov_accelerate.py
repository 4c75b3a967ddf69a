"""The SGD recipe with plain and Nesterov momentum inside Accelerate (``hetero_comm.integrations.accelerate.compress``), 2 gloo ranks, 40 steps of a small regression (MLP 32 -> 256 -> 4 fitting a random linear map, 64 rows per rank), dense against the recipe at lr 0.01 and 0.05: the loss at the first and last step and whether the ranks end identical. Results: ``benchmarks/results/nesterov_accelerate.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/nesterov_accelerate.py
"""
import torch, torch.nn as nn, warnings
from lab.launch import run_ranks

def worker(rank, world_size, nesterov, compressed, lr):
    from accelerate import Accelerator
    from hetero_comm.integrations.accelerate import compress
    import os; os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=nesterov)
    model, opt = acc.prepare(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = compress(acc, model, opt) if compressed else None
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(9))
    losses = []
    for step in range(40):
        x = torch.randn(64, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad(); acc.backward(loss); opt.step(); losses.append(float(loss))
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    return (state.nesterov if state else None), inner.param_groups[0]["nesterov"], inner.param_groups[0]["momentum"], losses[0], losses[-1], torch.cat([p.detach().flatten() for p in model.parameters()])

if __name__ == "__main__":
    for lr in (0.01, 0.05):
        for nesterov in (False, True):
            for compressed in (False, True):
                r = run_ranks(2, worker, nesterov, compressed, lr, timeout=300)
                print(f"lr {lr} nesterov {nesterov} compressed {compressed}: loss {r[0][3]:.2f} -> {r[0][4]:.3f}, ranks equal {bool(torch.equal(r[0][5], r[1][5]))}", flush=True)
