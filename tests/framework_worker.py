"""One rank of the framework tests, started by torchrun (tests/test_integrations.py):

    python -m torch.distributed.run --nproc_per_node 2 tests/framework_worker.py FRAMEWORK HOOK OUT

For FRAMEWORK in ``lightning`` / ``accelerate`` and HOOK a key of ``CASES`` (``dct_sign*``: the
sparse hook's AdamW recipe, in bfloat16 or on the int8 wire; ``sparse_mc``: its SGD recipe,
momentum correction; the others with SGD) or of ``ONE_CALL`` (the framework's one call): an uninterrupted run, the same run stopped
half-way, saved through the framework's own checkpoint and resumed in fresh objects, and a run
with gradient accumulation. These runs keep the dense optimizer (AdamW's default betas, SGD's
momentum, the dense rate) and let the hook state prepare it (``prepare_optimizers=True``, or
``state.prepare_optimizer``); for the recipes a ``by_hand`` run sets the recipe's optimizer
itself. Each rank writes what it ended with to ``OUT/rank<r>.pt``.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from hetero_comm.hooks import DCT
from hetero_comm.hooks.segment_sparse import momentum_correction_lr_scale
from lab.registry import HOOKS

CASES = {"sparse": ("sparse", dict(density=0.05, segment_size=16, warmup_steps=2)),
         "dct": ("dct", dict(block_size=16, keep_ratio=0.25, bits=8, warmup_steps=2)),
         "dct_sign": ("sparse", dict(density=0.05, segment_size=4, basis=DCT(8),
                                     wire_dtype="bfloat16", output="sign", warmup_steps=2)),
         "dct_sign_int8": ("sparse", dict(density=0.1, segment_size=4, basis=DCT(8),
                                          wire_dtype="int8", output="sign", warmup_steps=2)),
         "sparse_mc": ("sparse", dict(density=0.05, segment_size=16, momentum=0.9, warmup_steps=2))}
# The one call (hetero_comm.compress; Lightning's CompressCallback, Accelerate's compress),
# and its recipes written out as docs/recipes.md gives them: what its by_hand runs set up.
ONE_CALL = {"compress_adamw": dict(density=0.10, segment_size=512, wire_dtype="int8",
                                   basis="dct", output="sign", density_warmup_steps=25),
            "compress_sgd": dict(density=0.08, segment_size=512, wire_dtype="int8", momentum=0.9,
                                 min_segments_per_bucket=150, density_warmup_steps=25,
                                 large_gradient_density=0.16)}
RECIPES = ("dct_sign", "dct_sign_int8", "sparse_mc", *ONE_CALL)


def make_hook_state(case):
    hook, settings = ("sparse", ONE_CALL[case]) if case in ONE_CALL else CASES[case]
    spec = HOOKS[hook]
    return spec.make_state(settings), spec.hook


def make_optimizer(parameters, case, by_hand=False):
    """The dense optimizer, or (``by_hand``) the recipe (docs/recipes.md) for the case's hook written
    out: what ``prepare_optimizer`` must turn the dense one into."""
    if case.startswith("dct_sign") or case == "compress_adamw":
        if by_hand:
            return torch.optim.AdamW(parameters, lr=1.5e-3, betas=(0.0, 0.0), weight_decay=0.01 / 1.5)
        return torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.01)
    if by_hand and case in ("sparse_mc", "compress_sgd"):
        density = 0.08 if case == "compress_sgd" else 0.05
        return torch.optim.SGD(parameters, lr=0.05 * momentum_correction_lr_scale(density, 0.9),
                               momentum=0.0)
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
SAMPLES, BATCH = 256, 8  # per rank: 16 steps an epoch


def make_data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, 20, generator=generator), torch.randn(SAMPLES, 5, generator=generator)


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5))


def flat_parameters(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def summary(state, module) -> dict:
    stats = state.stats()
    return {"params": flat_parameters(module), "steps": stats["steps"],
            "bytes_sent": stats["bytes_sent"], "bytes_dense": stats["bytes_dense"]}


# ------------------------------------------------------------------------------ Lightning
def lightning_fit(hook, epochs, ckpt_path=None, save_to=None, accumulate=1, optimizer_of=None,
                  by_hand=False):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hetero_comm.integrations.lightning import CompressCallback, HeteroCommCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_index):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), optimizer_of or hook, by_hand)

    if hook in ONE_CALL and not by_hand:
        callback = CompressCallback()
    else:
        state, hook_function = make_hook_state(hook)
        callback = HeteroCommCallback(state, hook_function,
                                      prepare_optimizers=not (by_hand or optimizer_of))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                         accumulate_grad_batches=accumulate, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    module = Module()
    with warnings.catch_warnings(record=True) as caught:  # the callback's check_optimizer
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(*make_data()), batch_size=BATCH), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    groups = trainer.optimizers[0].param_groups
    return dict(summary(callback.state, module.net), learning_rate=groups[0]["lr"], optimizer_warnings=[
        str(w.message) for w in caught if "SegmentSparseState(" in str(w.message)])


def run_lightning(hook, directory):
    path = os.path.join(directory, "lightning.ckpt")
    lightning_fit(hook, 1, save_to=path)
    runs = {"uninterrupted": lightning_fit(hook, 2),
            "resumed": lightning_fit(hook, 2, ckpt_path=path),
            "accumulated": lightning_fit(hook, 1, accumulate=2)}
    if hook in RECIPES:
        runs["by_hand"] = lightning_fit(hook, 2, by_hand=True)
    if hook in RECIPES and hook not in ONE_CALL:  # unprepared, SGD with momentum 0.9: the callback must warn
        runs["mismatched"] = lightning_fit(hook, 1, optimizer_of="sparse")
    return runs


# ----------------------------------------------------------------------------- Accelerate
def accelerate_run(hook, steps, save_at=None, load_from=None, accumulate=1, directory=None,
                   by_hand=False):
    from accelerate import Accelerator

    from hetero_comm.integrations.accelerate import compress, register_comm_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    net = make_net()
    optimizer = make_optimizer(net.parameters(), hook, by_hand)
    model, optimizer = accelerator.prepare(net, optimizer)
    if hook in ONE_CALL and not by_hand:
        state = compress(accelerator, model, optimizer)
    else:
        state, hook_function = make_hook_state(hook)
        register_comm_hook(accelerator, model, state, hook_function)
        if not by_hand:
            state.prepare_optimizer(optimizer)  # Accelerate's wrapper: the optimizer inside is fitted
    first = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        first = save_at
    x, y = make_data()
    rank = accelerator.process_index
    for step in range(first, steps):
        index = torch.arange(BATCH) + (step * 2 + rank) * BATCH % SAMPLES
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x[index]), y[index]))
            optimizer.step()
            optimizer.zero_grad()
        if step + 1 == save_at and load_from is None:
            accelerator.save_state(directory)
            accelerator.wait_for_everyone()
            return None
    return summary(state, net)


def run_accelerate(hook, directory):
    saved = os.path.join(directory, "accelerate_state")
    accelerate_run(hook, 16, save_at=9, directory=saved)
    return {"uninterrupted": accelerate_run(hook, 16),
            "resumed": accelerate_run(hook, 16, save_at=9, load_from=saved),
            "accumulated": accelerate_run(hook, 16, accumulate=2),
            **({"by_hand": accelerate_run(hook, 16, by_hand=True)} if hook in RECIPES else {})}


def main():
    framework, hook, out = sys.argv[1:4]  # OUT also holds the checkpoints (every rank sees it)
    result = {"lightning": run_lightning, "accelerate": run_accelerate}[framework](hook, out)
    torch.save(result, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    # torch 2.13's gloo DDP processes abort at interpreter exit in some runs ("terminate called
    # without an active exception"), with or without hetero_comm (docs/design/hooks.md): leave
    # without the interpreter's teardown once the results are written.
    sys.stdout.flush()
    os._exit(0)
