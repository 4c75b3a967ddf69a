"""CMakeLists.txt's checks: the torch-free C++ kernel-core unit tests, and the CUDA compile
check (every cuda/*.cu compiled by nvcc for sm_80 and sm_90 against torch's headers).

The compile check needs nvcc, not a GPU; it compiles without linking (a CPU wheel of torch
ships the headers but not libtorch_cuda) and takes a minute or two on two cores.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
