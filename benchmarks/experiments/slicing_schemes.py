"""Ways to compute a Linear layer whose output rows and input columns are half dropped (the
middle layer of bench_dropout.py's MLP), forward + backward, one thread, median ms:
``masked`` (the full matmul on masked inputs), ``two_index`` (SlicedLinear's: index_select
rows, then columns), ``rows_only`` (rows sliced, inputs masked), ``cols_first``, ``advanced``
(one advanced-index gather). Results: benchmarks/results/slicing_schemes.txt.

Usage: python benchmarks/experiments/slicing_schemes.py
"""

import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int = 30) -> float:
    times = []
    for i in range(repeats + 5):
        began = time.perf_counter()
        fn()
        if i >= 5:
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def schemes(hidden: int, batch: int) -> dict:
    weight = torch.randn(hidden, hidden, requires_grad=True)
    bias = torch.randn(hidden, requires_grad=True)
    x = torch.randn(batch, hidden)
    rows = torch.randperm(hidden)[: hidden // 2].sort().values
    cols = torch.randperm(hidden)[: hidden // 2].sort().values
    mask = torch.zeros(hidden)
    mask[cols] = 2.0

    def finish(y):
        out = x.new_zeros(batch, hidden).index_copy(-1, rows, y)
        out.sum().backward()
        weight.grad = bias.grad = None

    def masked():
        F.linear(x * mask, weight, bias).sum().backward()
        weight.grad = bias.grad = None

    def two_index():
        finish(F.linear(x.index_select(1, cols), weight.index_select(0, rows).index_select(1, cols),
                        bias.index_select(0, rows)))

    def rows_only():
        finish(F.linear(x * mask, weight.index_select(0, rows), bias.index_select(0, rows)))

    def cols_first():
        finish(F.linear(x.index_select(1, cols), weight.index_select(1, cols).index_select(0, rows),
                        bias.index_select(0, rows)))

    def advanced():
        finish(F.linear(x.index_select(1, cols), weight[rows.unsqueeze(1), cols], bias.index_select(0, rows)))

    return {fn.__name__: median_ms(fn) for fn in (masked, two_index, rows_only, cols_first, advanced)}


def main() -> None:
    torch.set_num_threads(1)
    print("python benchmarks/experiments/slicing_schemes.py")
    for hidden, batch in ((1024, 32), (1024, 256), (2048, 32)):
        cells = ", ".join(f"{name} {ms:.3f}" for name, ms in schemes(hidden, batch).items())
        print(f"hidden {hidden} batch {batch}: {cells}", flush=True)


if __name__ == "__main__":
    main()
