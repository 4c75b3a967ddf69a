"""What one call of each sparse-codec kernel costs on a small bucket, alone (no DDP, no other
thread): the floor under the hook's host time per bucket (docs/design/hooks.md).

A bucket of ``--numel`` float32 values in segments of ``--segment`` (the elements basis, the
int8 wire, 10% of the segments), and the same with the DCT basis (blocks of 64 in groups of
``--dct-segment``; by default all blocks in one group, as the AdamW recipe cuts a bucket this
small);
each call's median over ``--calls`` calls, with a dense ``dist.all_reduce`` of the importance
on a world size 1 gloo group beside them.

    python benchmarks/bench_codec_calls.py [--numel 4160] [--segment 16] [--dct-segment 65]
        [--calls 2000]
"""

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist

import hetero_comm
from hetero_comm import ops
from hetero_comm._layout import dct_coeffs_shape


def median_us(call, calls: int) -> float:
    for _ in range(50):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def rows(numel: int, segment: int, block: int, calls: int) -> dict:
    residual, grad = torch.randn(numel), torch.randn(numel)
    coefficients = torch.empty(dct_coeffs_shape(numel, block, block, segment)) if block else None
    count = coefficients.shape[0] * block if block else -(-numel // segment)
    k = max(1, count // 10)
    importance, indices = torch.empty(count), torch.empty(k, dtype=torch.int64)
    wire, scale = torch.empty(k * segment, dtype=torch.int8), torch.empty(k)

    def encode():
        ops.sparse_encode_(residual, grad, segment, importance, block_size=block,
                           coefficients=coefficients)

    def pack():
        ops.sparse_pack_(residual, importance, segment, indices, wire, block_size=block,
                         coefficients=coefficients, levels=63, scale=scale, scale_factor=0.5)

    def unpack():
        ops.sparse_unpack_(wire, indices, segment, grad, levels=63, scale=scale, block_size=block,
                           coefficients=coefficients)

    encode()
    pack()
    return {"sparse_encode_": median_us(encode, calls), "sparse_pack_": median_us(pack, calls),
            "sparse_unpack_": median_us(unpack, calls),
            "dist.all_reduce (importance)": median_us(lambda: dist.all_reduce(importance), calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4160)
    parser.add_argument("--segment", type=int, default=16)
    parser.add_argument("--dct-segment", type=int, default=None,
                        help="blocks a DCT group (default: every block of the bucket)")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with socket.socket() as probe:  # a free port on the loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    print(f"codec calls: torch {torch.__version__}, kernels {hetero_comm.kernel_backend('cpu')}, "
          f"{torch.get_num_threads()} threads; a bucket of {args.numel} values, median us a call")
    elements = rows(args.numel, args.segment, 0, args.calls)
    dct = rows(args.numel, args.dct_segment or -(-args.numel // 64), 64, args.calls)
    print(f"  {'call':<30} {'elements, int8':>15} {'DCT 64, int8':>13}")
    for name in elements:
        print(f"  {name:<30} {elements[name]:>15.1f} {dct[name]:>13.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
