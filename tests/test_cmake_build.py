"""CMakeLists.txt's checks: the torch-free C++ kernel-core unit tests, the CUDA compile
check (every cuda/*.cu compiled by nvcc for sm_80 and sm_90 against torch's headers), and
the CUDA resource check (every kernel's registers and shared memory fit its block size).

The CUDA checks need nvcc, not a GPU; they compile without linking (a CPU wheel of torch
ships the headers but not libtorch_cuda) and take a minute or two on two cores.
"""

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.build

REPO = Path(__file__).resolve().parents[1]


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """A configured CMake build directory (configured once for this module)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is not on PATH (it is a test dependency: pip install '.[test]')")
    build = tmp_path_factory.mktemp("cmake") / "build"
    env = {**os.environ}
    if shutil.which("nvcc"):
        env["CUDACXX"] = shutil.which("nvcc")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = _run([cmake, "-S", str(REPO), "-B", str(build), *generator,
                      f"-DPython_EXECUTABLE={sys.executable}"], env=env, timeout=300)
    assert configure.returncode == 0, f"cmake configure failed:\n{configure.stdout}\n{configure.stderr}"
    return cmake, build, env


def _build(cmake_build, target: str) -> None:
    cmake, build, env = cmake_build
    built = _run([cmake, "--build", str(build), "--target", target, "--parallel",
                  str(os.cpu_count() or 2)], env=env, timeout=1800)
    assert built.returncode == 0, f"building {target} failed:\n{built.stdout}\n{built.stderr}"


def test_kernel_core_cpp_unit_tests_pass(cmake_build):
    _build(cmake_build, "kernel_core_tests")
    _, build, env = cmake_build
    ran = _run([shutil.which("ctest") or "ctest", "--test-dir", str(build), "--output-on-failure"],
               env=env, timeout=300)
    assert ran.returncode == 0, f"C++ kernel-core tests failed:\n{ran.stdout}\n{ran.stderr}"
    assert "100% tests passed" in ran.stdout, ran.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="CUDA compile check needs nvcc on PATH")
def test_cuda_compile_check_nvcc_builds_every_kernel(cmake_build):
    _build(cmake_build, "cuda_compile_check")
    _, build, _ = cmake_build
    objects = sorted(p.name for p in build.rglob("*.cu.o"))
    sources = sorted(f"{p.name}.o" for p in (REPO / "cuda").glob("*.cu"))
    assert objects == sources, f"objects {objects} do not match the sources {sources}"


# Per block, on every architecture built (sm_80, sm_90): 64 Ki 32-bit registers, allocated
# per thread in units of 8, and 48 KiB of static shared memory.
REGISTERS_PER_BLOCK = 65536
STATIC_SHARED_BYTES = 48 * 1024
MAX_THREADS_PER_BLOCK = 1024


def kernel_launch_bounds(ptx: str) -> dict:
    """Each kernel (.entry) of a PTX file and the threads per block of its __launch_bounds__
    (.maxntid), or None where it declares none."""
    bounds = {}
    for match in re.finditer(r"\.entry\s+(\w+)\((.*?)\{", ptx, re.S):
        maxntid = re.search(r"\.maxntid\s+([\d,\s]+)", match.group(2))
        threads = math.prod(int(v) for v in maxntid.group(1).replace(",", " ").split()) if maxntid else None
        bounds[match.group(1)] = threads
    return bounds


def ptxas_resources(ptxas_output: str) -> dict:
    """Registers per thread and static shared bytes of each kernel, from ``ptxas -v``."""
    usage, name = {}, None
    for line in ptxas_output.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used and name:
            smem = re.search(r"(\d+) bytes smem", line)
            usage[name] = (int(used.group(1)), int(smem.group(1)) if smem else 0)
            name = None
    return usage


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="the CUDA resource check needs nvcc on PATH")
def test_every_cuda_kernel_fits_its_launch_bounds(cmake_build, tmp_path):
    # A kernel launched with more threads than its registers allow fails with "too many
    # resources requested for launch"; only a GPU would show it, the compiler can tell now.
    _build(cmake_build, "cuda_compile_check")
    _, build, env = cmake_build
    ptxas = str(Path(shutil.which("nvcc")).with_name("ptxas"))
    sources = sorted(p.stem for p in (REPO / "cuda").glob("*.cu"))
    ptx_files = sorted((build / "cuda_keep").glob("*.compute_*.ptx"))
    archs = sorted({p.name.rsplit(".compute_", 1)[1][:-len(".ptx")] for p in ptx_files})
    assert archs == ["80", "90"], f"PTX kept for architectures {archs}"
    problems, checked = [], 0
    for source in sources:
        for arch in archs:
            ptx = build / "cuda_keep" / f"{source}.compute_{arch}.ptx"
            assert ptx.exists(), f"no PTX for {source}.cu on sm_{arch}"
            ran = _run([ptxas, f"-arch=sm_{arch}", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
                       env=env, timeout=600)
            assert ran.returncode == 0, ran.stderr
            bounds = kernel_launch_bounds(ptx.read_text())
            usage = ptxas_resources(ran.stdout + ran.stderr)
            assert bounds and set(bounds) == set(usage), (source, arch, bounds, usage)
            for kernel, threads in bounds.items():
                registers, shared = usage[kernel]
                where = f"{source}.cu sm_{arch} {kernel}"
                if threads is None:
                    problems.append(f"{where}: no __launch_bounds__ ({registers} registers)")
                    threads = MAX_THREADS_PER_BLOCK
                if -(-registers // 8) * 8 * threads > REGISTERS_PER_BLOCK:
                    problems.append(f"{where}: {registers} registers x {threads} threads > "
                                    f"{REGISTERS_PER_BLOCK}")
                if shared > STATIC_SHARED_BYTES:
                    problems.append(f"{where}: {shared} bytes of static shared memory")
                checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 2 * len(sources)
