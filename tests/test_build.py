"""The build itself: compiled kernels registered, OpenMP really parallel, clean fallback."""

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hetero_comm
from hetero_comm import ops, reference
from hetero_comm._kernels import KERNEL_OPS, KERNELS, ops_served_on
from kernel_cases import device, require_compiled  # noqa: F401  (device: a fixture)

REPO = Path(__file__).resolve().parents[1]


def test_compiled_kernels_serve_cpu():
    require_compiled("cpu")
    for op in KERNEL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hetero_comm::{op}", "CPU"), op


def test_the_cuda_sources_implement_exactly_the_ops_cuda_is_asked_for():
    """kernel_backend("cuda") asks for :func:`ops_served_on` ("cuda"): had it asked for an op
    no .cu file implements (the CPU codec's steps, say), a CUDA build would report
    "reference" and every CUDA test would skip."""
    implemented = set()
    for source in (REPO / "cuda").glob("*.cu"):
        implemented |= set(re.findall(r'm\.impl\("(\w+)"', source.read_text()))
    assert implemented == set(ops_served_on("cuda")), implemented ^ set(ops_served_on("cuda"))
    assert set(ops_served_on("cpu")) == set(KERNEL_OPS)


def test_the_op_list_is_the_registered_schemas_and_both_apis():
    require_compiled("cpu")
    registered = {schema.name.split("::", 1)[1] for schema in torch._C._jit_get_all_schemas()
                  if schema.name.startswith("hetero_comm::")}
    public = {name for name in registered if not name.startswith("_")}
    assert public == set(KERNEL_OPS), public ^ set(KERNEL_OPS)
    assert reference.__all__ == list(KERNELS)
    assert ops.__all__ == [*KERNELS, "set_strict_checks", "num_segments"]
    for name in KERNELS:
        assert callable(getattr(ops, name)) and callable(getattr(reference, name)), name


def test_the_strict_checks_switch_reaches_the_extension():
    require_compiled()
    previous = ops.set_strict_checks(True)
    try:
        assert torch.ops.hetero_comm._set_strict_checks(True) is True
        assert ops.set_strict_checks(False) is True
        assert torch.ops.hetero_comm._set_strict_checks(False) is False
    finally:
        ops.set_strict_checks(previous)


def test_parallel_for_runs_on_several_threads():
    require_compiled()
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs with one intra-op thread here, so parallelism cannot show")
    # Without -fopenmp at::parallel_for silently runs everything on the calling thread.
    assert torch.ops.hetero_comm._parallel_threads_used(64) >= 2


def test_kernel_backend_of_an_unknown_device_type_is_reference():
    assert hetero_comm.kernel_backend("meta") == "reference"
    assert hetero_comm.kernel_backend(torch.device("cpu")) == hetero_comm.kernel_backend("cpu")


def test_import_falls_back_to_references_with_one_warning():
    # Block the extension module: importing must still work, warn once, and run the references.
    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING)
        sys.modules["hetero_comm._C"] = None
        import torch, hetero_comm
        import hetero_comm.ops
        assert hetero_comm.kernel_backend("cpu") == "reference"
        residual = torch.zeros(10)
        importance = hetero_comm.ops.segment_accumulate_(residual, torch.ones(10), 4)
        assert torch.allclose(importance, torch.tensor([2.0, 2.0, 2 ** 0.5])), importance
        pool = hetero_comm.BufferPool()
        pool.release(pool.acquire(10, torch.float32))
        assert pool.stats()["allocations"] == 1
        print("fallback ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout
    assert result.stderr.count("runs on its pure-PyTorch reference kernels") == 1, result.stderr


@pytest.mark.parametrize("layout, advice", [
    ({"setup.py": "", "hetero_comm/__init__.py": ""}, "build it there with `pip install -e .`"),
    ({"hetero_comm/__init__.py": ""}, "has no compiled extension (built with HETERO_COMM_NO_EXTENSION=1"),
    ({"hetero_comm/__init__.py": "", "hetero_comm/_C.cpython-311-x86_64-linux-gnu.so": ""},
     "probably built against another torch"),
])
def test_the_fallback_warning_says_what_to_do(tmp_path, layout, advice):
    """A source tree without a build, an installation without the extension, and an extension
    that does not load each get their own advice."""
    from hetero_comm._backend import why_not_loaded
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    message = why_not_loaded(ImportError("undefined symbol: _ZN3c10"), str(tmp_path / "hetero_comm"))
    assert advice in message


def test_training_with_the_compiled_kernels_never_loads_the_reference():
    """The references are the kernels' specification and fallback: with the compiled kernels,
    importing the hooks (and the package, the one call, the lab) must not import them, so no
    hook can reach a reference by accident. Run from the repository's root, where `python` puts
    the source tree first on sys.path: the set-up's editable build serves the compiled kernels
    there too."""
    require_compiled("cpu")
    script = textwrap.dedent("""
        import sys
        import hetero_comm, hetero_comm.hooks, hetero_comm.recipes, hetero_comm.sync
        import hetero_comm.pipeline, lab.training
        assert hetero_comm.extension_load_error() is None
        assert "hetero_comm.reference" not in sys.modules, "imported"
        from hetero_comm import reference  # on first use
        assert "hetero_comm.reference" in sys.modules and reference.__all__
        print("lazy ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0 and "lazy ok" in result.stdout, result.stderr


def needed_libraries(path) -> list:
    """The NEEDED entries of a shared object's dynamic section (``readelf -d``)."""
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils, which the build's linker comes with) is not on PATH"
    dynamic = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic.stdout)


# libstdc++'s own stream and locale code, which only a private (static) copy puts in a library:
# these are compiled into libstdc++.so, never instantiated from the headers.
PRIVATE_LIBSTDCXX = re.compile(r" std::(locale::|ios_base::|num_put<)"
                               r"|basic_ostream<char, std::char_traits<char> >::_M_insert<")


def private_libstdcxx_symbols(path) -> list:
    """Symbols of libstdc++'s stream and locale code that ``path`` defines itself (``nm``)."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils, which the build's linker comes with) is not on PATH"
    listing = subprocess.run([nm, "-C", "--defined-only", str(path)], capture_output=True,
                             text=True, check=True).stdout
    return [line for line in listing.splitlines() if PRIVATE_LIBSTDCXX.search(line)]


def test_the_extension_links_libstdcxx_dynamically():
    # A private static libstdc++ next to torch's shared one crashed c10::str (a SIGSEGV on
    # the first error message containing a number). NEEDED alone is not enough: on the H100
    # image a build with the shared library NEEDED still crashed so on CUDA ops (issue 12), so
    # the extension must not carry the stream code itself either.
    require_compiled()
    from hetero_comm import _C
    assert "libstdc++.so.6" in needed_libraries(_C.__file__), needed_libraries(_C.__file__)
    assert private_libstdcxx_symbols(_C.__file__) == []


def test_an_error_message_with_a_number_raises_instead_of_crashing(device):
    # Issue 12's bug 2, still seen on an H100 after the link fix: every CUDA op's rejection
    # whose message formats an integer killed the process. In a subprocess, so that a crash
    # fails this test alone, with its signal.
    require_compiled()
    script = textwrap.dedent(f"""
        import torch
        from hetero_comm import ops
        try:
            ops.segment_accumulate_(torch.ones(10, device="{device}"), torch.ones(11, device="{device}"), 4)
        except ValueError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "as many elements as residual" in result.stdout and "11" in result.stdout, result.stdout


def setup_link_definitions() -> dict:
    """setup.py's LIBSTDCXX_LINK_ARGS and running_libstdcxx, without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    wanted = [node for node in tree.body
              if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LIBSTDCXX_LINK_ARGS")
              or (isinstance(node, ast.FunctionDef) and node.name == "running_libstdcxx")]
    namespace = {"os": os}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace


def link_shared_object(tmp_path, name: str, extra: list) -> tuple:
    """Link a library that formats an int through std::ostringstream, as a toolchain that adds
    -static-libstdc++ does, with ``extra`` link arguments: (its NEEDED list, how many of
    libstdc++'s stream and locale symbols it defines itself)."""
    source = tmp_path / "uses_std.cpp"
    source.write_text("#include <sstream>\n#include <string>\n"
                      "std::string text(int x) { std::ostringstream s; s << x; return s.str(); }\n")
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "no C++ compiler on PATH (the extension build needs one)"
    target = tmp_path / f"{name}.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-static-libstdc++", str(source), *extra,
                    "-o", str(target)], check=True, capture_output=True, timeout=120)
    return needed_libraries(target), len(private_libstdcxx_symbols(target))


@pytest.mark.build
def test_setup_link_flags_keep_libstdcxx_shared_under_a_static_toolchain(tmp_path):
    # What a wrapper that adds -static-libstdc++ does to a link, with and without the flags.
    link_args = setup_link_definitions()["LIBSTDCXX_LINK_ARGS"]
    static, fixed = link_shared_object(tmp_path, "static", []), link_shared_object(tmp_path, "fixed", link_args)
    assert "libstdc++.so.6" not in static[0] and static[1] > 0, static  # what the flags prevent
    assert "libstdc++.so.6" in fixed[0] and fixed[1] == 0, fixed


@pytest.mark.build
def test_setup_links_the_running_libstdcxx_where_the_toolchain_has_only_the_archive(tmp_path):
    # Issue 35: the GPU image's compiler found only libstdc++.a for -lstdc++, so the flags above
    # still gave every extension a private copy (980 symbols), which crashed on a numeric message.
    definitions = setup_link_definitions()
    link_args, running = definitions["LIBSTDCXX_LINK_ARGS"], definitions["running_libstdcxx"]()
    assert running and Path(running[0]).name.startswith("libstdc++.so"), running  # torch loaded it
    compiler = shutil.which("c++") or shutil.which("g++")
    archive = subprocess.run([compiler, "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert Path(archive).is_file(), f"the compiler has no libstdc++.a to stand in for that toolchain: {archive}"
    only_archive = tmp_path / "only_archive"
    only_archive.mkdir()
    (only_archive / "libstdc++.a").symlink_to(archive)
    search = [f"-L{only_archive}"]
    before = link_shared_object(tmp_path, "before", search + link_args)
    after = link_shared_object(tmp_path, "after", search + link_args[:1] + running + link_args[1:])
    assert before[1] > 0, before  # the toolchain's failure, reproduced
    assert "libstdc++.so.6" in after[0] and after[1] == 0, after


def test_every_subpackage_is_installed():
    """``pip install .`` copies only the packages pyproject.toml lists: a new subpackage missing
    there works from the source tree and is absent from the installed library."""
    import tomllib
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(path.parent.relative_to(root).parts)
               for path in (root / "hetero_comm").rglob("__init__.py")}
    assert on_disk == listed
