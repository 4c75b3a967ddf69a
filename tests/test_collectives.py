"""The collectives' names: the package runs on torch 2.11 (old names only) and 2.13 (new names,
the old ones deprecated)."""

import importlib
import re
from pathlib import Path

import torch.distributed as dist

import hetero_comm
from hetero_comm import _collectives

RENAMED = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


def test_the_old_names_serve_where_torch_lacks_the_new_ones(monkeypatch):
    for new in RENAMED:
        monkeypatch.delattr(dist, new, raising=False)
    try:
        reloaded = importlib.reload(_collectives)
        for new, old in RENAMED.items():
            assert getattr(reloaded, new) is getattr(dist, old)
    finally:
        monkeypatch.undo()
        importlib.reload(_collectives)
    for new, old in RENAMED.items():  # restored: this torch's own name again
        assert getattr(_collectives, new) is (getattr(dist, new, None) or getattr(dist, old))


def test_no_module_calls_a_renamed_collective_through_torch_distributed():
    # On a GPU machine with torch 2.11, dist.reduce_scatter_single crashed the two-level hook.
    names = "|".join([*RENAMED, *RENAMED.values()])
    pattern = re.compile(rf"\bdist\.({names})\b")
    package = Path(hetero_comm.__file__).parent
    modules = [path for path in sorted(package.rglob("*.py")) if path.name != "_collectives.py"]
    offenders = [f"{path.relative_to(package)}:{number}" for path in modules
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
