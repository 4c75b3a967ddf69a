"""Every process the tests start (torchrun, worker scripts, the demo) finds what the test
process finds through pyproject.toml's ``pythonpath``: the lab in benchmarks/ and the helpers in
tests/."""

import os
from pathlib import Path

from hypothesis import settings

# The property tests draw the same examples on every run (the suite is deterministic; a failure
# found once is found again), and keep no example database between runs.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

REPO = Path(__file__).resolve().parents[1]
_inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks"), str(REPO / "tests"), *_inherited])
