"""Two sites with a slow link between them, one site under a CPU quota: time to a target
accuracy, final accuracy and bytes between sites, for every way of synchronising.

Set-up (root only; elsewhere this says why and exits): 4 gloo ranks, each in its own network
namespace (:class:`lab.netlab.RateLimitedNetwork` with sites): ranks 0 and 1 at
site a, ranks 2 and 3 at site b, unshaped inside a site, ``--inter-site-rate`` (default
100 Mbit/s) between them; site b's two ranks share ``--slow-site-cores`` CPUs (a real cgroup
quota). Every method trains for the same wall-clock budget (``--seconds``); rank 0 (site a)
evaluates its current model every ``--eval-every`` seconds of training. Each rank draws its own
batches (``--batch`` rows, with replacement, a fixed seed per rank).

Methods (``--methods``):
* ``ddp``: synchronous DDP, dense allreduce (the baseline);
* ``ddp_sparse``: synchronous DDP with hetero_comm's segment_sparse hook at 10%;
* ``ddp_dynamic``: synchronous DDP with batches proportional to measured speed (hetero_comm's
  ``DynamicBatchController``, re-planned every 20 steps), the same global batch;
* ``local_sgd_H``: PyTorch's hierarchical local SGD: DDP inside each site every step
  (``post_localSGD_hook`` on the site's subgroup) and ``PostLocalSGDOptimizer`` with
  ``HierarchicalModelAverager`` averaging over all 4 ranks every H steps (blocking);
* ``diloco_H`` or ``diloco_H_LR``: torchft's DiLoCo (``torchft.local_sgd.DiLoCo``), one replica
  group per rank (torchft's replica groups are single data-parallel ranks), the user's optimizer
  inside, Nesterov SGD momentum 0.9 with lr LR (default 0.7, the paper's) outside, an outer step
  every H inner steps; the lighthouse runs in rank 0's process;
* ``group_sync_H`` or ``group_sync_H_S``: :class:`hetero_comm.sync.GroupSync`, a group per site,
  DDP inside, the groups' progress exchanged asynchronously every H steps of the slowest group
  (every group's period proportional to its speed, measured over 10 local steps at the start;
  staleness bound S, default 2; 0 is lockstep);
* ``group_sync_deadline_H[_S]``: the same with the layer-wise soft deadline
  (``layer_deadline=True``); either with ``_bfloat16`` or ``_int8`` at the end: that wire format
  between the groups, or ``_dPbB``: sparse contributions (:class:`hetero_comm.sync.SparseWire`,
  P percent of the segments of 64 values at B bits, e.g. ``group_sync_16_d1b2``);
* ``sparseloco_H`` or ``sparseloco_H_dP``: SparseLoCo's scheme written from the paper
  (:class:`lab.baselines.SparseLoCo`, a baseline: no package provides it): DDP
  inside each site, synchronous rounds every H steps between the sites' leaders, top-k of each
  chunk of 4096 values (P percent, default 1.5625, the paper's k=64) at 2 bits, error feedback
  with beta 0.95, outer rate 1.

Workloads (``--workloads``): ``cnn`` (the digits CNN, SGD lr 0.05 momentum 0.9; accuracy) and
``gpt`` (the byte-level transformer, AdamW lr 3e-3; validation loss in nats per byte on 64
windows). The target of "time to target" is ``--target`` / ``--gpt-target``, by default what
dense DDP reached at the end of its budget.

Output: one table (method, final metric, time to target, steps of rank 0, bytes that left each
site during the training budget (the sites' uplink counters sampled every 0.2 s and
interpolated at the budget's start and end: set-up, the final flush and the teardown excluded)
and in all, wall seconds, and for GroupSync the seconds site a's leader waited and its late parts), a JSON of every number and a PNG of the metric against
wall time, one line per method, in ``--out``.

``HC_VERBOSE=1`` shows every rank's stderr (torchft's logs included).

Usage: python benchmarks/bench_sync.py [--workloads cnn,gpt] [--methods ddp,group_sync_8]
       [--seconds 60] [--inter-site-rate 100mbit] [--slow-site-cores 0.5] [--out bench_sync_out]
"""

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

SITES = ["a", "a", "b", "b"]
PORT, LIGHTHOUSE_PORT = 29600, 29610
WORKLOADS = {
    "cnn": dict(model="cnn", optimizer="sgd", lr=0.05, metric="accuracy"),
    "gpt": dict(model="gpt", optimizer="adamw", lr=3e-3, metric="val_loss"),
}
KINDS = ("ddp_sparse", "ddp_dynamic", "ddp", "local_sgd", "diloco", "group_sync_deadline", "group_sync",
         "sparseloco")
DEFAULT_METHODS = ("ddp", "ddp_sparse", "ddp_dynamic", "local_sgd_4", "local_sgd_16", "diloco_4", "diloco_16",
                   "group_sync_4", "group_sync_16")


# ------------------------------------------------------------------------------- worker
def worker() -> None:
    """One rank of one run (``HC_RUN``, JSON); rank 0 prints its record as one JSON line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    run = json.loads(os.environ["HC_RUN"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    record = Trainer(rank, world_size, run).train()
    if rank == 0:
        print(json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as netbench's workers: a normal exit can abort in gloo's thread destructors


class Trainer:
    """One rank's training for one method: the same data, model and optimizer for every method;
    only the synchronisation differs."""

    def __init__(self, rank, world_size, run):
        import torch
        from lab.data import load_digits_split, make_model
        from lab.text import TinyGPT, load_text_split

        self.rank, self.world_size, self.run = rank, world_size, run
        self.workload = WORKLOADS[run["workload"]]
        torch.manual_seed(0)
        if self.workload["model"] == "gpt":
            self.x, self.y, self.x_test, self.y_test = load_text_split()
            self.x_test, self.y_test = self.x_test[:64], self.y_test[:64]
            self.model = TinyGPT(width=128)
        else:
            self.x, self.y, self.x_test, self.y_test = load_digits_split(0)
            self.model = make_model(64, "cnn")
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.history, self.steps = [], 0

    def optimizer(self, scale=1.0):
        import torch
        lr = self.workload["lr"] * scale
        if self.workload["optimizer"] == "adamw":
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        return torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)

    def loss(self, module):
        import torch
        rows = torch.randint(len(self.x), (self.run["batch"],), generator=self.generator)
        return self.cross_entropy(module(self.x[rows]), self.y[rows])

    @staticmethod
    def cross_entropy(logits, targets):
        import torch
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))

    def evaluate(self):
        import torch
        with torch.no_grad():
            logits = self.model(self.x_test)
            if self.workload["metric"] == "accuracy":
                return (logits.argmax(-1) == self.y_test).float().mean().item()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     self.y_test.reshape(-1)).item()

    def record_progress(self, force=False):
        elapsed = time.perf_counter() - self.start
        if self.rank == 0 and (force or elapsed - self.last_eval >= self.run["eval_every"]):
            self.history.append((elapsed, self.steps, self.evaluate()))
            self.last_eval = elapsed

    def out_of_time(self, group=None) -> bool:
        """Every rank of ``group`` (default: all) agrees whether the budget is spent."""
        import torch
        import torch.distributed as dist
        flag = torch.tensor([float(time.perf_counter() - self.start >= self.run["seconds"])])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def train(self):
        import torch.distributed as dist
        method = self.run["method"]
        kind = next(k for k in KINDS if method == k or method.startswith(k + "_"))
        tokens = [x for x in method[len(kind) + 1:].split("_") if x]
        self.wire, self.density = wire_of(tokens), density_of(tokens)
        self.options = [float(x) for x in tokens if x[0].isdigit()]
        body = {"ddp": self.train_ddp, "ddp_sparse": self.train_ddp, "ddp_dynamic": self.train_dynamic,
                "local_sgd": self.train_local_sgd, "diloco": self.train_diloco,
                "group_sync": self.train_group_sync, "group_sync_deadline": self.train_group_sync,
                "sparseloco": self.train_sparseloco}[kind]
        dist.barrier()  # every rank's clock starts together (a throttled rank loads slower)
        self.start, self.last_eval = time.perf_counter(), 0.0
        self.start_monotonic = time.monotonic()  # the parent's byte samples use this clock
        self.record_progress(force=True)
        extra = body() or {}
        self.record_progress(force=True)
        return dict(self.run, history=self.history, steps=self.steps,
                    seconds=time.perf_counter() - self.start, start_monotonic=self.start_monotonic,
                    **extra)

    def inner_step(self, module, optimizer):
        self.loss(module).backward()
        optimizer.step()
        optimizer.zero_grad()
        self.steps += 1
        self.record_progress()

    def train_ddp(self):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
        ddp = DDP(self.model)
        if self.run["method"] == "ddp_sparse":
            ddp.register_comm_hook(SegmentSparseState(density=0.1), segment_sparse_hook)
        optimizer = self.optimizer()
        while not self.out_of_time():
            self.inner_step(ddp, optimizer)

    def train_dynamic(self):
        """DDP with batches proportional to each rank's measured speed (re-planned every 20
        steps), the global batch the same as the other methods' (4 x ``batch``)."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        from hetero_comm.hetero import DynamicBatchController, HeteroSampler
        from hetero_comm.hooks import AllreduceState, allreduce_hook
        ddp = DDP(self.model, broadcast_buffers=False)
        sampler = HeteroSampler(len(self.x), self.run["batch"] * self.world_size, self.rank,
                                self.world_size, seed=0)
        controller = DynamicBatchController(sampler, AllreduceState(), replan_every=20)
        controller.register_comm_hook(ddp, allreduce_hook)
        optimizer = self.optimizer()
        for epoch in itertools.count():
            controller.set_epoch(epoch)
            for rows in sampler:
                with controller.step(len(rows)):
                    self.cross_entropy(ddp(self.x[rows]), self.y[rows]).backward()
                optimizer.step()
                optimizer.zero_grad()
                self.steps += 1
                self.record_progress()
                if self.out_of_time():
                    return dict(batch_sizes=sampler.sizes_of_step(0))

    def train_local_sgd(self):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState, post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import \
            HierarchicalModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        period = int(self.options[0])
        site_group, _ = dist.new_subgroups(2)  # ranks [0, 1] and [2, 3]: the sites
        ddp = DDP(self.model)
        ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=site_group,
                                                 start_localSGD_iter=1), post_localSGD_hook)
        averager = HierarchicalModelAverager({1: 2, period: 4} if period > 1 else {1: 4},
                                             warmup_steps=1)
        optimizer = PostLocalSGDOptimizer(self.optimizer(), averager)
        while True:
            for _ in range(period):
                self.inner_step(ddp, optimizer)
            if self.out_of_time():
                break

    def train_diloco(self):
        import torch
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        period = int(self.options[0])
        address = os.environ["HC_ADDRESS"]
        # torchft advertises its checkpoint server (which heals replicas at the first quorum) as
        # socket.gethostname(); inside this rank's namespace only its netlab address reaches it.
        import socket
        socket.gethostname = lambda: address
        lighthouse = None
        if self.rank == 0:
            lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}",
                                          min_replicas=self.world_size)
        store = torch.distributed.TCPStore(host_name=address, port=0, is_master=True,
                                           wait_for_workers=False)
        inner = self.optimizer()
        outer_lr = self.options[1] if len(self.options) > 1 else 0.7
        outer = torch.optim.SGD(self.model.parameters(), lr=outer_lr, momentum=0.9, nesterov=True)
        timeout = datetime.timedelta(seconds=120)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=self.world_size,
            load_state_dict=lambda state: self.model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": self.model.state_dict()},
            replica_id=f"rank{self.rank}", store_addr=address, store_port=store.port, rank=0,
            world_size=1, lighthouse_addr=f"http://{os.environ['MASTER_ADDR']}:{LIGHTHOUSE_PORT}",
            hostname=address, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout)
        try:
            with DiLoCo(manager, [self.model], inner, outer, sync_every=period):
                while True:
                    for _ in range(period):
                        self.inner_step(self.model, inner)
                    if self.out_of_time():
                        break
        finally:
            manager.shutdown()
            if lighthouse is not None:
                lighthouse.shutdown()

    def measure_speed(self, steps=10) -> list:
        """Every rank's forward-backward passes per second over ``steps`` local passes (no
        sync, no optimizer step: the weights do not move), shared by an allreduce: what the
        batch controller would measure."""
        import torch
        import torch.distributed as dist
        start = time.perf_counter()
        for _ in range(steps):
            self.loss(self.model).backward()
        self.model.zero_grad()
        speeds = torch.zeros(self.world_size, dtype=torch.float64)
        speeds[self.rank] = steps / (time.perf_counter() - start)
        dist.all_reduce(speeds)
        return speeds.tolist()

    def train_sparseloco(self):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from lab.baselines import SparseLoCo
        sites = [[r for r, s in enumerate(SITES) if s == site] for site in dict.fromkeys(SITES)]
        baseline = SparseLoCo(self.model, sites, period=int(self.options[0]),
                              density=self.density or 1 / 64)
        ddp = DDP(self.model, process_group=baseline.process_group)
        optimizer = self.optimizer()
        while True:
            for _ in range(baseline.period):  # a round ends each period: every site stops together
                self.inner_step(ddp, optimizer)
                baseline.step()
            if self.out_of_time():
                break
        return dict(leader_bytes_sent=baseline.bytes_sent)

    def train_group_sync(self):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from hetero_comm.sync import GroupSync, groups_from_sites, periods_for_speeds
        period = int(self.options[0])
        bound = int(self.options[1]) if len(self.options) > 1 else 2
        grouping = groups_from_sites(SITES)
        speeds = self.measure_speed()
        periods = periods_for_speeds(grouping, speeds, period)
        sync = GroupSync(self.model, grouping, period=periods, max_staleness=bound, wire_dtype=self.wire,
                         layer_deadline=self.run["method"].startswith("group_sync_deadline"))
        ddp = DDP(self.model, process_group=sync.process_group)
        optimizer = self.optimizer(sync.lr_scale)
        while not self.out_of_time(sync.process_group):
            self.inner_step(ddp, optimizer)
            sync.step()
        trained = time.perf_counter() - self.start
        sync.close()  # the fast site waits here for the slow one's last contribution
        return dict(group_sync_stats=sync.stats(), trained_seconds=trained, periods=periods,
                    speeds=speeds)


def wire_of(tokens):
    """GroupSync's wire from a method's tokens: ``bfloat16``, ``int8``, ``dPbB`` (sparse) or none."""
    import re
    from hetero_comm.sync import SparseWire
    for token in tokens:
        if token in ("bfloat16", "int8"):
            return token
        sparse = re.fullmatch(r"d([0-9.]+)b([0-9])", token)
        if sparse:
            return SparseWire(float(sparse.group(1)) / 100, int(sparse.group(2)))
    return None


def density_of(tokens):
    """SparseLoCo's density from a ``dP`` token (percent), or ``None``."""
    return next((float(t[1:]) / 100 for t in tokens if t.startswith("d") and "b" not in t), None)


# ----------------------------------------------------------------------------- launching
def run_method(run: dict, args) -> dict:
    """Start the 4 ranks in their namespaces, site b under the CPU quota; rank 0's record plus
    the bytes that left each site."""
    from lab.netlab import RateLimitedNetwork
    from lab.throttle import CpuQuota

    argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    with tempfile.TemporaryFile("w+") as output, \
            RateLimitedNetwork(4, None, sites=SITES, inter_site_rate=args.inter_site_rate) as net, \
            CpuQuota(args.slow_site_cores) as quota:
        before = [net.site_tx_bytes(site) for site in range(2)]
        processes = []
        for rank in range(4):
            env = dict(RANK=rank, WORLD_SIZE=4, MASTER_ADDR=net.address(0),
                       HC_ADDRESS=net.address(rank), HC_RUN=json.dumps(run))
            processes.append(net.popen(rank, argv, env=env,
                                       stdout=output if rank == 0 else subprocess.DEVNULL,
                                       stderr=None if os.environ.get("HC_VERBOSE") else subprocess.DEVNULL))
            if SITES[rank] == "b":
                quota.add(processes[-1].pid)
        deadline = time.monotonic() + run["seconds"] + 300
        samples = []  # (monotonic seconds, bytes out of each site)
        while any(p.poll() is None for p in processes):
            failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"{run['method']}: a rank failed ({failed}) or overran")
            samples.append((time.monotonic(), [net.site_tx_bytes(site) for site in range(2)]))
            time.sleep(0.2)
        samples.append((time.monotonic(), [net.site_tx_bytes(site) for site in range(2)]))
        if any(p.returncode != 0 for p in processes):
            raise RuntimeError(f"{run['method']}: a rank exited with an error")
        site_bytes = [net.site_tx_bytes(site) - before[site] for site in range(2)]
        output.seek(0)
        record = [json.loads(line) for line in output if line.startswith("{")][-1]
    start = record["start_monotonic"]
    window = [bytes_at(samples, start + run["seconds"], site) - bytes_at(samples, start, site)
              for site in range(2)]
    return dict(record, site_bytes=site_bytes, window_site_bytes=window)


def bytes_at(samples, moment: float, site: int) -> float:
    """Site ``site``'s counter at ``moment``, linear between the samples around it (the
    last sample, taken once every rank has exited, for a moment after it)."""
    if moment >= samples[-1][0]:
        return samples[-1][1][site]
    for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
        if t0 <= moment <= t1:
            return b0[site] + (b1[site] - b0[site]) * (moment - t0) / max(t1 - t0, 1e-9)
    raise RuntimeError("the byte samples do not cover the training budget")


def time_to_target(record: dict, target: float, metric: str):
    for seconds, _, value in record["history"]:
        if (value >= target) if metric == "accuracy" else (value <= target):
            return seconds
    return None


def target_for(records, workload: str, args) -> float:
    """The workload's target: ``--target`` (accuracy) or ``--gpt-target`` (loss) if given, else
    what synchronous dense DDP reached at the end of the budget (its row must have run)."""
    given = args.target if WORKLOADS[workload]["metric"] == "accuracy" else args.gpt_target
    if given is not None:
        return given
    dense = [r for r in records if r["workload"] == workload and r["method"] == "ddp"]
    if not dense:
        raise SystemExit(f"no target for {workload}: pass one or include the ddp method")
    return dense[0]["history"][-1][2]


def group_sync_waits(record) -> str:
    stats = record.get("group_sync_stats")
    return "" if stats is None else f"{stats['waited_s']:.1f} / {stats['late_parts']}"


def megabytes(pair) -> str:
    return " / ".join(f"{b / 1e6:.3f}" if b < 1e6 else f"{b / 1e6:.1f}" for b in pair)


def fewer_than_ddp(records, record) -> str:
    """How many times fewer bytes left the busier site in the budget than under ddp."""
    dense = [r for r in records if r["workload"] == record["workload"] and r["method"] == "ddp"]
    if not dense:
        return ""
    return f"{max(dense[0]['window_site_bytes']) / max(max(record['window_site_bytes']), 1):.0f}x"


def report(records, args) -> str:
    targets = ", ".join(f"{w}: {target_for(records, w, args):.3f}"
                        for w in dict.fromkeys(r["workload"] for r in records))
    lines = [f"2 sites x 2 ranks, {args.inter_site_rate} between sites, unshaped inside; site b "
             f"under {args.slow_site_cores} CPUs; {args.seconds} s of training per method; "
             f"targets ({targets})",
             "| workload | method | final | time to target | rank 0 steps | MB out of a / b in the "
             "budget | fewer than ddp's | MB out of a / b in all | wall s | GroupSync: site a "
             "waited s / late parts |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        metric = WORKLOADS[record["workload"]]["metric"]
        target = target_for(records, record["workload"], args)
        reached = time_to_target(record, target, metric)
        final = record["history"][-1][2]
        shown = f"{100 * final:.1f}%" if metric == "accuracy" else f"{final:.3f}"
        lines.append(f"| {record['workload']} | {record['method']} | {shown} | "
                     f"{'not reached' if reached is None else f'{reached:.1f} s'} | "
                     f"{record['steps']} | {megabytes(record['window_site_bytes'])} | "
                     f"{fewer_than_ddp(records, record)} | {megabytes(record['site_bytes'])} | "
                     f"{record['seconds']:.0f} | {group_sync_waits(record)} |")
    return "\n".join(lines)


def plot(records, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    workloads = sorted({r["workload"] for r in records})
    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for record in (r for r in records if r["workload"] == workload):
            seconds, _, values = zip(*record["history"])
            axis.plot(seconds, values, label=record["method"])
        axis.set_xlabel("wall seconds of training")
        axis.set_ylabel(WORKLOADS[workload]["metric"])
        axis.set_title(workload)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default="cnn")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--inter-site-rate", default="100mbit")
    parser.add_argument("--slow-site-cores", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy to reach (default: what dense DDP reached)")
    parser.add_argument("--gpt-target", type=float, default=None,
                        help="validation loss to reach (default: what dense DDP reached)")
    parser.add_argument("--out", default="bench_sync_out")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    from lab.netlab import netlab_unavailable
    from lab.throttle import cpu_quota_unavailable
    reason = netlab_unavailable() or cpu_quota_unavailable()
    if reason is not None:
        print(f"bench_sync needs rate-limited links and a CPU quota: {reason}")
        return 1
    os.makedirs(args.out, exist_ok=True)
    records = []
    for workload in args.workloads.split(","):
        for method in args.methods.split(","):
            run = dict(workload=workload, method=method, seconds=args.seconds,
                       eval_every=args.eval_every, batch=args.batch)
            records.append(run_method(run, args))
            print(f"  done: {workload} {method}", flush=True)
    table = report(records, args)
    print(table)
    with open(os.path.join(args.out, "bench_sync.json"), "w") as handle:
        json.dump(records, handle, indent=1)
    plot(records, os.path.join(args.out, "bench_sync.png"))
    print(f"plot: {os.path.join(args.out, 'bench_sync.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
