"""Benchmark every compiled hetero_comm kernel (CPU or CUDA) against its pure-PyTorch reference.

``make bench`` builds the package into .venv and runs this script; by hand, with hetero_comm
installed (or built in place and PYTHONPATH=. set)::

    python benchmarks/bench_kernels.py            # 1M, 4M and 25M elements
    python benchmarks/bench_kernels.py --quick    # 1M and 4M, fewer repeats
    python benchmarks/bench_kernels.py --sizes 2M,8M --threads 1 --json out.json
    python benchmarks/bench_kernels.py --only pack_quantized   # one family's table
    python benchmarks/bench_kernels.py --device cuda  # 4M, 25M and 100M elements on the GPU

It first measures the device's copy bandwidth (on the CPU ``dst.copy_(src)`` on preallocated
float32 tensors of the largest size; on CUDA ``torch.clone`` of the same bytes; bytes = read +
write), then prints one table per kernel:
configuration, reference ms, compiled ms, speedup, compiled GB/s and the compiled kernel's
share of that copy bandwidth. Each table header states the kernel's byte model (the bytes it
must read plus write; GB/s = bytes / median time) and whether outputs are preallocated.
``select_segments`` is also compared with ``torch.topk``. A summary of the performance aims
(met / not met) closes the output; ``--json PATH`` saves every number.

Every time is the median of several repeats after warm-up calls (``time.perf_counter`` on
the CPU, CUDA events around the call on a GPU); slow cases stop repeating after about two
seconds once three repeats are done. On CUDA the bandwidth aims are judged on every row that
moves at least 16 MB (larger than no L2 cache on the sizes used: 25M and 100M elements), and
selection against ``torch.topk`` on every size. Kernels that
mutate their input get it restored outside the timed region, so repeats do the same work.
The script exits with status 1 if the compiled kernels are not loaded: comparing the
reference with itself would be meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

import hetero_comm
from hetero_comm import ops, reference

FULL_SIZES = (1_000_000, 4_000_000, 25_000_000)
QUICK_SIZES = (1_000_000, 4_000_000)
CUDA_SIZES = (4_000_000, 25_000_000, 100_000_000)
QUANT_LEVELS = 127  # int8
# (block_size, keep): the DCT hook's default (256, 32), the AdamW recipe's full transform of
# 64-element blocks (its dct_block_size; 64, 64), a full 512 transform (the figure docs/kernels.md
# quotes) and a larger block (1024, 128).
DCT_CONFIGS = ((64, 8), (64, 64), (256, 32), (512, 512), (1024, 128))

# Bytes each kernel must read plus write (n elements, S segments, k selected segments of
# seg elements, rows/blocks = n / row length or block size); GB/s = bytes / median time.
BYTE_MODELS = {
    "segment_accumulate_": "4n read residual + elem_size(grad)*n read grad + 4n write residual "
                           "(importance output negligible)",
    "select_segments": "4S read importance",
    "pack_segments_": "4*k*seg read residual + 4*k*seg write packed + 4*k*seg write zeros",
    "pack_quantized_segments_": "4*k*seg read residual + 4*k*seg write residual + 1*k*seg write "
                                "packed (int8; scale negligible)",
    "unpack_segments": "4*k*seg read packed + 4n write out",
    "quantize": "4n read x + 4*rows read scale + 1n write q",
    "dequantize": "1n read q + 4*rows read scale + 4n write x_hat",
    "dct_encode": "4n read x + 4*blocks*keep write coeffs",
    "dct_decode": "4*blocks*keep read coeffs + 4n write x_hat",
    "dct_encode + quantize": "4n read x + 1*blocks*keep write q + 4*blocks write scale "
                             "(the pipeline's end-to-end traffic)",
}


# ------------------------------------------------------------------------------- timing
@dataclasses.dataclass(frozen=True)
class TimingPolicy:
    warmup: int
    max_repeats: int
    min_repeats: int = 3
    budget_s: float = 2.0  # stop repeating after this long once min_repeats are done


FULL_TIMING = TimingPolicy(warmup=3, max_repeats=25)
QUICK_TIMING = TimingPolicy(warmup=1, max_repeats=7, budget_s=1.0)
CUDA_TIMING = TimingPolicy(warmup=5, max_repeats=50, min_repeats=10, budget_s=0.3)
timing = FULL_TIMING  # set once by main()
device = torch.device("cpu")  # set once by main()


def timed_call_ms(fn: Callable[[], object], setup: Optional[Callable[[], object]]) -> float:
    """One call of ``fn`` in milliseconds; on CUDA between two events on the current stream
    (``setup`` is queued before the first event, so it is not counted)."""
    if setup is not None:
        setup()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1e3


GRAPH_CALLS = 20  # calls of one kernel captured back to back into one CUDA graph


def measure_gpu_time(fn: Callable[[], object],
                     setup: Optional[Callable[[], object]] = None) -> Optional[float]:
    """CUDA only: the GPU's time for one call of ``fn`` without the host's, in milliseconds:
    GRAPH_CALLS calls captured into one CUDA graph, whose replay (one launch) ``measure``
    times, divided by GRAPH_CALLS. ``measure`` times single calls, so where a call's host work
    (Python, the op's checks, allocation, launch) outlasts its kernels it measures the host.
    ``setup`` runs once before the capture; calls that mutate their input repeat on the mutated
    values, which moves the same bytes. None where the call cannot be captured."""
    if device.type != "cuda":
        return None
    if setup is not None:
        setup()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):  # warm up on the capturing stream (per-stream caches)
            for _ in range(3):
                fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                fn()
    except RuntimeError as error:  # a call that synchronises cannot be captured
        print(f"  (not captured: {str(error).splitlines()[0][:100]})")
        return None
    torch.cuda.current_stream().wait_stream(stream)
    return measure(graph.replay) / GRAPH_CALLS


def measure(fn: Callable[[], object], setup: Optional[Callable[[], object]] = None) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    ``setup`` (if given) runs before every call, warm-up calls included, outside the timed
    region: it restores inputs that ``fn`` mutates.
    """
    budget_ms = timing.budget_s * 1e3
    warmup_spent = 0.0
    for _ in range(timing.warmup):
        warmup_spent += timed_call_ms(fn, setup)
        if warmup_spent > budget_ms:  # one warm-up is enough for a multi-second call
            break
    samples: List[float] = []
    while len(samples) < timing.max_repeats:
        samples.append(timed_call_ms(fn, setup))
        if len(samples) >= timing.min_repeats and sum(samples) > budget_ms:
            break
    return statistics.median(samples)


# ---------------------------------------------------------------------------- results
@dataclasses.dataclass
class Row:
    kernel: str
    config: str
    numel: int
    bytes: int
    reference_ms: float
    compiled_ms: float
    speedup: float = 0.0
    compiled_gbps: float = 0.0
    pct_of_copy: float = 0.0
    topk_ms: Optional[float] = None
    speedup_vs_topk: Optional[float] = None
    gpu_ms: Optional[float] = None  # CUDA: the kernels' own time per call (measure_gpu_time)
    gpu_pct_of_copy: Optional[float] = None

    def __post_init__(self) -> None:
        self.speedup = self.reference_ms / self.compiled_ms
        self.compiled_gbps = gbps(self.bytes, self.compiled_ms)
        self.pct_of_copy = 100.0 * self.compiled_gbps / copy_bandwidth_gbps
        if self.topk_ms is not None:
            self.speedup_vs_topk = self.topk_ms / self.compiled_ms
        if self.gpu_ms is not None:
            self.gpu_pct_of_copy = 100.0 * gbps(self.bytes, self.gpu_ms) / copy_bandwidth_gbps


copy_bandwidth_gbps = float("nan")  # set once by main(), before any Row is made
extra_results: dict = {}  # measurements that are not kernel rows, saved with --json


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def measure_copy_bandwidth(numel: int) -> dict:
    src = torch.randn(numel)
    if device.type == "cuda":  # the caching allocator hands clone the same block every time
        ms = measure(lambda: torch.clone(src))
        return {"numel": numel, "ms": ms, "gbps": gbps(8 * numel, ms), "how": "torch.clone(src)"}
    dst = torch.zeros(numel)  # zero_ touches every page: no page faults in the timed copies
    ms = measure(lambda: dst.copy_(src))
    return {"numel": numel, "ms": ms, "gbps": gbps(8 * numel, ms), "how": "dst.copy_(src)"}


def compare(kernel: str, config: str, numel: int, nbytes: int, reference_fn, compiled_fn,
            setup=None, topk_fn=None) -> Row:
    """Time the reference and the compiled kernel (and optionally torch.topk) on one case."""
    return Row(kernel, config, numel, nbytes,
               reference_ms=measure(reference_fn, setup),
               compiled_ms=measure(compiled_fn, setup),
               topk_ms=None if topk_fn is None else measure(topk_fn),
               gpu_ms=measure_gpu_time(compiled_fn, setup))


# ---------------------------------------------------------------------------- output
def count_label(count: int) -> str:
    for unit, name in ((1_000_000, "M"), (1_000, "K")):
        if count >= unit and count % unit == 0:
            return f"{count // unit}{name}"
    return str(count)


def speedup_label(ratio: Optional[float]) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


STANDARD_COLUMNS = (
    ("reference ms", lambda r: f"{r.reference_ms:.3f}"),
    ("compiled ms", lambda r: f"{r.compiled_ms:.3f}"),
    ("speedup", lambda r: speedup_label(r.speedup)),
    ("compiled GB/s", lambda r: f"{r.compiled_gbps:.1f}"),
    ("% of copy", lambda r: f"{r.pct_of_copy:.0f}%"),
)
GPU_TIME_COLUMNS = (
    ("GPU-only ms", lambda r: "-" if r.gpu_ms is None else f"{r.gpu_ms:.3f}"),
    ("GPU-only % of copy",
     lambda r: "-" if r.gpu_pct_of_copy is None else f"{r.gpu_pct_of_copy:.0f}%"),
)
TOPK_COLUMNS = (
    ("topk ms", lambda r: f"{r.topk_ms:.3f}"),
    ("vs topk", lambda r: speedup_label(r.speedup_vs_topk)),
)


def print_table(title: str, rows: Sequence[Row], notes: Sequence[str] = (),
                extra_columns=()) -> None:
    """One table for one kernel; the header line states its byte model."""
    notes = [f"bytes = {BYTE_MODELS[rows[0].kernel]}", *notes]
    gpu_columns = GPU_TIME_COLUMNS if any(r.gpu_ms is not None for r in rows) else ()
    columns = ((("configuration", lambda r: r.config),) + STANDARD_COLUMNS + gpu_columns
               + tuple(extra_columns))
    cells = [[render(row) for _, render in columns] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in cells))
              for i, (header, _) in enumerate(columns)]

    def line(values) -> str:  # first column left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths)))

    print(f"\n{title}")
    for note in notes:
        print(f"  {note}")
    print(line([header for header, _ in columns]))
    print(line(["-" * w for w in widths]))
    for values in cells:
        print(line(values))


# ------------------------------------------------------------------------- benchmarks
def bench_segment_accumulate(sizes: Sequence[int]) -> List[Row]:
    rows = []
    for numel in sizes:
        residual = torch.randn(numel)
        for grad_dtype in (torch.float32, torch.bfloat16):
            grad = torch.randn(numel).to(grad_dtype)
            for segment_size in (256, 4096):
                # residual keeps growing by grad on every call: same work, finite values.
                config = (f"n={count_label(numel)} grad={str(grad_dtype)[6:]} "
                          f"seg={segment_size}")
                nbytes = (4 + grad.element_size() + 4) * numel
                rows.append(compare(
                    "segment_accumulate_", config, numel, nbytes,
                    lambda: reference.segment_accumulate_(residual, grad, segment_size),
                    lambda: ops.segment_accumulate_(residual, grad, segment_size)))
    print_table("segment_accumulate_(residual, grad, segment_size)  [in place]", rows)
    return rows


# What the hooks select among: one DDP bucket of 25 MB (6.5M float32) in segments of 512, and a
# whole 25M-parameter model's gradient.
HOOK_SEGMENT_COUNTS = (12_800, 49_152)


def bench_select_segments(sizes: Sequence[int]) -> List[Row]:
    rows = []
    for count in sorted(set(HOOK_SEGMENT_COUNTS) | set(sizes)):
        k = max(1, count // 100)
        vectors = (("rand", torch.rand(count)),
                   ("ties 0..99", torch.randint(0, 100, (count,)).float()))
        for name, importance in vectors:
            config = f"S={count_label(count)} {name} k={count_label(k)}"
            rows.append(compare(
                "select_segments", config, count, 4 * count,
                lambda: reference.select_segments(importance, k),
                lambda: ops.select_segments(importance, k),
                topk_fn=lambda: torch.topk(importance, k)))
    print_table("select_segments(importance, k)  [k = 1% of S; output allocated]", rows,
                ["topk = torch.topk(importance, k); 'vs topk' = topk ms / compiled ms"],
                TOPK_COLUMNS)
    return rows


def random_segment_indices(segments: int, k: int) -> torch.Tensor:
    return torch.randperm(segments)[:k].sort().values


def segment_cases(sizes: Sequence[int], segment_size: int):
    """(n, density, selected indices, the original residual, a residual to work on) at 1% and
    10% of the segments of each size."""
    for numel in sizes:
        segments = ops.num_segments(numel, segment_size)
        original = torch.randn(numel)
        residual = original.clone()
        for density in (0.01, 0.10):
            yield numel, density, random_segment_indices(segments, max(1, round(density * segments))), \
                original, residual


def bench_pack_unpack(sizes: Sequence[int], segment_size: int = 256) -> List[Row]:
    pack_rows, unpack_rows = [], []
    for numel, density, indices, original, residual in segment_cases(sizes, segment_size):
        k = indices.numel()
        packed_numel = k * segment_size
        config = (f"n={count_label(numel)} seg={segment_size} "
                  f"k={density:.0%} ({k} segments)")

        # pack zeroes the selected segments: restore them before every call.
        packed = torch.zeros(packed_numel)
        restore = lambda: residual.copy_(original)  # noqa: E731
        pack_rows.append(compare(
            "pack_segments_", config, numel, 3 * 4 * packed_numel,
            lambda: reference.pack_segments_(residual, indices, segment_size, out=packed),
            lambda: ops.pack_segments_(residual, indices, segment_size, out=packed),
            setup=restore))

        unpacked = torch.zeros(numel)
        scale = 0.5  # e.g. 1 / world_size
        unpack_rows.append(compare(
            "unpack_segments", config, numel, 4 * packed_numel + 4 * numel,
            lambda: reference.unpack_segments(packed, indices, segment_size, numel, scale,
                                              out=unpacked),
            lambda: ops.unpack_segments(packed, indices, segment_size, numel, scale,
                                        out=unpacked)))
    print_table("pack_segments_(residual, indices, segment_size, out=packed)  "
                "[out= preallocated float32, compiled and reference; residual restored "
                "outside the timed region]", pack_rows)
    print_table("unpack_segments(packed, indices, segment_size, n, scale=0.5, out=flat)  "
                "[out= preallocated float32, compiled and reference]", unpack_rows)
    return pack_rows + unpack_rows


def unfused_pack_quantized(residual, indices, segment_size, scale, numel, buffers):
    """What the int8 wire did before pack_quantized_segments_, with the compiled ops: pack
    (zeroing), quantize, dequantize, subtract, and add the error back through a full-size
    unpack (the n-sized passes the fused kernel removes)."""
    values, q, rounded, left = buffers
    k = indices.numel()
    ops.pack_segments_(residual, indices, segment_size, out=values)
    ops.quantize(values.view(k, segment_size), scale, QUANT_LEVELS, torch.int8, out=q.view(k, segment_size))
    values.view(k, segment_size).sub_(ops.dequantize(q.view(k, segment_size), scale, QUANT_LEVELS,
                                                     out=rounded.view(k, segment_size)))
    residual.add_(ops.unpack_segments(values, indices, segment_size, numel, out=left))


def bench_pack_quantized(sizes: Sequence[int], segment_size: int = 512) -> List[Row]:
    rows, unfused = [], []
    for numel, density, indices, original, residual in segment_cases(sizes, segment_size):
        k = indices.numel()
        scale = torch.rand(k) * 2 + 1
        packed_numel = k * segment_size
        config = f"n={count_label(numel)} seg={segment_size} k={density:.0%} int8"
        packed = torch.zeros(packed_numel, dtype=torch.int8)
        restore = lambda: residual.copy_(original)  # noqa: E731
        rows.append(compare(
            "pack_quantized_segments_", config, numel, 9 * packed_numel,
            lambda: reference.pack_quantized_segments_(residual, indices, segment_size, scale,
                                                       QUANT_LEVELS, torch.int8, out=packed),
            lambda: ops.pack_quantized_segments_(residual, indices, segment_size, scale,
                                                 QUANT_LEVELS, torch.int8, out=packed),
            setup=restore))
        buffers = (torch.empty(packed_numel), torch.empty(packed_numel, dtype=torch.int8),
                   torch.empty(packed_numel), torch.empty(numel))
        unfused_ms = measure(lambda: unfused_pack_quantized(residual, indices, segment_size, scale,
                                                            numel, buffers), setup=restore)
        fused_ms = rows[-1].compiled_ms
        unfused.append(f"{config}: {unfused_ms:.3f} ms ({unfused_ms / fused_ms:.1f}x the fused kernel)")
        extra_results.setdefault("pack_quantized_unfused", []).append(
            {"config": config, "unfused_ms": unfused_ms, "fused_ms": fused_ms})
    print_table(f"pack_quantized_segments_(residual, indices, segment_size, scale, levels={QUANT_LEVELS}, "
                "int8, out=packed)  [out= preallocated, compiled and reference; residual restored "
                "outside the timed region]", rows,
                ["the unfused compiled ops it replaces in the int8 wire (pack, quantize, dequantize, "
                 "subtract, full-size unpack + add): " + "; ".join(unfused)])
    return rows


def block_scale(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(dim=1)


def bench_quantize(sizes: Sequence[int], row_len: int = 64) -> List[Row]:
    quantize_rows, dequantize_rows, cast_floor = [], [], []
    for numel in sizes:
        x = torch.randn(numel // row_len, row_len)
        scale = block_scale(x)
        numel, num_blocks = x.numel(), x.shape[0]
        q = torch.empty(x.shape, dtype=torch.int8)
        x_hat = torch.empty(x.shape)
        config = f"n={count_label(numel)} [{num_blocks}, {row_len}] int8"
        quantize_rows.append(compare(
            "quantize", config, numel, 4 * numel + 4 * num_blocks + numel,
            lambda: reference.quantize(x, scale, QUANT_LEVELS, torch.int8, out=q),
            lambda: ops.quantize(x, scale, QUANT_LEVELS, torch.int8, out=q)))
        # The floor of any float32 -> int8 kernel on this machine: torch's own cast copy.
        cast_ms = measure(lambda: q.copy_(x))
        cast_floor.append(f"{count_label(numel)}: {cast_ms:.3f} ms, "
                          f"{gbps(5 * numel, cast_ms):.1f} GB/s")
        extra_results.setdefault("quantize_cast_floor", []).append(
            {"numel": numel, "ms": cast_ms, "gbps": gbps(5 * numel, cast_ms)})
        dequantize_rows.append(compare(
            "dequantize", config, numel, numel + 4 * num_blocks + 4 * numel,
            lambda: reference.dequantize(q, scale, QUANT_LEVELS, out=x_hat),
            lambda: ops.dequantize(q, scale, QUANT_LEVELS, out=x_hat)))
    print_table(f"quantize(x, scale=|x|.amax(1), levels={QUANT_LEVELS}, int8, out=q)  "
                "[out= preallocated, compiled and reference]", quantize_rows,
                ["floor: torch's plain float32 -> int8 cast, q.copy_(x), same bytes: "
                 + "; ".join(cast_floor)])
    print_table(f"dequantize(q, scale, levels={QUANT_LEVELS}, out=x_hat)  "
                "[out= preallocated, compiled and reference]", dequantize_rows)
    return quantize_rows + dequantize_rows


def encode_and_quantize(encode, quantize, x, block_size, keep, coeffs, q):
    encode(x, block_size, keep, out=coeffs)
    return quantize(coeffs, block_scale(coeffs), QUANT_LEVELS, torch.int8, out=q)


def bench_dct(sizes: Sequence[int]) -> List[Row]:
    encode_rows, decode_rows, pipeline_rows = [], [], []
    for numel in sizes:
        x = torch.randn(numel)
        x_hat = torch.empty(numel)
        for block_size, keep in DCT_CONFIGS:
            blocks = ops.num_segments(numel, block_size)
            coeffs = torch.empty(blocks, keep)
            q = torch.empty(blocks, keep, dtype=torch.int8)
            config = f"n={count_label(numel)} B={block_size} keep={keep}"
            encode_rows.append(compare(
                "dct_encode", config, numel, 4 * numel + 4 * blocks * keep,
                lambda: reference.dct_encode(x, block_size, keep, out=coeffs),
                lambda: ops.dct_encode(x, block_size, keep, out=coeffs)))
            decode_rows.append(compare(
                "dct_decode", config, numel, 4 * blocks * keep + 4 * numel,
                lambda: reference.dct_decode(coeffs, block_size, numel, out=x_hat),
                lambda: ops.dct_decode(coeffs, block_size, numel, out=x_hat)))
            pipeline_rows.append(compare(
                "dct_encode + quantize", config, numel, 4 * numel + blocks * keep + 4 * blocks,
                lambda: encode_and_quantize(reference.dct_encode, reference.quantize,
                                            x, block_size, keep, coeffs, q),
                lambda: encode_and_quantize(ops.dct_encode, ops.quantize,
                                            x, block_size, keep, coeffs, q)))
    print_table("dct_encode(x, block_size, keep, out=coeffs)  [out= preallocated, both]", encode_rows)
    print_table("dct_decode(coeffs, block_size, n, out=x_hat)  [out= preallocated, both]", decode_rows)
    print_table(f"dct_encode + quantize (scale = |coeffs|.amax(1), levels={QUANT_LEVELS}, int8, "
                "out= preallocated)", pipeline_rows,
                ["both columns use torch's abs().amax(1) for the scale"])
    extra_results["dct_grouped"] = dct_grouped_layout(sizes)
    return encode_rows + decode_rows + pipeline_rows


def dct_grouped_layout(sizes: Sequence[int], block_size: int = 64, group: int = 512) -> List[dict]:
    """The AdamW recipe's transform (B=64, all 64 kept, segments of one frequency of 512
    blocks): the grouped layout written by the kernel, against the plain layout followed by
    the copy that interleaves it (what the hook did before the kernels wrote the grouped one)."""
    results = []
    for numel in sizes:
        x, x_hat = torch.randn(numel), torch.empty(numel)
        blocks = ops.num_segments(numel, block_size)
        groups = ops.num_segments(blocks, group)
        grouped = torch.empty(groups, block_size, group)
        plain = torch.zeros(groups * group, block_size)  # padding rows stay zero

        def encode_then_interleave():
            ops.dct_encode(x, block_size, block_size, out=plain[:blocks])
            grouped.copy_(plain.view(groups, group, block_size).transpose(1, 2))

        def deinterleave_then_decode():
            plain.view(groups, group, block_size).copy_(grouped.transpose(1, 2))
            ops.dct_decode(plain[:blocks], block_size, numel, out=x_hat)

        results.append(dict(
            numel=numel,
            encode_then_interleave_ms=measure(encode_then_interleave),
            encode_grouped_ms=measure(lambda: ops.dct_encode(x, block_size, block_size, group, out=grouped)),
            deinterleave_then_decode_ms=measure(deinterleave_then_decode),
            decode_grouped_ms=measure(lambda: ops.dct_decode(grouped, block_size, numel, out=x_hat))))
    print(f"\ndct in the sparse hook's grouped layout (B={block_size}, keep={block_size}, group={group}): "
          "the kernel writing it, against the plain layout and a copy (the hook's earlier path)")
    print(f"{'n':>6}  {'encode+copy ms':>14}  {'grouped ms':>10}  {'speedup':>7}  "
          f"{'copy+decode ms':>14}  {'grouped ms':>10}  {'speedup':>7}")
    for r in results:
        print(f"{count_label(r['numel']):>6}  {r['encode_then_interleave_ms']:>14.3f}  "
              f"{r['encode_grouped_ms']:>10.3f}  "
              f"{speedup_label(r['encode_then_interleave_ms'] / r['encode_grouped_ms']):>7}  "
              f"{r['deinterleave_then_decode_ms']:>14.3f}  {r['decode_grouped_ms']:>10.3f}  "
              f"{speedup_label(r['deinterleave_then_decode_ms'] / r['decode_grouped_ms']):>7}")
    return results


def dct_accuracy(block_sizes=(64, 256, 1024, 4096), blocks: int = 512) -> List[dict]:
    """Max abs error of the compiled DCT against a float64 computation, unit-variance data."""
    results = []
    for block_size in block_sizes:
        x = torch.randn(block_size * blocks, generator=torch.Generator("cpu").manual_seed(block_size),
                        device="cpu").to(device)
        n = torch.arange(block_size, dtype=torch.float64, device="cpu")
        exact_basis = torch.cos(torch.pi * (2 * n + 1) * n.view(-1, 1) / (2 * block_size))
        exact_basis *= (2.0 / block_size) ** 0.5
        exact_basis[0] /= 2 ** 0.5
        exact = x.double().view(blocks, block_size) @ exact_basis.T.to(device)
        encode_error = (ops.dct_encode(x, block_size, block_size).double() - exact).abs().max()
        decoded = ops.dct_decode(exact.float(), block_size, x.numel()).double()
        decode_error = (decoded - x.double()).abs().max()
        results.append({"block_size": block_size, "encode_max_error": float(encode_error),
                        "decode_max_error": float(decode_error),
                        "tested_bound": 3e-7 * block_size + 2e-6})
    print("\ndct accuracy: max abs error of the compiled kernels against float64, unit-variance data "
          f"({blocks} blocks); the tests assert the bound 3e-7 * B + 2e-6")
    print(f"  {'block size':>10}  {'encode':>9}  {'decode':>9}  {'bound':>9}")
    for r in results:
        print(f"  {r['block_size']:>10}  {r['encode_max_error']:>9.2e}  {r['decode_max_error']:>9.2e}"
              f"  {r['tested_bound']:>9.2e}")
    return results


# ------------------------------------------------------------------------------- aims
@dataclasses.dataclass(frozen=True)
class Aim:
    kernel: str
    metric: str          # a Row field: pct_of_copy, speedup or speedup_vs_topk
    threshold: float
    largest_size_only: bool  # bandwidth aims: judged where the copy bandwidth was measured
    strictly_greater: bool = False
    min_bytes: int = 0   # judged only on rows that move at least this many bytes
    configs: Tuple[str, ...] = ()  # judged only on rows whose configuration contains one of these

    def describe(self) -> str:
        unit = {"pct_of_copy": "% of copy bandwidth", "speedup": "x its reference",
                "speedup_vs_topk": "x torch.topk",
                "gpu_pct_of_copy": "% of copy bandwidth in GPU time"}[self.metric]
        relation = ">" if self.strictly_greater else ">="
        where = f" ({', '.join(self.configs)})" if self.configs else ""
        rows = f" on rows of {self.min_bytes:,} bytes or more" if self.min_bytes else ""
        return f"{self.kernel}{where} {relation} {self.threshold:g}{unit}{rows}"

    def judges(self, row: Row, largest_size: int) -> bool:
        return (row.kernel == self.kernel and row.bytes >= self.min_bytes
                and (not self.largest_size_only or row.numel == largest_size)
                and (not self.configs or any(c in row.config for c in self.configs)))


CPU_AIMS = (
    Aim("segment_accumulate_", "pct_of_copy", 80, largest_size_only=True),
    Aim("segment_accumulate_", "speedup", 1.5, largest_size_only=False),
    # Set on S >= 1M; at the hooks' 10K-50K segments both selections take microseconds.
    Aim("select_segments", "speedup_vs_topk", 20, largest_size_only=False, min_bytes=4_000_000),
    Aim("pack_segments_", "pct_of_copy", 70, largest_size_only=True),
    Aim("unpack_segments", "pct_of_copy", 70, largest_size_only=True),
    Aim("pack_quantized_segments_", "pct_of_copy", 70, largest_size_only=True),
    Aim("quantize", "pct_of_copy", 70, largest_size_only=True),
    Aim("dequantize", "pct_of_copy", 70, largest_size_only=True),
    Aim("dct_encode + quantize", "speedup", 1.0, largest_size_only=False, strictly_greater=True),
)
# Issue 35: every streaming kernel at 70% of the device's copy on rows of 16 MB and more
# (the DCT at the block sizes the hooks use), selection no slower than torch.topk.
SIXTEEN_MB = 16 * 1024 * 1024
RECIPE_DCT = ("B=64 keep=64", "B=256 keep=32")
CUDA_AIMS = (
    Aim("segment_accumulate_", "pct_of_copy", 70, largest_size_only=False, min_bytes=SIXTEEN_MB),
    Aim("select_segments", "speedup_vs_topk", 1.0, largest_size_only=False),
    *(Aim(kernel, "pct_of_copy", 70, largest_size_only=False, min_bytes=SIXTEEN_MB)
      for kernel in ("pack_segments_", "unpack_segments", "pack_quantized_segments_", "quantize",
                     "dequantize")),
    *(Aim(kernel, "pct_of_copy", 70, largest_size_only=False, min_bytes=SIXTEEN_MB,
          configs=RECIPE_DCT) for kernel in ("dct_encode", "dct_decode")),
)
# The same bandwidth aims on the kernels' own GPU time (measure_gpu_time): where a row misses
# the aim per call but meets it here, the host's work per call is what is slow, not the kernel.
CUDA_AIMS += tuple(dataclasses.replace(aim, metric="gpu_pct_of_copy")
                   for aim in CUDA_AIMS if aim.metric == "pct_of_copy")


def evaluate_aims(rows: Sequence[Row], largest_size: int) -> List[dict]:
    """Judge each aim on its worst row among the rows it covers."""
    results = []
    for aim in CUDA_AIMS if device.type == "cuda" else CPU_AIMS:
        candidates = [r for r in rows
                      if aim.judges(r, largest_size) and getattr(r, aim.metric) is not None]
        if not candidates:
            continue
        worst = min(candidates, key=lambda r: getattr(r, aim.metric))
        value = getattr(worst, aim.metric)
        met = value > aim.threshold if aim.strictly_greater else value >= aim.threshold
        results.append({"aim": aim.describe(), "metric": aim.metric, "value": value,
                        "worst_config": worst.config, "met": met})
    return results


def print_aims(results: Sequence[dict], largest_size: int) -> None:
    if device.type == "cuda":
        print("\naims (worst case; bandwidth aims judged on every row that moves 16 MB or more, "
              "selection over all sizes)")
    else:
        print(f"\naims (worst case; bandwidth aims judged at n={count_label(largest_size)}, where "
              "the copy bandwidth was measured; speedup aims over all sizes)")
    width = max(len(r["aim"]) for r in results)
    for r in results:
        value = (f"{r['value']:.0f}%" if r["metric"].endswith("pct_of_copy")
                 else speedup_label(r["value"]))
        verdict = "met" if r["met"] else "NOT MET"
        print(f"  {r['aim'].ljust(width)}  {value:>7}  {verdict:<7}  ({r['worst_config']})")


# ------------------------------------------------------------------------------- main
FAMILIES = {"accumulate": bench_segment_accumulate, "select": bench_select_segments,
            "pack": bench_pack_unpack, "pack_quantized": bench_pack_quantized,
            "quantize": bench_quantize, "dct": bench_dct}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    multiplier = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if multiplier != 1 else text
    size = int(float(number) * multiplier)
    if size < 256:
        raise argparse.ArgumentTypeError(f"sizes must be >= 256 elements; got {text}")
    return size


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="sizes 1M and 4M, fewer repeats")
    parser.add_argument("--sizes", type=lambda s: [parse_size(p) for p in s.split(",")],
                        help="comma-separated element counts, e.g. 1M,4M,25M (overrides "
                             "the default sizes)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads(N) (default: "
                                                    "leave torch's setting)")
    parser.add_argument("--json", metavar="PATH", help="save every number to PATH")
    parser.add_argument("--only", choices=sorted(FAMILIES), help="run one kernel family's tables")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (cuda: the first GPU, default sizes "
                             "4M, 25M, 100M)")
    return parser.parse_args(argv)


def backend_error(args) -> Optional[str]:
    """Why the benchmark cannot run on ``args.device``, or None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but torch sees no CUDA device"
    backend = hetero_comm.kernel_backend(args.device)
    if backend != "compiled":
        return (f"hetero_comm's {args.device} kernel backend is {backend!r}, not 'compiled' "
                f"(load error: {hetero_comm.extension_load_error()}). Build the extension first (e.g. "
                "`pip install --no-build-isolation -e .`); benchmarking the reference "
                "against itself is meaningless.")
    return None


def print_header(where: str, sizes: Sequence[int], quick: bool, copy: dict) -> float:
    """The run's settings and the copy bandwidth; returns the 1-minute load average."""
    print(f"hetero_comm kernel benchmark: torch {torch.__version__}, {where}, backend compiled, "
          f"sizes {', '.join(count_label(s) for s in sizes)}{', quick' if quick else ''}")
    print(f"copy bandwidth: {copy['gbps']:.1f} GB/s ({copy['how']}, "
          f"{count_label(sizes[-1])} float32 preallocated, bytes = read + write, "
          f"median {copy['ms']:.3f} ms)")
    load_1min = os.getloadavg()[0]
    if load_1min > os.cpu_count():
        print(f"warning: load average {load_1min:.1f} on {os.cpu_count()} cores: other "
              "processes compete for the CPU and memory bus, the numbers are unreliable")
    print(f"times: median of up to {timing.max_repeats} repeats after {timing.warmup} warm-up "
          f"call(s), at least {timing.min_repeats}, ~{timing.budget_s:g} s cap per measurement. "
          "Sizes that fit in cache may exceed 100% of copy bandwidth.")
    return load_1min


def main(argv=None) -> int:
    global timing, copy_bandwidth_gbps, device
    args = parse_args(argv)
    error = backend_error(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timing = CUDA_TIMING if device.type == "cuda" else QUICK_TIMING if args.quick else FULL_TIMING
    default_sizes = CUDA_SIZES if device.type == "cuda" else QUICK_SIZES if args.quick else FULL_SIZES
    sizes = sorted(set(args.sizes or default_sizes))
    torch.set_default_device(device)  # every tensor the benchmarks make lives there
    torch.manual_seed(0)

    started = time.perf_counter()
    copy = measure_copy_bandwidth(sizes[-1])
    copy_bandwidth_gbps = copy["gbps"]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    load_1min = print_header(where, sizes, args.quick, copy)

    rows: List[Row] = []
    for family, bench in FAMILIES.items():
        if args.only in (None, family):
            rows += bench(sizes)
    if args.only in (None, "dct"):
        extra_results["dct_accuracy"] = dct_accuracy()

    aims = evaluate_aims(rows, sizes[-1])
    print_aims(aims, sizes[-1])
    # A shared machine drifts: a second copy measurement shows how far the baseline moved.
    copy_at_end = measure_copy_bandwidth(sizes[-1])
    print(f"\ncopy bandwidth re-measured at the end: {copy_at_end['gbps']:.1f} GB/s "
          f"(start: {copy['gbps']:.1f} GB/s; percentages use the start value)")
    elapsed = time.perf_counter() - started
    print(f"total benchmark time: {elapsed:.0f} s")
    if args.json:
        report = dict(torch_version=torch.__version__, device=where, threads=torch.get_num_threads(),
                      sizes=sizes, quick=args.quick, copy_bandwidth=copy, copy_bandwidth_at_end=copy_at_end,
                      load_average_1min_at_start=load_1min, byte_models=BYTE_MODELS,
                      rows=[dataclasses.asdict(r) for r in rows], aims=aims, **extra_results,
                      elapsed_s=elapsed)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
