"""hetero_comm inside PyTorch Lightning, on CPU processes (on GPUs: accelerator="gpu"):

    python examples/lightning_example.py

Lightning starts the second process itself. The callback registers the hook (Lightning's
own ``ddp_comm_hook`` option does so on CUDA only) and keeps its state in the checkpoint.
"""

import os
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
from hetero_comm.integrations.lightning import HeteroCommCallback


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))

    def training_step(self, batch, batch_index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(epochs, ckpt_path=None):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 64, generator=generator), torch.randn(512, 8, generator=generator))
    state = SegmentSparseState(density=0.01)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                         callbacks=[HeteroCommCallback(state, segment_sparse_hook)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=16), ckpt_path=ckpt_path)
    return trainer, state


if __name__ == "__main__":
    path = os.path.join(tempfile.gettempdir(), "hetero_comm_lightning_example.ckpt")
    trainer, state = fit(1)
    trainer.save_checkpoint(path)  # on every rank: the hook state is gathered to rank 0
    trainer, state = fit(2, ckpt_path=path)  # resumes the hook state too
    if trainer.is_global_zero:
        stats = state.stats()
        print(f"steps {stats['steps']}, compression {stats['compression_ratio']:.1f}x")
