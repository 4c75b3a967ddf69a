"""hetero_comm costs a user torch and numpy: everything else is an extra, named in the error
when a feature needs it."""

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

OPTIONAL = ("scipy", "sklearn", "matplotlib", "tqdm", "lightning", "accelerate")


def test_the_installed_distribution_requires_only_torch_and_numpy():
    requirements = importlib.metadata.requires("hetero_comm")
    unconditional = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                     for r in requirements if "extra ==" not in r}
    assert unconditional == {"torch", "numpy"}, requirements


def run_without_optional_packages(body: str) -> subprocess.CompletedProcess:
    """Run ``body`` in a new interpreter where importing any optional package fails."""
    script = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in OPTIONAL)
    return subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=120)


def test_the_one_call_the_hooks_and_every_subpackage_import_without_the_extras():
    result = run_without_optional_packages("""
        import torch, hetero_comm
        import hetero_comm.hooks, hetero_comm.hetero, hetero_comm.memory, hetero_comm.nn
        import hetero_comm.pipeline, hetero_comm.sync, hetero_comm.tensor_parallel
        import hetero_comm.integrations
        assert hetero_comm.compress and hetero_comm.hooks.SegmentSparseState
        x = torch.randn(1000)
        hetero_comm.ops.segment_accumulate_(torch.zeros(1000), x, 10)
        print("imports ok")
    """)
    assert result.returncode == 0 and "imports ok" in result.stdout, result.stderr


PROFILE = "LayerProfile((1.0, 1.0), (2.0, 2.0), (4, 4), (1, 1), (0, 0), 8)"


@pytest.mark.parametrize("call, extra", [
    (f"""
        from hetero_comm.pipeline import Cluster, DeviceKind, LayerProfile, plan_pipeline
        profile = {PROFILE}
        plan_pipeline(Cluster((DeviceKind("a", profile), DeviceKind("b", profile)), 1), 2)
     """, "planner"),
    (f"""
        from hetero_comm.pipeline import Cluster, DeviceKind, LayerProfile, plan_pipeline
        from hetero_comm.pipeline import plot_timeline, simulate
        plot_timeline(None, None, "unused.png")
     """, "planner"),
])
def test_a_feature_that_needs_an_extra_names_it(call, extra):
    result = run_without_optional_packages(call)
    assert result.returncode != 0
    assert f'pip install "hetero_comm[{extra}]"' in result.stderr, result.stderr
