"""Unit dropout with the same mask on every rank, so that dropped units cost no bytes.

Standard dropout draws a mask per sample and per rank: a weight's gradient sums over the
batch and is almost never zero, so data parallelism sends every byte anyway. Here a layer
drops whole output units (features) for the whole step, and every rank draws the same mask
from a seed shared once (:class:`UnitDropoutSet`), so no rank needs to be told what another
dropped. The rows of a dropped unit's weight (and its bias entry) then have an exactly zero
gradient on every rank: a hook state told about the set
(:meth:`hetero_comm.hooks.HookState.skip_dropped_units`) does not send them, and a
:class:`SlicedLinear` producer does not compute them.

Masks change once per optimizer step (:meth:`UnitDropoutSet.attach`): the micro-batches of
one step share theirs, so gradient accumulation keeps dropped rows at zero, and a recomputed
forward (activation checkpointing) sees the same mask.
"""

import logging
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_float, check_int
from .._layout import Piece

logger = logging.getLogger("hetero_comm")

__all__ = ["UnitDropoutSet", "UnitDropout", "SlicedLinear", "convert_dropout"]

# Modules that act on each unit on its own: a dropped unit's zero stays a function of that
# unit alone, so the Linear before them can be sliced by output unit.
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU,
               nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardtanh, nn.Identity)
_SEED_RANGE = 1 << 62


class UnitDropoutSet:
    """The shared masks of a model's :class:`UnitDropout` layers.

    Args:
        seed: the base seed, the same on every rank (an int in [0, 2**62)). ``None``: rank 0
            draws one and broadcasts it (one collective, here; none per step). A given seed
            is checked against every rank's (also one collective, here) when a process group
            is initialised, so a seed that differs between ranks is an error, not silently
            different masks.
        process_group: the ranks that must draw the same masks (``None``: the default group).

    The mask of layer ``l`` at step ``t`` comes from a generator seeded with
    ``(seed, t, l)``: every rank draws it alone, and a resumed run draws the same ones
    (:meth:`state_dict` holds the seed and the step).
    """

    def __init__(self, seed: Optional[int] = None, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.seed = _agree_on_seed(seed, process_group)
        self.step = 0
        self.layers: List["UnitDropout"] = []
        self._kept: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}  # (layer, step, device)

    def register(self, layer: "UnitDropout") -> int:
        """Add ``layer`` and return its index (its masks' stream)."""
        self.layers.append(layer)
        return len(self.layers) - 1

    def next_step(self) -> None:
        """New masks from now on (called after each optimizer step, see :meth:`attach`)."""
        self.step += 1
        self._kept.clear()

    def attach(self, optimizer: torch.optim.Optimizer):
        """Draw new masks after every ``optimizer.step()``; returns the hook's handle."""
        return optimizer.register_step_post_hook(lambda *_: self.next_step())

    def kept_units(self, layer: "UnitDropout", device: torch.device) -> torch.Tensor:
        """The indices (int64, increasing) of the units ``layer`` keeps at this step."""
        key = (layer.index, self.step, torch.device(device))
        kept = self._kept.get(key)
        if kept is None:
            generator = torch.Generator().manual_seed(_mix(self.seed, self.step, layer.index))
            keep = torch.rand(layer.units, generator=generator) >= layer.p
            kept = self._kept[key] = keep.nonzero().view(-1).to(device)
        return kept

    def kept_piece(self, parameter: torch.Tensor) -> Optional[Piece]:
        """What of ``parameter`` (seen as ``shape[0]`` rows) can have a nonzero gradient at
        this step: the kept rows if it belongs to the producer of a layer that dropped units in
        this step's training forward, the kept columns if it is the weight of the consumer of
        one; ``None`` if neither (every element can)."""
        kept = {"rows": None, "cols": None}
        for layer in self.layers:
            role = layer.role_of(parameter) if layer.dropped_at_step(self.step) else None
            if role is not None:
                kept[role] = self.kept_units(layer, parameter.device)
        if kept["rows"] is None and kept["cols"] is None:
            return None
        rows = parameter.shape[0]
        return Piece(0, rows, parameter.numel() // rows, kept["rows"], kept["cols"])

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue the masks of a saved run (the seed must be the one this set agreed on)."""
        if state_dict["seed"] != self.seed:
            raise ValueError(f"this state_dict was saved with seed {state_dict['seed']}; this "
                             f"set has {self.seed}: build the set with seed={state_dict['seed']}")
        self.step = int(state_dict["step"])
        self._kept.clear()


def _mix(*values: int) -> int:
    """A seed from several integers (splitmix64 steps: the same on every machine and Python)."""
    state = 0
    for value in values:
        state = (state + value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state % _SEED_RANGE


def _agree_on_seed(seed: Optional[int], group: Optional[dist.ProcessGroup]) -> int:
    distributed = dist.is_available() and dist.is_initialized()
    if seed is not None:
        check_int("seed", seed, 0, _SEED_RANGE - 1)
    if not distributed:
        return seed if seed is not None else int(torch.randint(0, _SEED_RANGE, ()).item())
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    if seed is None:
        drawn = torch.randint(0, _SEED_RANGE, (1,), device=device)
        dist.broadcast(drawn, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        return int(drawn.item())
    extremes = torch.tensor([seed, -seed], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if extremes[0].item() != seed or -extremes[1].item() != seed:
        raise ValueError(f"UnitDropoutSet: seed {seed} on this rank, but the ranks' seeds "
                         f"range over [{-extremes[1].item()}, {extremes[0].item()}]: every rank "
                         f"must pass the same seed (or seed=None to draw one on rank 0)")
    return seed


class UnitDropout(nn.Module):
    """Drop whole units (features along ``dim``) for the step, the same on every rank.

    In training, each unit is dropped with probability ``p`` and the kept ones are scaled by
    ``1 / (1 - p)``, so the expected output equals the input; ``eval()`` passes the input
    through. Unlike ``nn.Dropout`` the mask is one per step for the whole batch.

    Args:
        p: the drop probability, in [0, 1).
        units: the size of ``dim`` (the number of units), >= 1.
        unit_set: the :class:`UnitDropoutSet` whose seed draws the masks.
        producer: the ``nn.Linear`` whose output units these are (possibly through
            elementwise activations): its rows of dropped units have a zero gradient, which
            a hook told about ``unit_set`` does not send. ``None``: nothing is skipped.
        consumer: the ``nn.Linear`` that takes this layer's output as its input: its
            columns of dropped units have a zero gradient too. ``None``: none.
        dim: the unit dimension of the input (default: the last).
    """

    def __init__(self, p: float, units: int, unit_set: UnitDropoutSet,
                 producer: Optional[nn.Linear] = None, consumer: Optional[nn.Linear] = None,
                 dim: int = -1) -> None:
        super().__init__()
        self.p = check_float("p", p, 0.0, 1.0)
        if self.p >= 1.0:
            raise ValueError(f"p must be a number in [0, 1) (p = 1 drops every unit); got {p!r}")
        self.units = check_int("units", units, 1)
        if producer is not None and (not isinstance(producer, nn.Linear) or producer.out_features != units):
            raise ValueError(f"producer must be an nn.Linear with out_features == units ({units}); "
                             f"got {producer!r}")
        if consumer is not None and (not isinstance(consumer, nn.Linear) or consumer.in_features != units):
            raise ValueError(f"consumer must be an nn.Linear with in_features == units ({units}); "
                             f"got {consumer!r}")
        self.dim = dim
        self.unit_set = unit_set
        self.index = unit_set.register(self)
        # Plain attributes, not submodules: the Linear layers are registered where they live.
        self.__dict__["producer"], self.__dict__["consumer"] = producer, consumer
        self._last_step = None  # the step whose training forward used this layer

    def extra_repr(self) -> str:
        return f"p={self.p}, units={self.units}, dim={self.dim}"

    def active(self) -> bool:
        return self.training and self.p > 0.0

    def dropped_at_step(self, step: int) -> bool:
        """Whether this step's training forward dropped units here."""
        return self._last_step == step

    def role_of(self, parameter: torch.Tensor) -> Optional[str]:
        """``"rows"`` for the producer's weight and bias, ``"cols"`` for the consumer's
        weight: where this layer's dropped units leave a zero gradient; else ``None``."""
        producer, consumer = self.producer, self.consumer
        if producer is not None and (parameter is producer.weight or parameter is producer.bias):
            return "rows"
        if consumer is not None and parameter is consumer.weight:
            return "cols"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return x
        if x.shape[self.dim] != self.units:
            raise ValueError(f"UnitDropout expected {self.units} units along dim {self.dim}; "
                             f"got an input of shape {tuple(x.shape)}")
        self._last_step = self.unit_set.step
        kept = self.unit_set.kept_units(self, x.device)
        scale = torch.zeros(self.units, dtype=x.dtype, device=x.device)
        scale.index_fill_(0, kept, 1.0 / (1.0 - self.p))
        shape = [1] * x.dim()
        shape[self.dim] = self.units
        return x * scale.view(shape)


class SlicedLinear(nn.Linear):
    """An ``nn.Linear`` that computes only what the units kept at this step need: with an
    ``output_dropout`` dropping its output units, a matmul on the kept rows of the weight
    (zeros for the others); with an ``input_dropout`` dropping its input units (which are
    then exactly zero), a matmul on the kept columns. The same result as the masked
    computation (up to the order of floating-point sums), for a fraction ``1 - p`` of the
    matmul work per sliced side, forward and backward; the same parameters (and
    ``state_dict`` keys) as the ``nn.Linear`` it was made from."""

    output_dropout: Optional[UnitDropout] = None
    input_dropout: Optional[UnitDropout] = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "SlicedLinear":
        if isinstance(linear, SlicedLinear):
            return linear
        sliced = cls.__new__(cls)
        sliced.__dict__.update(linear.__dict__)  # shares the parameters, hooks included
        return sliced

    def slice_by(self, output_dropout: Optional[UnitDropout] = None,
                 input_dropout: Optional[UnitDropout] = None) -> None:
        # Plain attributes, not submodules (they are registered where they live).
        if output_dropout is not None:
            self.__dict__["output_dropout"] = output_dropout
        if input_dropout is not None:
            self.__dict__["input_dropout"] = input_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        into, out = self.input_dropout, self.output_dropout
        if into is not None and into.active():
            kept = into.unit_set.kept_units(into, x.device)
            x, weight = x.index_select(-1, kept), weight.index_select(1, kept)
        if out is None or not out.active():
            return F.linear(x, weight, bias)
        kept = out.unit_set.kept_units(out, x.device)
        weight = weight.index_select(0, kept)
        bias = None if bias is None else bias.index_select(0, kept)
        return x.new_zeros(*x.shape[:-1], self.out_features).index_copy(-1, kept, F.linear(x, weight, bias))


def convert_dropout(model: nn.Module, p: Optional[float] = None, *, seed: Optional[int] = None,
                    process_group: Optional[dist.ProcessGroup] = None, skip_compute: bool = True,
                    layers: Optional[Iterable[str]] = None) -> UnitDropoutSet:
    """Replace ``nn.Dropout`` layers that follow an ``nn.Linear`` (through elementwise
    activations only, inside an ``nn.Sequential``) by :class:`UnitDropout`, in place. The
    Linear is the producer of its units; an ``nn.Linear`` right after the dropout is their
    consumer.

    Args:
        model: the model (before wrapping it in DDP).
        p: the drop probability of every converted layer (``None``: each keeps its own).
        seed, process_group: see :class:`UnitDropoutSet` (collective when distributed).
        skip_compute: also make the producing and consuming ``nn.Linear`` layers
            :class:`SlicedLinear` (computing only the kept rows and columns).
        layers: names (as in ``model.named_modules()``) of the dropout layers to convert;
            ``None``: every one that can be. A named layer that cannot be converted is an
            error; unnamed ones that cannot are left as they are, with a logged warning.

    Returns:
        The :class:`UnitDropoutSet` of the converted layers (call its :meth:`~UnitDropoutSet.attach`
        with the optimizer, and pass it to the hook state's ``skip_dropped_units``).
    """
    wanted = None if layers is None else set(layers)
    dropouts = {name: module for name, module in model.named_modules() if isinstance(module, nn.Dropout)}
    if wanted is not None and wanted - set(dropouts):
        raise ValueError(f"no nn.Dropout named {sorted(wanted - set(dropouts))} in the model "
                         f"(its dropout layers: {sorted(dropouts)})")
    unit_set = UnitDropoutSet(seed, process_group)
    producers = _producers(model)
    for name, dropout in dropouts.items():
        if wanted is not None and name not in wanted:
            continue
        found = producers.get(name)
        if found is None:
            message = (f"dropout layer {name!r} cannot be made a unit dropout: it must follow an "
                       f"nn.Linear inside an nn.Sequential, with only elementwise activations between")
            if wanted is not None:
                raise ValueError(message)
            logger.warning("%s; left as standard dropout", message)
            continue
        _convert_one(found, dropout.p if p is None else p, unit_set, skip_compute)
    if not unit_set.layers:
        raise ValueError("convert_dropout found no nn.Dropout after an nn.Linear to convert")
    return unit_set


def _producers(model: nn.Module) -> Dict[str, Tuple[nn.Sequential, int, int]]:
    """For each dropout in an ``nn.Sequential`` that follows a Linear through elementwise
    modules: its name -> (the Sequential, the Linear's index, the dropout's index)."""
    found = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module)
        for i, child in enumerate(children):
            if not isinstance(child, nn.Dropout):
                continue
            j = i - 1
            while j >= 0 and isinstance(children[j], ELEMENTWISE):
                j -= 1
            if j >= 0 and isinstance(children[j], nn.Linear):
                found[f"{prefix}.{i}" if prefix else str(i)] = (module, j, i)
    return found


def _convert_one(found: Tuple[nn.Sequential, int, int], p: float, unit_set: UnitDropoutSet,
                 skip_compute: bool) -> None:
    """One dropout of ``parent`` (at ``dropout_index``, after the Linear at ``linear_index``)
    made a :class:`UnitDropout` of ``unit_set``; with ``skip_compute`` its producer and
    consumer made :class:`SlicedLinear`."""
    parent, linear_index, dropout_index = found
    linear = parent[linear_index]
    if skip_compute:
        linear = parent[linear_index] = SlicedLinear.from_linear(linear)
    after = parent[dropout_index + 1] if dropout_index + 1 < len(parent) else None
    consumer = after if isinstance(after, nn.Linear) and after.in_features == linear.out_features else None
    if consumer is not None and skip_compute:
        consumer = parent[dropout_index + 1] = SlicedLinear.from_linear(consumer)
    unit = UnitDropout(p, linear.out_features, unit_set, producer=linear, consumer=consumer)
    parent[dropout_index] = unit
    if skip_compute:
        linear.slice_by(output_dropout=unit)
        if consumer is not None:
            consumer.slice_by(input_dropout=unit)
