"""Every process the tests start (torchrun, worker scripts, the demo) finds what the test
process finds through pyproject.toml's ``pythonpath``: the lab in benchmarks/ and the helpers in
tests/."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks"), str(REPO / "tests"), *_inherited])
