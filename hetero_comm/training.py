"""Small, real multi-process training runs: the demo, the hook benchmark and the convergence
tests all use these.

The data is scikit-learn's digits (1,797 8x8 images, 10 classes; it ships with the package,
nothing is downloaded). Workers are local processes talking gloo over 127.0.0.1 on a free
port; each takes its share of every global batch (:class:`~hetero_comm.hetero.HeteroSampler`:
equal shares, or shares re-planned from measured speed by
:class:`~hetero_comm.hetero.DynamicBatchController`). One worker can be made slower for real
with a cgroup CPU quota (:class:`~hetero_comm.hetero.CpuQuota`, root only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .hetero import CpuQuota, DynamicBatchController, HeteroSampler
from .hooks import (AllreduceState, DCTQuantState, SegmentSparseState, allreduce_hook,
                    dct_quant_hook, segment_sparse_hook)

__all__ = ["TrainConfig", "HOOKS", "run_training", "train_rank", "make_hook", "free_port",
           "load_digits_split", "make_model", "count_collective_bytes"]

HOOKS = ("dense", "sparse", "dct", "fp16", "powersgd")
WEIGHTED_HOOKS = ("dense", "sparse", "dct")  # hetero_comm's: they take a rank_weight
BATCHING = ("equal", "dynamic")
MODELS = ("mlp", "cnn", "cnn_wide")


@dataclasses.dataclass
class TrainConfig:
    """One training run. Hook names: ``dense`` (weighted allreduce), ``sparse``
    (:func:`~hetero_comm.hooks.segment_sparse_hook`), ``dct``
    (:func:`~hetero_comm.hooks.dct_quant_hook`), ``fp16`` and ``powersgd`` (PyTorch's own).

    ``batching="dynamic"`` re-plans the per-rank batch sizes from measured speed every epoch
    (and every ``replan_every`` steps if set, with ``smoothing`` and ``max_change`` as in
    :class:`~hetero_comm.hetero.DynamicBatchController`); ``"equal"`` keeps equal shares.
    ``slow_worker_cores`` puts the last worker under a CPU quota of that many cores (root and
    cgroup v1 only); every rank's speed is then measured with equal shares too (hetero_comm's
    hooks only)."""

    hook: str = "dense"
    workers: int = 2
    epochs: int = 8
    global_batch: int = 64
    lr: float = 0.02
    momentum: float = 0.9
    seed: int = 0
    hidden: int = 256
    model: str = "mlp"  # see make_model
    max_steps: Optional[int] = None  # stop after this many steps (step timing)
    # DDP's bucket cap; given explicitly it also caps the first bucket (else 1 MB)
    bucket_cap_mb: Optional[float] = None
    # segment_sparse_hook
    density: float = 0.01
    segment_size: int = 256
    selection: str = "current"
    hook_momentum: float = 0.0  # > 0: momentum correction in the hook, optimizer momentum off
    density_warmup_steps: int = 0
    # dct_quant_hook
    block_size: int = 256
    keep_ratio: float = 0.125
    bits: int = 8
    band: str = "cycling"
    # powerSGD_hook
    powersgd_rank: int = 1
    warmup_steps: int = 1
    # heterogeneous ranks
    batching: str = "equal"
    replan_every: Optional[int] = None
    smoothing: float = 1.0
    max_change: Optional[float] = None
    slow_worker_cores: Optional[float] = None
    slow_worker_period_us: int = 5000  # the quota's accounting period, see CpuQuota

    def validate(self) -> None:
        if self.hook not in HOOKS:
            raise ValueError(f"hook must be one of {HOOKS}; got {self.hook!r}")
        for name in ("workers", "epochs", "global_batch", "hidden", "powersgd_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.slow_worker_cores is not None and not self.slow_worker_cores > 0:
            raise ValueError(f"slow_worker_cores must be None or > 0; got {self.slow_worker_cores}")
        if self.global_batch % self.workers:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of "
                             f"workers ({self.workers})")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}; got {self.model!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be None or >= 1; got {self.max_steps}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}; got {self.batching!r}")
        if self.batching == "dynamic" and self.hook not in WEIGHTED_HOOKS:
            raise ValueError(f"batching='dynamic' needs a hook that weights ranks "
                             f"({', '.join(WEIGHTED_HOOKS)}); {self.hook!r} averages equally")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_digits_split(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits: 1,437 training and 360 test images (a fixed shuffled split)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = len(x) - 360
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return x[:split], y[:split], x[split:], y[split:]


def make_model(hidden: int = 256, kind: str = "mlp") -> nn.Module:
    """``"mlp"`` (the default model): 64 -> hidden -> hidden -> 10. ``"cnn"``: three 3x3
    convolutions (``hidden // 8``, ``hidden // 4``, ``hidden // 4`` channels) over the 8x8 image
    and a linear classifier; many more operations per parameter, so its steps are bound by
    compute, not by the gradient exchange. ``"cnn_wide"``: two 3x3 convolutions (32, 64
    channels) and a fully connected layer of ``hidden`` units (4.2M parameters at 1024, nearly
    all in that layer), for slow links, where its steps are bound by the gradient exchange."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, 10))
    if kind == "cnn_wide":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(64 * 64, hidden), nn.ReLU(),
                             nn.Linear(hidden, 10))
    if kind == "cnn":
        c1, c2 = max(1, hidden // 8), max(1, hidden // 4)
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c2, c2, 3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(c2 * 64, 10))
    raise ValueError(f"kind must be one of {MODELS}; got {kind!r}")


@contextlib.contextmanager
def count_collective_bytes(totals: Dict[str, int]):
    """Add the bytes this rank hands to ``dist.all_reduce`` / ``all_gather`` (any hook, ours
    or PyTorch's) to ``totals["bytes"]`` while active."""
    original_allreduce, original_allgather = dist.all_reduce, dist.all_gather

    def all_reduce(tensor, *args, **kwargs):
        totals["bytes"] += tensor.numel() * tensor.element_size()
        return original_allreduce(tensor, *args, **kwargs)

    def all_gather(tensor_list, tensor, *args, **kwargs):
        totals["bytes"] += tensor.numel() * tensor.element_size()
        return original_allgather(tensor_list, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    try:
        yield totals
    finally:
        dist.all_reduce, dist.all_gather = original_allreduce, original_allgather


def make_hook(config: TrainConfig):
    """(state, hook, optimizer momentum) for ``config.hook``."""
    if config.hook == "dense":
        return AllreduceState(), allreduce_hook, config.momentum
    if config.hook == "sparse":
        state = SegmentSparseState(density=config.density, segment_size=config.segment_size,
                                   selection=config.selection, momentum=config.hook_momentum,
                                   density_warmup_steps=config.density_warmup_steps,
                                   warmup_steps=config.warmup_steps)
        # Momentum correction replaces the optimizer's momentum.
        return state, segment_sparse_hook, (0.0 if config.hook_momentum else config.momentum)
    if config.hook == "dct":
        state = DCTQuantState(block_size=config.block_size, keep_ratio=config.keep_ratio,
                              bits=config.bits, band=config.band, warmup_steps=config.warmup_steps)
        return state, dct_quant_hook, config.momentum
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if config.hook == "fp16":
        return None, default_hooks.fp16_compress_hook, config.momentum
    state = powerSGD_hook.PowerSGDState(process_group=None,
                                        matrix_approximation_rank=config.powersgd_rank,
                                        start_powerSGD_iter=max(2, config.warmup_steps),
                                        random_seed=config.seed)
    return state, powerSGD_hook.powerSGD_hook, config.momentum


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        return (float(nn.functional.cross_entropy(logits, y)),
                float((logits.argmax(1) == y).float().mean()))


def train_rank(rank: int, config: TrainConfig, progress: Optional["mp.Queue"] = None) -> dict:
    """One rank of a run in this process, whose gloo group is already initialised: train, then
    check that every rank ended with bitwise identical parameters. Returns this rank's record
    (see :func:`run_training`; rank 0's is the one reported)."""
    config.validate()
    record = _train(rank, config, progress)
    flat = torch.cat([p.detach().reshape(-1) for p in record.pop("model").parameters()])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    same = torch.tensor([int(torch.equal(flat, reference))])
    dist.all_reduce(same)
    record["ranks_identical"] = int(same) == config.workers
    record["final_parameters"] = flat.numpy()  # numpy: pickled by value, not shared memory
    return record


def train_worker(rank: int, config: TrainConfig, port: int, results: "mp.Queue",
                 progress: Optional["mp.Queue"] = None) -> None:
    """One rank of a local run; rank 0 puts its record (see :func:`run_training`) on
    ``results``."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=config.workers)
    try:
        record = train_rank(rank, config, progress)
        if rank == 0:
            results.put(record)
    except BaseException as error:
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        raise
    finally:
        dist.destroy_process_group()


def _train(rank: int, config: TrainConfig, progress) -> dict:
    x_train, y_train, x_test, y_test = load_digits_split(config.seed)
    torch.manual_seed(config.seed)
    model = make_model(config.hidden, config.model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.bucket_cap_mb)
    state, hook, optimizer_momentum = make_hook(config)
    # Full global batches only, each shuffled once per epoch with a seed every rank shares.
    sampler = HeteroSampler(len(x_train), config.global_batch, rank, config.workers,
                            seed=config.seed * 1000, drop_last=True)
    controller = None
    if config.batching == "dynamic" or (config.slow_worker_cores and config.hook in WEIGHTED_HOOKS):
        controller = DynamicBatchController(sampler, state, replan_every=config.replan_every,
                                            smoothing=config.smoothing,
                                            max_change=config.max_change,
                                            adapt=config.batching == "dynamic")
        controller.register_comm_hook(ddp, hook)
    else:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=optimizer_momentum)
    history: Dict[str, List[float]] = {"step": [], "loss": [], "bytes": [], "seconds": []}
    epochs: Dict[str, list] = {"epoch": [], "step": [], "test_accuracy": [], "test_loss": [],
                               "bytes": [], "seconds": [], "batch_sizes": []}
    bytes_sent = {"bytes": 0}
    step = 0
    with count_collective_bytes(bytes_sent):
        for epoch in range(config.epochs):
            if controller is not None:
                controller.set_epoch(epoch)
            else:
                sampler.set_epoch(epoch)
            batch_sizes = list(sampler.batch_sizes)
            epoch_began = time.perf_counter()
            for index in sampler:
                if config.max_steps is not None and step >= config.max_steps:
                    break
                began = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with controller.step(len(index)) if controller else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(ddp(x_train[index]), y_train[index])
                    loss.backward()
                optimizer.step()
                step += 1
                history["step"].append(step)
                history["loss"].append(loss.item())
                history["bytes"].append(bytes_sent["bytes"])
                history["seconds"].append(time.perf_counter() - began)
            epoch_seconds = time.perf_counter() - epoch_began
            test_loss, accuracy = _evaluate(model, x_test, y_test)
            for name, value in (("epoch", epoch + 1), ("step", step), ("test_accuracy", accuracy),
                                ("test_loss", test_loss), ("bytes", bytes_sent["bytes"]),
                                ("seconds", epoch_seconds), ("batch_sizes", batch_sizes)):
                epochs[name].append(value)
            if progress is not None and rank == 0:
                progress.put((epoch + 1, accuracy))
            if config.max_steps is not None and step >= config.max_steps:
                break
    if controller is not None:
        controller.replan()  # the last epoch's speeds, for the record
    hook_stats = state.stats() if hasattr(state, "stats") and callable(state.stats) else None
    dense_bytes_per_step = sum(p.numel() * 4 for p in model.parameters())
    return {"config": dataclasses.asdict(config), "history": history, "epochs": epochs,
            "final_accuracy": epochs["test_accuracy"][-1], "steps": step,
            "bytes_per_step": bytes_sent["bytes"] / step, "bytes_total": bytes_sent["bytes"],
            "dense_bytes_per_step": dense_bytes_per_step, "hook_stats": hook_stats,
            "speed_history": controller.history if controller is not None else None,
            "model": model}


def run_training(config: TrainConfig, on_epoch: Optional[Callable[[int, float], None]] = None,
                 timeout: float = 600.0) -> dict:
    """Train ``config.workers`` local processes and return rank 0's record.

    Returns:
        dict with ``final_accuracy``, ``epochs`` (per epoch: test accuracy/loss, bytes sent,
        training wall seconds, every rank's batch size at the epoch's start), ``history``
        (per-step loss, cumulative bytes this rank handed to collectives, step seconds),
        ``bytes_per_step``, ``dense_bytes_per_step``, ``hook_stats`` (for our hooks),
        ``speed_history`` (the :class:`~hetero_comm.hetero.DynamicBatchController`'s plans:
        every rank's samples, compute seconds and speed per window; ``None`` without one),
        ``ranks_identical`` (every rank ended with bitwise identical parameters) and
        ``final_parameters``. ``on_epoch(epoch, test_accuracy)`` is called after each epoch.
    """
    config.validate()
    with (CpuQuota(config.slow_worker_cores, config.slow_worker_period_us)
          if config.slow_worker_cores else contextlib.nullcontext()) as quota:
        record = _run_workers(config, on_epoch, timeout, quota)
    if "error" in record:
        raise RuntimeError(f"training worker {record['rank']} failed: {record['error']}")
    return record


def _run_workers(config: TrainConfig, on_epoch, timeout: float,
                 quota: Optional[CpuQuota]) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    progress = context.Queue() if on_epoch is not None else None
    port = free_port()
    processes = [context.Process(target=train_worker, args=(rank, config, port, results, progress),
                                 daemon=True) for rank in range(config.workers)]
    for process in processes:
        process.start()
    if quota is not None:
        quota.add(processes[-1].pid)  # the last worker is the slow one
        if config.workers <= len(os.sched_getaffinity(0)):
            # One core per worker, so that the quota is the only difference between them
            # (a quota shared across cores is handed out per core and strands when threads move).
            for process, core in zip(processes, sorted(os.sched_getaffinity(0))):
                os.sched_setaffinity(process.pid, {core})
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                record = results.get(timeout=0.2)
                break
            except queue.Empty:
                while progress is not None and not progress.empty():
                    on_epoch(*progress.get())
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a training worker exited with code {failed[0]} "
                                       f"before reporting (see its output above)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training did not finish within {timeout} s") from None
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    while progress is not None and not progress.empty():
        on_epoch(*progress.get())
    return record
