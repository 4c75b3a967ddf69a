"""Layers whose structure a hook can exploit.

* :class:`UnitDropout` / :func:`convert_dropout`: dropout of whole units, the same on every
  rank (:class:`UnitDropoutSet`), so the rows of dropped units are neither sent
  (:meth:`hetero_comm.hooks.HookState.skip_dropped_units`) nor, with :class:`SlicedLinear`,
  computed.
"""

from .unit_dropout import SlicedLinear, UnitDropout, UnitDropoutSet, convert_dropout

__all__ = ["UnitDropout", "UnitDropoutSet", "SlicedLinear", "convert_dropout"]
