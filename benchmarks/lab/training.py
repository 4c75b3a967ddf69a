"""One training run on the digits data: its configuration, the loop of one rank, and
:func:`run_training`, which starts the local ranks (the demo, the benchmarks and the
convergence tests all use these).

Each rank takes its share of every global batch (:class:`~hetero_comm.hetero.HeteroSampler`:
equal shares, or shares re-planned from measured speed by
:class:`~hetero_comm.hetero.DynamicBatchController`). One worker can be made slower for real
with a cgroup CPU quota (:class:`~lab.throttle.CpuQuota`, root only).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hetero_comm._checks import check_choice, check_float, check_int, check_optional
from hetero_comm.hetero import DynamicBatchController, HeteroSampler
from hetero_comm.nn import convert_dropout
from hetero_comm.recipes import compress
from .byte_count import count_collective_bytes, link_bytes
from .data import MODELS, make_workload
from .launch import report_progress, run_ranks
from .registry import HOOKS, WEIGHTED_HOOKS, make_hook
from .throttle import PERIOD_US, CpuQuota

__all__ = ["TrainConfig", "BATCHING", "run_training", "train_rank"]

BATCHING = ("equal", "dynamic")
OPTIMIZERS = ("sgd", "adamw", "adam")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd", "step")
# "wsd" (warm-up, stable, decay): the rate stays until this share of the steps is left, then
# falls linearly to 0
WSD_DECAY_SHARE = 0.2
DROPOUT_KINDS = ("standard", "unit", "sliced")


@dataclasses.dataclass
class TrainConfig:
    """One training run of ``model`` (:data:`~lab.data.MODELS`: the digit models,
    or ``"gpt"`` on text, ``hidden`` its width) with ``hook`` (a name of
    :data:`~lab.registry.HOOKS`), whose state is built from ``hook_settings``
    (passed straight to its constructor, which validates them).

    ``optimizer``: ``"sgd"`` (with ``momentum``, Nesterov's with ``nesterov``), ``"adamw"``
    (:meth:`adam_betas`) or ``"adam"`` (torch's Adam, its weight decay decoupled), with
    ``weight_decay``; the learning rate rises linearly over ``lr_warmup_steps`` and then stays
    (``lr_schedule="constant"``), follows a cosine down towards 0 (``"cosine"``, which would
    reach 0 one step after the last), falls linearly towards 0 (``"linear"``), or stays until
    the last :data:`WSD_DECAY_SHARE` of the steps and falls linearly there (``"wsd"``), or
    falls tenfold at half and at three quarters of the steps after the warm-up (``"step"``);
    ``clip_norm`` clips the global gradient norm (after the hook) before each step.
    ``prepare_optimizer`` builds the optimizer as for dense training (AdamW's default betas,
    SGD with ``momentum``, at ``lr``) and hands it to the hook state's ``prepare_optimizer``,
    as a user keeping their dense settings would; without it the optimizer is built for the
    hook directly (:meth:`adam_betas`, :meth:`optimizer_momentum`) and takes ``lr`` as is.

    ``dropout`` > 0 puts dropout after each hidden layer of the MLP: ``dropout_kind``
    ``"standard"`` (``nn.Dropout``, a mask per sample), ``"unit"`` (whole units, the same on
    every rank, :func:`hetero_comm.nn.convert_dropout`) or ``"sliced"`` (the same, computed
    on the kept units only); ``skip_dropped`` makes the hook state send only what the kept
    units touch (``skip_dropped_units``; a unit dropout and a hetero_comm hook).

    ``batching="dynamic"`` re-plans the per-rank batch sizes from measured speed every epoch
    (and every ``replan_every`` steps if set, with ``smoothing`` and ``max_change`` as in
    :class:`~hetero_comm.hetero.DynamicBatchController`); ``"equal"`` keeps equal shares.
    ``slow_worker_cores`` puts the last worker under a CPU quota of that many cores (root and
    cgroup v1 only); every rank's speed is then measured with equal shares too (weighted
    hooks only). ``max_steps`` stops early (step timing); ``evaluate_every``: rank 0 also evaluates
    every that many steps (outside the timed training); ``progress_file``: rank 0 writes
    "<step> <total steps>" there after every step (a benchmark's parent process watches it,
    e.g. to change a link halfway); ``bucket_cap_mb``, given, is DDP's
    bucket cap and also caps its first bucket (else 1 MB)."""

    hook: str = "dense"
    hook_settings: dict = dataclasses.field(default_factory=dict)
    workers: int = 2
    epochs: int = 8
    global_batch: int = 64
    lr: float = 0.02
    momentum: float = 0.9
    nesterov: bool = False
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    clip_norm: Optional[float] = None
    prepare_optimizer: bool = False
    seed: int = 0
    hidden: int = 256
    dropout: float = 0.0
    dropout_kind: str = "standard"
    skip_dropped: bool = False
    model: str = "mlp"
    max_steps: Optional[int] = None
    evaluate_every: Optional[int] = None
    progress_file: Optional[str] = None
    bucket_cap_mb: Optional[float] = None
    batching: str = "equal"
    replan_every: Optional[int] = None
    smoothing: float = 1.0
    max_change: Optional[float] = None
    slow_worker_cores: Optional[float] = None
    slow_worker_period_us: int = PERIOD_US

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (the hook's settings included)."""
        make_hook(self.hook, self.hook_settings)
        for name in ("workers", "epochs", "global_batch", "hidden"):
            check_int(name, getattr(self, name), 1)
        check_float("lr", self.lr, 0.0, float("inf"), low_open=True)
        check_float("momentum", self.momentum, 0.0, 0.999)
        check_choice("model", self.model, MODELS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_float("weight_decay", self.weight_decay, 0.0, 1.0)
        check_int("lr_warmup_steps", self.lr_warmup_steps, 0)
        check_optional(check_float, "clip_norm", self.clip_norm, 0.0, float("inf"), low_open=True)
        check_choice("batching", self.batching, BATCHING)
        self._validate_dropout()
        check_optional(check_int, "max_steps", self.max_steps, 1)
        check_optional(check_int, "evaluate_every", self.evaluate_every, 1)
        check_optional(check_float, "slow_worker_cores", self.slow_worker_cores, 0.0,
                       float(os.cpu_count() or 1), low_open=True)
        if self.global_batch % self.workers:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of "
                             f"workers ({self.workers})")
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            raise ValueError("nesterov=True is SGD's, with momentum > 0")
        if (self.hook_settings.get("momentum") and not self.prepare_optimizer
                and bool(self.hook_settings.get("nesterov")) != self.nesterov):
            raise ValueError("the hook's momentum correction replaces SGD's momentum: give it "
                             f"nesterov={self.nesterov} as the optimizer has it")
        if self.optimizer != "sgd" and self.hook_settings.get("momentum"):
            raise ValueError("the sparse hook's momentum correction replaces SGD's momentum; "
                             f"with optimizer={self.optimizer!r} it would apply momentum twice")
        if self.optimizer == "sgd" and self.hook_settings.get("output") == "sign":
            raise ValueError("the sparse hook's output='sign' is a recipe for AdamW (with "
                             "betas=(0.0, 0.0)); SGD's learning rate is not one for sign "
                             "steps: use output='sum'")
        if self.optimizer == "sgd" and HOOKS[self.hook].hands_sign:
            raise ValueError(f"hook {self.hook!r} hands the optimizer a sign: use "
                             f"optimizer='adamw' (betas (0, 0) step by lr times it)")
        if self.prepare_optimizer and not HOOKS[self.hook].is_hetero_comm:
            raise ValueError(f"prepare_optimizer needs a hetero_comm hook; {self.hook!r} is torch's")
        if HOOKS[self.hook].one_call and (self.prepare_optimizer or self.skip_dropped):
            raise ValueError(f"hook {self.hook!r} prepares the optimizer itself and sends every "
                             f"unit: leave prepare_optimizer and skip_dropped False")
        if self.batching == "dynamic" and self.hook not in WEIGHTED_HOOKS:
            raise ValueError(f"batching='dynamic' needs a hook that weights ranks "
                             f"({', '.join(WEIGHTED_HOOKS)}); {self.hook!r} averages them "
                             f"equally: drop it")

    def _validate_dropout(self) -> None:
        check_float("dropout", self.dropout, 0.0, 1.0)
        check_choice("dropout_kind", self.dropout_kind, DROPOUT_KINDS)
        if self.dropout and self.model != "mlp":
            raise ValueError(f"dropout is for model='mlp'; got model={self.model!r}")
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {self.dropout!r}")
        if self.skip_dropped and not (self.dropout and self.dropout_kind != "standard"):
            raise ValueError("skip_dropped needs a unit dropout (dropout > 0 and dropout_kind "
                             "'unit' or 'sliced'): standard dropout drops per sample, and "
                             "nothing is zero on every rank")
        if self.skip_dropped and not HOOKS[self.hook].is_hetero_comm:
            raise ValueError(f"skip_dropped needs a hetero_comm hook; {self.hook!r} is torch's")

    def optimizer_momentum(self) -> float:
        """The SGD momentum: 0 when the sparse hook's momentum correction replaces it."""
        if self.prepare_optimizer:
            return self.momentum
        return 0.0 if self.hook_settings.get("momentum") else self.momentum

    def adam_betas(self) -> Tuple[float, float]:
        """AdamW's betas: ``(0.0, 0.0)`` with the sparse hook's ``output="sign"`` or a hook that
        hands a sign (DeMo's baseline; AdamW then
        steps by ``lr`` times the sign it is given, with its decoupled weight decay: error
        feedback already accumulates the gradient as a momentum would); else
        ``(0.9, 0.999)``."""
        if self.prepare_optimizer:
            return (0.9, 0.999)
        signs = self.hook_settings.get("output") == "sign" or HOOKS[self.hook].hands_sign
        return (0.0, 0.0) if signs else (0.9, 0.999)

    def make_optimizer(self, parameters, total_steps: int):
        """The optimizer and its per-step learning-rate schedule."""
        if self.optimizer == "adamw":
            optimizer = torch.optim.AdamW(parameters, lr=self.lr, betas=self.adam_betas(),
                                          weight_decay=self.weight_decay)
        elif self.optimizer == "adam":
            optimizer = torch.optim.Adam(parameters, lr=self.lr, betas=self.adam_betas(),
                                         weight_decay=self.weight_decay,
                                         decoupled_weight_decay=True)
        else:
            momentum = self.optimizer_momentum()
            optimizer = torch.optim.SGD(parameters, lr=self.lr, momentum=momentum,
                                        nesterov=self.nesterov and momentum > 0,
                                        weight_decay=self.weight_decay)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor(total_steps))

    def lr_factor(self, total_steps: int) -> Callable[[int], float]:
        """The learning rate at a step, as a fraction of ``lr``."""
        warmup, schedule = self.lr_warmup_steps, self.lr_schedule

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            if schedule == "cosine":
                return 0.5 * (1.0 + math.cos(math.pi * progress))
            if schedule == "linear":
                return 1.0 - progress
            if schedule == "wsd":
                return min(1.0, (1.0 - progress) / WSD_DECAY_SHARE)
            if schedule == "step":
                return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
            return 1.0

        return factor

    def measures_speed(self) -> bool:
        """Whether a :class:`DynamicBatchController` runs (it also just measures, with equal
        shares, when a slow worker is set)."""
        return self.batching == "dynamic" or bool(self.slow_worker_cores and HOOKS[self.hook].weighted)


def run_training(config: TrainConfig, on_epoch: Optional[Callable[[int, float], None]] = None,
                 timeout: float = 600.0) -> dict:
    """Train ``config.workers`` local processes and return rank 0's record.

    Returns:
        dict with ``final_accuracy``, ``epochs`` (per epoch: test accuracy/loss, bytes sent,
        training wall seconds, every rank's batch size at the epoch's start), ``evaluations``
        (every ``evaluate_every`` steps: step, training seconds so far, test loss and
        accuracy), ``history``
        (per-step loss, cumulative bytes this rank handed to collectives, step seconds),
        ``bytes_per_step``, ``dense_bytes_per_step`` (handed to collectives; dense: float32
        parameters), ``link_bytes_per_step``, ``dense_link_bytes_per_step`` (what those send over
        a rank's link, :func:`lab.byte_count.link_bytes`), ``hook_stats`` (for hetero_comm's
        hooks), ``speed_history`` (the controller's plans: every rank's samples, compute
        seconds and speed per window; ``None`` without one), ``ranks_identical`` (every rank
        ended with bitwise identical parameters) and ``final_parameters``.
        ``on_epoch(epoch, test_accuracy)`` is called after each epoch.
    """
    config.validate()
    with (CpuQuota(config.slow_worker_cores, config.slow_worker_period_us)
          if config.slow_worker_cores else contextlib.nullcontext()) as quota:
        return run_ranks(config.workers, _train_worker, config, timeout=timeout,
                         on_progress=(lambda item: on_epoch(*item)) if on_epoch else None,
                         on_start=(lambda processes: _slow_down_last(processes, quota))
                         if quota is not None else None)[0]


def _slow_down_last(processes, quota: CpuQuota) -> None:
    quota.add(processes[-1].pid)  # the last worker is the slow one
    cores = sorted(os.sched_getaffinity(0))
    if len(processes) <= len(cores):
        # One core per worker, so that the quota is the only difference between them
        # (a quota shared across cores is handed out per core and strands when threads move).
        for process, core in zip(processes, cores):
            os.sched_setaffinity(process.pid, {core})


def _train_worker(rank: int, world_size: int, config: TrainConfig) -> Optional[dict]:
    record = train_rank(rank, config)
    return record if rank == 0 else None


def train_rank(rank: int, config: TrainConfig) -> dict:
    """One rank of a run in this process, whose gloo group is already initialised: train, then
    check that every rank ended with bitwise identical parameters. Returns this rank's record
    (see :func:`run_training`; rank 0's is the one reported)."""
    config.validate()
    record = _train(rank, config)
    flat = torch.cat([p.detach().reshape(-1) for p in record.pop("model").parameters()])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    # NaN where the other rank has NaN counts as the same (a run that diverged alike)
    same = torch.tensor([int(bool(((flat == reference) | (flat.isnan() & reference.isnan())).all()))])
    dist.all_reduce(same)
    record["ranks_identical"] = int(same) == config.workers
    record["final_parameters"] = flat.numpy()  # numpy: pickled by value, not shared memory
    return record


class _Run:
    """The objects of one rank's run and what it records."""

    def __init__(self, rank: int, config: TrainConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.x_train, self.y_train, self.x_test, self.y_test, self.model = make_workload(
            config.model, config.hidden, config.seed, config.dropout)
        self.units = None
        if config.dropout and config.dropout_kind != "standard":
            self.units = convert_dropout(self.model, seed=config.seed,
                                         skip_compute=config.dropout_kind == "sliced")
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=config.bucket_cap_mb)
        # Full global batches only, each shuffled once per epoch with a seed every rank shares.
        self.sampler = HeteroSampler(len(self.x_train), config.global_batch, rank, config.workers,
                                     seed=config.seed * 1000, drop_last=True)
        total_steps = config.epochs * self.sampler.num_steps()
        if config.max_steps is not None:
            total_steps = min(total_steps, config.max_steps)
        self.controller = None
        if HOOKS[config.hook].one_call:  # compress() reads the optimizer and registers the hook
            self.optimizer, self.schedule = config.make_optimizer(self.ddp.parameters(), total_steps)
            self.state = compress(self.ddp, self.optimizer, **config.hook_settings)
        else:
            self._register_hook(config)
            self.optimizer, self.schedule = config.make_optimizer(self.ddp.parameters(), total_steps)
            if config.prepare_optimizer:
                self.state.prepare_optimizer(self.optimizer)
        if self.units is not None:
            self.units.attach(self.optimizer)
        auto_density = getattr(self.state, "auto_density", None)
        if auto_density is not None:  # the lab keeps every step's record, not only the last ones
            auto_density.history = collections.deque(auto_density.history)
        self.total_steps = total_steps
        self.step = 0
        self.bytes_sent = {"bytes": 0}
        self.history: Dict[str, List[float]] = {"step": [], "loss": [], "bytes": [], "seconds": []}
        self.epochs: Dict[str, list] = {"epoch": [], "step": [], "test_accuracy": [],
                                        "test_loss": [], "bytes": [], "seconds": [],
                                        "batch_sizes": []}
        # every evaluate_every steps: the step, training seconds so far, test loss and accuracy
        self.evaluations: Dict[str, list] = {"step": [], "seconds": [], "test_loss": [],
                                             "test_accuracy": []}
        self.training_seconds = 0.0

    def _register_hook(self, config: TrainConfig) -> None:
        self.state, hook = make_hook(config.hook, config.hook_settings)
        if config.skip_dropped:
            self.state.skip_dropped_units(self.units)
        if config.measures_speed():
            self.controller = DynamicBatchController(
                self.sampler, self.state, replan_every=config.replan_every,
                smoothing=config.smoothing, max_change=config.max_change,
                adapt=config.batching == "dynamic")
            self.controller.register_comm_hook(self.ddp, hook)
        else:
            self.ddp.register_comm_hook(self.state, hook)

    def out_of_steps(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def train_step(self, index: torch.Tensor) -> None:
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self.controller.step(len(index)) if self.controller else contextlib.nullcontext():
            loss = _cross_entropy(self.ddp(self.x_train[index]), self.y_train[index])
            loss.backward()
        if self.config.clip_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_norm)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1
        for name, value in (("step", self.step), ("loss", loss.item()),
                            ("bytes", self.bytes_sent["bytes"]),
                            ("seconds", time.perf_counter() - began)):
            self.history[name].append(value)

    def train_epoch(self, epoch: int) -> None:
        if self.controller is not None:
            self.controller.set_epoch(epoch)  # re-plans, then sets the sampler's epoch
        else:
            self.sampler.set_epoch(epoch)
        batch_sizes = list(self.sampler.batch_sizes)
        seconds = 0.0
        for index in self.sampler:
            if self.out_of_steps():
                break
            began = time.perf_counter()
            self.train_step(index)
            seconds += time.perf_counter() - began
            every = self.config.evaluate_every
            if every and self.step % every == 0 and dist.get_rank() == 0:  # rank 0 reports
                self.record_evaluation(self.training_seconds + seconds)
            if self.config.progress_file and dist.get_rank() == 0:
                with open(self.config.progress_file, "w") as f:
                    f.write(f"{self.step} {self.total_steps}")
        self.training_seconds += seconds
        test_loss, accuracy = self.evaluate()
        for name, value in (("epoch", epoch + 1), ("step", self.step), ("test_accuracy", accuracy),
                            ("test_loss", test_loss), ("bytes", self.bytes_sent["bytes"]),
                            ("seconds", seconds), ("batch_sizes", batch_sizes)):
            self.epochs[name].append(value)

    def record_evaluation(self, training_seconds: float) -> None:
        test_loss, accuracy = self.evaluate()
        for name, value in (("step", self.step), ("seconds", training_seconds),
                            ("test_loss", test_loss), ("test_accuracy", accuracy)):
            self.evaluations[name].append(value)

    def evaluate(self) -> Tuple[float, float]:
        """Test loss and accuracy (of the next byte, for text), in eval mode (no dropout)."""
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(self.x_test)
                return (float(_cross_entropy(logits, self.y_test)),
                        float((logits.argmax(-1) == self.y_test).float().mean()))
        finally:
            self.model.train()


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every prediction (one per image, or one per byte)."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _train(rank: int, config: TrainConfig) -> dict:
    run = _Run(rank, config)
    with count_collective_bytes(run.bytes_sent):
        for epoch in range(config.epochs):
            run.train_epoch(epoch)
            if rank == 0:
                report_progress((epoch + 1, run.epochs["test_accuracy"][-1]))
            if run.out_of_steps():
                break
    if run.controller is not None:
        run.controller.replan()  # the last epoch's speeds, for the record
    stats = getattr(run.state, "stats", None)
    hook_stats = stats() if callable(stats) else None  # (first: a hook may wait for its work)
    auto_density = getattr(run.state, "auto_density", None)  # the two-level sync's, if automatic
    dense_bytes = sum(p.numel() * 4 for p in run.model.parameters())  # float32, every step
    return {"auto_density_history": list(auto_density.history) if auto_density else None,
            "config": dataclasses.asdict(config), "history": run.history, "epochs": run.epochs,
            "evaluations": run.evaluations,
            "final_accuracy": run.epochs["test_accuracy"][-1], "steps": run.step,
            "bytes_per_step": run.bytes_sent["bytes"] / run.step,
            "bytes_total": run.bytes_sent["bytes"],
            "dense_bytes_per_step": dense_bytes,
            "link_bytes_per_step": run.bytes_sent["link_bytes"] / run.step,
            "dense_link_bytes_per_step": link_bytes("all_reduce", dense_bytes, config.workers),
            "hook_stats": hook_stats,
            "speed_history": run.controller.history if run.controller is not None else None,
            "model": run.model}
