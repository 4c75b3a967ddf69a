"""Where a planned step's time goes on a GPU: the compute stream's idle gaps and the copies.

The cost model takes a swapped block's copies as hidden behind the next block's compute; on an
H200 the plan that swapped five blocks of the wide transformer ran 20% slower than unplanned
where the model predicted 3% (`docs/design/memory.md`, "Swapping"). This profiles one step
of each plan given (after warm-up) with ``torch.profiler`` and prints, per plan: the step's
time, each stream's busy time, the copies (direction, start, length) and the longest gaps of the
compute stream (the stream with the most kernel time) with the copy in flight during each: a
gap with a copy in flight is compute waiting for a copy; one without is the host falling behind.

Usage: python benchmarks/trace_memory_plan.py --device cuda --workload wide_transformer
           --plans "k s s s k s s k k k,k k s s k s s k k k" [--json-trace DIR]
(choices per block: k keep, s swap, r recompute; on the CPU only the step time is printed).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves it out
from bench_memory import WORKLOADS  # noqa: E402
from hetero_comm.memory import MemoryPlan, apply_memory_plan, chain_blocks  # noqa: E402

CHOICE_LETTERS = {"k": "keep", "s": "swap", "r": "recompute", "p": "partial"}


def _union_ms(intervals) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals, in milliseconds."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def summarize_trace(events, gap_floor_us: float = 200.0, top: int = 8) -> dict:
    """From a Chrome trace's events: per-stream busy time, the copies, and the compute stream's
    longest idle gaps with the copies in flight then. Times in ms from the first GPU event."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"streams": {}, "copies": [], "gaps": []}
    origin = min(e["ts"] for e in gpu)
    streams = {}
    for e in gpu:
        streams.setdefault(e["args"].get("stream"), []).append((e["ts"] - origin, e["ts"] - origin + e["dur"], e))
    busy = {stream: _union_ms([(s, t) for s, t, _ in spans]) for stream, spans in streams.items()}
    compute = max(streams, key=lambda stream: sum(t - s for s, t, e in streams[stream] if e["cat"] == "kernel"))
    copies = sorted((s, t, e["name"]) for s, t, e in
                    (span for spans in streams.values() for span in spans) if e["cat"] == "gpu_memcpy")
    spans = sorted((s, t) for s, t, _ in streams[compute])
    gaps, reach = [], spans[0][1]
    for start, end in spans[1:]:
        if start - reach >= gap_floor_us:
            in_flight = [name for s, t, name in copies if s < start and t > reach]
            gaps.append(((start - reach) / 1e3, reach / 1e3, in_flight))
        reach = max(reach, end)
    gaps.sort(reverse=True)
    return {"compute_stream": compute, "streams": busy,
            "copies": [(s / 1e3, (t - s) / 1e3, name) for s, t, name in copies],
            "gaps": gaps[:top], "gap_total_ms": sum(g[0] for g in gaps),
            "span_ms": (max(t for spans in streams.values() for _, t, _ in spans)) / 1e3}


def parse_plan(text: str, count: int):
    letters = text.split()
    if len(letters) != count or any(letter not in CHOICE_LETTERS for letter in letters):
        raise SystemExit(f"plan {text!r}: give one of k/s/r/p per block ({count} blocks)")
    return tuple(CHOICE_LETTERS[letter] for letter in letters)


def trace_plan(model, inputs, targets, choices, warmup, trace_dir):
    names, _ = chain_blocks(model)
    plan = MemoryPlan(names, choices, 0.0, 0.0, 0.0, 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = inputs.device.type == "cuda"

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(inputs.device)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with apply_memory_plan(model, plan):
        for _ in range(warmup):
            step()
        with torch.profiler.profile(activities=activities) as profiler:
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
    path = os.path.join(trace_dir, "_".join(c[0] for c in choices) + ".json")
    profiler.export_chrome_trace(path)
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    return seconds, summarize_trace(events)


def print_summary(label, seconds, summary) -> None:
    print(f"plan {label}: step {seconds * 1e3:.1f} ms (profiled)")
    if not summary["streams"]:
        print("  no GPU activity recorded")
        return
    print(f"  GPU span {summary['span_ms']:.1f} ms; busy per stream: " + ", ".join(
        f"{stream}{' (compute)' if stream == summary['compute_stream'] else ''} {ms:.1f} ms"
        for stream, ms in summary["streams"].items()))
    for start, length, name in summary["copies"]:
        print(f"  copy at {start:8.1f} ms for {length:6.1f} ms  {name}")
    print(f"  compute stream idle {summary['gap_total_ms']:.1f} ms in gaps >= 0.2 ms; the longest:")
    for length, at, in_flight in summary["gaps"]:
        print(f"    {length:6.1f} ms from {at:8.1f} ms; copies in flight: {', '.join(in_flight) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workload", default="wide_transformer", choices=sorted(WORKLOADS))
    parser.add_argument("--plans", required=True, help="comma-separated plans, a k/s/r/p per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json-trace", default=None, help="keep the Chrome traces in this folder")
    args = parser.parse_args()
    model, inputs, targets = WORKLOADS[args.workload](torch.device(args.device))
    count = len(chain_blocks(model)[0])
    plans = [parse_plan(text, count) for text in args.plans.split(",")]
    with tempfile.TemporaryDirectory(prefix="memory_trace_") as scratch:
        trace_dir = args.json_trace or scratch
        os.makedirs(trace_dir, exist_ok=True)
        for text, choices in zip(args.plans.split(","), plans):
            seconds, summary = trace_plan(model, inputs, targets, choices, args.warmup, trace_dir)
            print_summary(text.strip(), seconds, summary)


if __name__ == "__main__":
    main()
