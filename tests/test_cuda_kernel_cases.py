"""Every kernel test that takes the ``device`` fixture (test_segments.py, test_dct.py,
test_quantize.py, test_build.py), rerun on CUDA. Skipped once, with the reason, where the CUDA
kernels cannot run."""

import pytest

from kernel_cases import cuda_skip_reason, tests_taking_device

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)
pytestmark = pytest.mark.cuda

import test_build  # noqa: E402  (after the skip: the CPU modules are imported only to rerun them)
import test_dct  # noqa: E402
import test_quantize  # noqa: E402
import test_segments  # noqa: E402
from kernel_cases import compiled_with_strict_checks  # noqa: E402, F401  (autouse fixture)

globals().update(tests_taking_device(test_segments, test_dct, test_quantize, test_build))


@pytest.fixture
def device() -> str:
    return "cuda"
