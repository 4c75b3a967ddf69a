"""Issue 35 bug 1: which build step makes a rejected call with a number in its message crash?

On the GPU machine (torch with CUDA, nvcc, g++), from the repository root::

    python3 benchmarks/gpu_bisect_numeric_error.py [--out DIR]

Builds small extensions with ``torch.utils.cpp_extension.load`` (several at once), each
registering one op whose only statement is ``TORCH_CHECK(false, "n = ", t.numel())``, and
calls each op in a fresh process. The variants change one thing at a time from the standard
build: the compiler of the check (g++ for a .cpp, nvcc's host pass for a .cu), this project's
compile and link flags, ``-static-libstdc++``, the C++ ABI macro, and last this project's own
sources under plain and project flags. One line per variant: whether the call raised (as it
must) or which signal killed the process.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]

CHECK_BODY = """
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

int64_t reject(const at::Tensor& t) {
  TORCH_CHECK(false, "n = ", t.numel());
  return 0;
}

TORCH_LIBRARY(bisect, m) { m.def("reject(Tensor t) -> int", &reject); }
"""

KERNEL = """
__global__ void touch(float* x) { x[threadIdx.x] += 1.0f; }
void launch_touch(float* x) { touch<<<1, 32>>>(x); }
"""


def project_flags():
    """setup.py's compile flags and link arguments, read from its source."""
    tree = ast.parse((REPO / "setup.py").read_text())
    libstdcxx = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and getattr(node.targets[0], "id", "") == "LIBSTDCXX_LINK_ARGS")
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    return cxx, ["-fopenmp", *libstdcxx]


def variants(work: pathlib.Path):
    cxx, link = project_flags()
    check_cpp = work / "check.cpp"
    check_cu = work / "check.cu"
    kernel_cu = work / "kernel.cu"
    check_cpp.write_text(CHECK_BODY)
    check_cu.write_text(CHECK_BODY + KERNEL)
    kernel_cu.write_text(KERNEL)
    project = [str(p) for p in sorted((REPO / "csrc").glob("*.cpp")) + sorted((REPO / "cuda").glob("*.cu"))]
    include = [str(REPO / "csrc")]
    # name, sources, cflags, cuda_cflags, ldflags, op to call
    return [
        ("cpp plain", [check_cpp], [], [], [], "bisect"),
        ("cpp + project flags", [check_cpp], cxx, [], link, "bisect"),
        ("cpp + -static-libstdc++", [check_cpp], [], [], ["-static-libstdc++"], "bisect"),
        ("cu plain (check in nvcc host code)", [check_cu], [], [], [], "bisect"),
        ("cu + project flags", [check_cu], cxx, ["-O3"], link, "bisect"),
        ("cu + -static-libstdc++", [check_cu], [], [], ["-static-libstdc++"], "bisect"),
        ("cu, nvcc -D_GLIBCXX_USE_CXX11_ABI=0", [check_cu], [], ["-D_GLIBCXX_USE_CXX11_ABI=0"], [], "bisect"),
        ("cpp check + cu kernel", [check_cpp, kernel_cu], [], [], [], "bisect"),
        ("project sources, plain flags", project, [], [], [], "hetero_comm"),
        ("project sources, project flags", project, cxx, ["-O3"], link, "hetero_comm"),
    ], include


def build(index: int, variant, include, work: pathlib.Path) -> str:
    """Build one variant in a child process; returns the .so path or the build error."""
    name, sources, cflags, cuda_cflags, ldflags, _ = variant
    directory = work / f"v{index}"
    directory.mkdir(exist_ok=True)
    script = textwrap.dedent(f"""
        import os, sys
        from torch.utils import cpp_extension
        os.environ["MAX_JOBS"] = "4"
        path = cpp_extension.load(name="bisect_v{index}", sources={[str(s) for s in sources]!r},
            extra_cflags={cflags!r}, extra_cuda_cflags={cuda_cflags!r}, extra_ldflags={ldflags!r},
            extra_include_paths={include!r}, build_directory={str(directory)!r},
            is_python_module=False, verbose=False)
        print("SO", os.path.join({str(directory)!r}, "bisect_v{index}.so"))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400)
    for line in result.stdout.splitlines():
        if line.startswith("SO "):
            return line[3:]
    return "BUILD FAILED: " + (result.stderr or result.stdout)[-600:]


def call(so: str, namespace: str, device: str) -> str:
    """Load the library in a fresh process and make the rejected call."""
    if namespace == "bisect":
        statement = f"torch.ops.bisect.reject(torch.ones(5, device={device!r}))"
    else:
        statement = (f"torch.ops.hetero_comm.segment_accumulate_(torch.ones(10, device={device!r}), "
                     f"torch.ones(11, device={device!r}), 4)")
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({so!r})
        try:
            {statement}
            print("NO ERROR")
        except Exception as error:
            print("raised", type(error).__name__ + ":", str(error).splitlines()[0][:90])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if result.returncode < 0:
        return f"KILLED by {signal.Signals(-result.returncode).name}"
    if result.returncode != 0:
        return f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1][:100] if result.stderr else ''}"
    return result.stdout.strip()


# libstdc++'s number formatting and locale code: a library that defines these (instead of
# taking them from the shared libstdc++.so.6) carries a private copy that crashes or drops digits.
PRIVATE_LIBSTDCXX = r"std::(num_put|num_get|locale|basic_ostream|basic_ios|ios_base|__cxx11::basic_ostringstream)"


def private_libstdcxx_symbols(path: str) -> list:
    listing = subprocess.run(f"nm -C --defined-only {path} | grep -E '{PRIVATE_LIBSTDCXX}'", shell=True,
                             capture_output=True, text=True).stdout
    return listing.splitlines()


def torch_has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/bisect_numeric_error")
    args = parser.parse_args()
    work = pathlib.Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    listed, include = variants(work)
    with concurrent.futures.ThreadPoolExecutor(len(listed)) as pool:
        built = list(pool.map(lambda item: build(item[0], item[1], include, work), enumerate(listed)))
    print(f"\n{'variant':<40} {'device':<6} result")
    for variant, so in zip(listed, built):
        if so.startswith("BUILD FAILED"):
            print(f"{variant[0]:<40} {'-':<6} {so.splitlines()[0][:60]} ... {so.splitlines()[-1][:200]}")
            continue
        devices = ("cpu", "cuda") if torch_has_cuda() else ("cpu",)
        for device in devices:
            print(f"{variant[0]:<40} {device:<6} {call(so, variant[5], device)}")
        print(f"{'':<40} {'':<6} defines {len(private_libstdcxx_symbols(so))} libstdc++ stream/locale symbols")
    # Which object files of the project's own build bring a private copy, and what it is.
    for index, variant in enumerate(listed):
        if variant[5] != "hetero_comm":
            continue
        for obj in sorted((work / f"v{index}").glob("*.o")):
            symbols = private_libstdcxx_symbols(str(obj))
            if symbols:
                print(f"{variant[0]}: {obj.name} defines {len(symbols)}, e.g. {symbols[0][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
