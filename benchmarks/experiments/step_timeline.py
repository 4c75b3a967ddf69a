"""When a recipe's collectives start and end inside one training step on a shaped link: 2
ranks, one per namespace (root), DDP with ``--bucket-mb`` buckets, ``hetero_comm.compress``
with the optimizer given. Prints rank 0's timeline of the median step (forward, each hook,
each ``dist.all_reduce`` issued and summed, backward, optimizer), the median step of the
same model with no communication, and of the one call with its int8 wire summed in two phases
(an all-to-all and an all-gather, waited for in the hook; untraced), from the same run.

Models: ``cnn_wide`` (``netbench``'s CNN, 4.2M parameters, nearly all in one linear layer) or
``gpt`` (the benchmark transformer, width 128: 0.83M parameters over its layers), batch 32.

Usage: ``PYTHONPATH=benchmarks python benchmarks/experiments/step_timeline.py [--link 100mbit]
[--model cnn_wide] [--optimizer sgd] [--bucket-mb 4] [--steps 20]``.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

MODES = ("no communication", "hetero_comm.compress", "hetero_comm.compress, int8 in two phases")
MODELS = {"cnn_wide": 1024, "gpt": 128}  # model -> its width (make_workload's hidden)


def worker() -> None:
    """One rank: both modes in turn, each ``STEPS`` steps; rank 0 prints one JSON line a mode."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hetero_comm
    from hetero_comm.hooks import SegmentSparseState, segment_sparse_hook
    from hetero_comm.recipes import recipe_for
    from lab.training import make_workload

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29500",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    events: list = []
    began = [0.0]

    def mark(what: str) -> None:
        events.append((round((time.perf_counter() - began[0]) * 1e3, 2), what))

    all_reduce = dist.all_reduce

    def traced_all_reduce(tensor, *args, **kwargs):
        size = tensor.numel() * tensor.element_size()
        mark(f"allreduce of {size} B issued")
        work = all_reduce(tensor, *args, **kwargs)
        if work is not None:
            work.get_future().then(lambda _: mark(f"allreduce of {size} B summed"))
        return work

    dist.all_reduce = traced_all_reduce  # (the codec calls dist.all_reduce by attribute)
    for mode in MODES:
        torch.manual_seed(0)
        name = os.environ["MODEL"]
        x, y, _, _, model = make_workload(name, MODELS[name], 0, 0.0)
        ddp = DistributedDataParallel(model, bucket_cap_mb=float(os.environ["BUCKET_MB"]))
        optimizer = (torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
                     if os.environ["OPTIMIZER"] == "sgd"
                     else torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01))
        if mode.startswith("hetero_comm.compress"):
            register = ddp.register_comm_hook

            def register_traced(hook_state, hook):  # the hook, marking its begin and return
                def traced_hook(state_, bucket):
                    mark(f"hook of bucket {bucket.index()} ({bucket.buffer().numel()} values) "
                         f"begins")
                    try:
                        return hook(state_, bucket)
                    finally:
                        mark(f"hook of bucket {bucket.index()} returns")
                register(hook_state, traced_hook)
            ddp.register_comm_hook = register_traced
            if mode.endswith("two phases"):  # the recipe's state by hand, as compress builds it
                settings = dict(recipe_for(optimizer).settings, int8_sum="two_phase")
                state = SegmentSparseState(**settings)
                ddp.register_comm_hook(state, segment_sparse_hook)
                state.prepare_optimizer(optimizer)
            else:
                state = hetero_comm.compress(ddp, optimizer)
        else:
            def hand_back(_, bucket):
                future = torch.futures.Future()
                future.set_result(bucket.buffer())
                return future
            ddp.register_comm_hook(None, hand_back)
            state = None
        batches = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(int(os.environ["STEPS"])):
            index = torch.randint(0, len(x), (32,), generator=batches)
            dist.barrier()
            events.clear()
            began[0] = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            logits = ddp(x[index])  # (per image, or per byte of a text window)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), y[index].flatten())
            mark("forward done")
            loss.backward()
            mark("backward done")
            optimizer.step()
            mark("optimizer step done")
            steps.append((events[-1][0], list(events)))
        if rank == 0:
            steady = sorted(steps[3:])  # after DDP's rebuilt buckets and the warm-up step
            print(json.dumps({"key": mode, "steps": [s for s, _ in steady],
                              "median": steady[len(steady) // 2][1]}), flush=True)
        del state
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as netbench's workers: gloo's thread destructors can abort a normal exit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="100mbit", help="loopback or a netlab rate (100mbit)")
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn_wide")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from netbench import run_script_ranks

    records = run_script_ranks(os.path.abspath(__file__), 2,
                               dict(WORLD_SIZE=2, BUCKET_MB=args.bucket_mb, STEPS=args.steps,
                                    MODEL=args.model, OPTIMIZER=args.optimizer),
                               args.link)
    print(f"# PYTHONPATH=benchmarks python benchmarks/experiments/step_timeline.py --link "
          f"{args.link} --model {args.model} --optimizer {args.optimizer} --bucket-mb "
          f"{args.bucket_mb:g} --steps {args.steps}")
    for mode in MODES:
        record = records[mode]
        print(f"\n## {mode}: median step {statistics.median(record['steps']):.1f} ms "
              f"(steps after the third: {min(record['steps']):.1f}-{max(record['steps']):.1f} ms)")
        print("rank 0's median step, ms from its start:")
        for at, what in record["median"]:
            print(f"{at:8.2f}  {what}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(main())
