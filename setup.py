"""Builds hetero_comm._C: the C++ (OpenMP) kernels, plus the CUDA kernels when possible.

Environment variables:
  HETERO_COMM_BUILD_CUDA   "auto" (default): build the CUDA kernels when the installed torch
                           has CUDA and nvcc is found; "1": require them; "0": never.
  HETERO_COMM_NO_EXTENSION "1": build no extension at all (the package then runs on its
                           pure-PyTorch references).
  HETERO_COMM_MARCH_NATIVE "1": add -march=native (faster, but the binary may not run on
                           another CPU).
"""

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# Link the shared libstdc++.so.6, whatever the toolchain adds. A compiler wrapper that links it
# statically (-static-libstdc++) gives the extension a private copy of the locale code next to
# torch's shared one, and c10::str crashed inside it. Named here before the driver's own
# libraries, with --no-as-needed and -Bdynamic, the shared library resolves every std::
# symbol and a later static archive adds nothing; push/pop-state leave the other libraries'
# link mode alone. tests/test_build.py checks the NEEDED entries, and these flags.
LIBSTDCXX_LINK_ARGS = ["-Wl,--push-state,--no-as-needed,-Bdynamic", "-lstdc++", "-Wl,--pop-state"]


def running_libstdcxx() -> list:
    """The shared libstdc++ this process has loaded (torch needs one), as a link input by path.

    -lstdc++ is not enough where the compiler's own library folder holds only the static
    archive: the GPU image's /opt/gcc did, so every extension built there (torch's own
    cpp_extension example too) defined about 980 of libstdc++'s stream and locale symbols
    and crashed on the first error message that formats a number. The library torch runs on,
    named by path ahead of -lstdc++, resolves them instead."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    except OSError:  # no /proc (macOS): -lstdc++ alone
        return []
    return paths[:1]


def _flag(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower()


def _extensions():
    if _flag("HETERO_COMM_NO_EXTENSION", "0") in ("1", "true", "yes"):
        return [], {}
    import torch
    from torch.utils import cpp_extension

    build_cuda = _flag("HETERO_COMM_BUILD_CUDA", "auto")
    cuda_possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if build_cuda in ("1", "true", "yes") and not cuda_possible:
        raise RuntimeError("HETERO_COMM_BUILD_CUDA=1 but the installed torch has no CUDA or nvcc "
                           "was not found (CUDA_HOME is unset)")
    with_cuda = cuda_possible and build_cuda not in ("0", "false", "no")

    # -ffp-contract=off: no fused multiply-add, so results do not depend on whether the CPU
    # has FMA; ranks of an unequal cluster must decode the same integers to the same floats.
    # -fno-trapping-math lets GCC turn float compares into selects and vectorise (no FP traps
    # are enabled, so no result changes).
    cxx_flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    if _flag("HETERO_COMM_MARCH_NATIVE", "0") in ("1", "true", "yes"):
        cxx_flags.append("-march=native")
    link_args = ["-fopenmp", *LIBSTDCXX_LINK_ARGS[:1], *running_libstdcxx(), *LIBSTDCXX_LINK_ARGS[1:]]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_cuda:
        # Without a visible GPU torch cannot guess the architectures; select_segments needs
        # sm_70+ (__match_any_sync). Override with TORCH_CUDA_ARCH_LIST.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources += sorted(glob.glob(os.path.join("cuda", "*.cu")))
        extension = cpp_extension.CUDAExtension(
            "hetero_comm._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]}, extra_link_args=link_args)
    else:
        extension = cpp_extension.CppExtension(
            "hetero_comm._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_args)
    build_ext = cpp_extension.BuildExtension.with_options(no_python_abi_suffix=False)
    return [extension], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
