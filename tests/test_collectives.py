"""The collectives' names: the package runs on torch 2.11 (old names only) and 2.13 (new names,
the old ones deprecated)."""

import re
from pathlib import Path

import torch.distributed as dist

import hetero_comm
from hetero_comm import _collectives

RENAMED = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


def _calls_of(monkeypatch, names) -> dict:
    """Replace ``names`` of torch.distributed by recorders; the calls each received."""
    calls = {name: [] for name in names}
    for name in names:
        monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: calls[_name].append(args),
                            raising=False)
    return calls


def test_the_old_names_serve_where_torch_lacks_the_new_ones(monkeypatch):
    calls = _calls_of(monkeypatch, RENAMED.values())
    for new in RENAMED:
        monkeypatch.delattr(dist, new, raising=False)
    for new, old in RENAMED.items():
        getattr(_collectives, new)("output", "input")
        assert calls[old] == [("output", "input")]


def test_the_new_names_serve_where_torch_has_them_and_are_looked_up_at_each_call(monkeypatch):
    """Looked up per call, so that a wrapper put on torch's function later (the benchmarks'
    byte counter) sees the package's calls."""
    calls = _calls_of(monkeypatch, [*RENAMED, *RENAMED.values()])
    for new, old in RENAMED.items():
        getattr(_collectives, new)("output", "input")
        assert calls[new] == [("output", "input")] and calls[old] == []


def test_no_module_calls_a_renamed_collective_through_torch_distributed():
    # On a GPU machine with torch 2.11, dist.reduce_scatter_single crashed the two-level hook.
    names = "|".join([*RENAMED, *RENAMED.values()])
    pattern = re.compile(rf"\bdist\.({names})\b")
    package = Path(hetero_comm.__file__).parent
    modules = [path for path in sorted(package.rglob("*.py")) if path.name != "_collectives.py"]
    offenders = [f"{path.relative_to(package)}:{number}" for path in modules
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
