"""The experiment harness: what runs experiments, rather than what users import into their
training.

* :mod:`~hetero_comm.lab.registry`: every hook the demo, benchmarks and tests can run, by name
  (hetero_comm's and PyTorch's own).
* :mod:`~hetero_comm.lab.data`: the digits data set and the small models trained on it.
* :mod:`~hetero_comm.lab.training`: one training run's configuration and the loop of one rank.
* :mod:`~hetero_comm.lab.launch`: local worker processes on gloo over 127.0.0.1.
* :mod:`~hetero_comm.lab.byte_count`: bytes handed to collectives, the same for every hook.
* :mod:`~hetero_comm.lab.throttle` and :mod:`~hetero_comm.lab.netlab`: a real slow rank (a
  cgroup CPU quota) and real rate-limited links (network namespaces), root only.

May import anything of hetero_comm except the CLI; nothing outside ``lab`` and the CLI
imports it.
"""
