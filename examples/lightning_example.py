"""hetero_comm inside PyTorch Lightning, on CPU processes (on GPUs: accelerator="gpu"):

    python examples/lightning_example.py --optimizer adamw
    python examples/lightning_example.py --optimizer sgd

Lightning starts the second process itself. ``CompressCallback`` runs ``hetero_comm.compress``
on the DDP model and the optimizer of ``configure_optimizers`` (set up as for dense training)
and keeps the hook state in Lightning's checkpoints: the second fit resumes from the first.
"""

import argparse
import os
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from hetero_comm.integrations.lightning import CompressCallback


class Regression(pl.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer_name = optimizer
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(optimizer, epochs, ckpt_path=None):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=generator)
    data = TensorDataset(x, x @ torch.randn(64, 8, generator=generator) / 8)  # unit-variance targets
    callback = CompressCallback()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(optimizer), DataLoader(data, batch_size=16), ckpt_path=ckpt_path)
    return trainer, callback.state


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    path = os.path.join(tempfile.gettempdir(), "hetero_comm_lightning_example.ckpt")
    trainer, state = fit(args.optimizer, args.epochs // 2)
    trainer.save_checkpoint(path)  # on every rank: the hook state is gathered to rank 0
    trainer, state = fit(args.optimizer, args.epochs, ckpt_path=path)  # resumes the hook state too
    if trainer.is_global_zero:
        stats = state.stats()
        print(f"{args.optimizer}: last training loss {trainer.callback_metrics['train_loss']:.3f}")
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")
