"""The experiment harness of the benchmarks, the demo and the tests; not part of the installed
package (users never import it).

* :mod:`~lab.registry`: every hook the demo, benchmarks and tests can run, by name
  (hetero_comm's and PyTorch's own).
* :mod:`~lab.data`: the digits data set and the small models trained on it.
* :mod:`~lab.training`: one training run's configuration and the loop of one rank.
* :mod:`~lab.launch`: local worker processes on gloo over 127.0.0.1.
* :mod:`~lab.byte_count`: bytes handed to collectives, the same for every hook.
* :mod:`~lab.throttle` and :mod:`~lab.netlab`: a real slow rank (a
  cgroup CPU quota) and real rate-limited links (network namespaces), root only.

May import anything of hetero_comm; hetero_comm never imports it.
"""
