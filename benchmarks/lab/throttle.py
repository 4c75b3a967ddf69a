"""Real slow ranks on one machine: a cgroup (v1) CPU quota for chosen processes.

Benchmarks and the demo use this to make one worker slower than the others for real (the
kernel stops scheduling its threads once they have used their share of each period), never a
sleep. It needs root and the cgroup v1 ``cpu`` controller at ``/sys/fs/cgroup/cpu``;
:func:`cpu_quota_unavailable` says why it cannot run elsewhere.
"""

import errno
import itertools
import math
import os
from typing import Optional

from hetero_comm._checks import check_float, check_int

__all__ = ["CpuQuota", "cpu_quota_unavailable"]

CPU_CGROUP_ROOT = "/sys/fs/cgroup/cpu"
# The accounting period. The kernel's default, 100 ms, lets a process that needs less than its
# quota per period (a rank that then waits for the others) run at full speed: its slowness
# would come and go with its load. 5 ms spreads the quota evenly over any step that matters.
PERIOD_US = 5_000
MIN_QUOTA_US = 1_000
_names = itertools.count()


def cpu_quota_unavailable() -> Optional[str]:
    """``None`` if :class:`CpuQuota` can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "a CPU quota needs root (cgroup directories are root's); run as root"
    if not os.path.exists(os.path.join(CPU_CGROUP_ROOT, "cpu.cfs_quota_us")):
        return (f"no cgroup v1 cpu controller at {CPU_CGROUP_ROOT} (cgroup v2's cpu.max is not "
                f"supported yet)")
    return None


class CpuQuota:
    """A cgroup whose processes together get ``cores`` CPUs' worth of time (e.g. 0.3: 1.5 ms
    of every 5 ms period), removed again on exit.

    Args:
        cores: the share, in (0, number of CPUs].
        period_us: the accounting period in microseconds, >= 1000 (lengthened if the quota
            would fall under the kernel's 1 ms minimum).

    Example::

        >>> with CpuQuota(0.3) as quota:
        ...     worker = subprocess.Popen([...])
        ...     quota.add(worker.pid)      # its threads, and children started later, too
        ...     worker.wait()
    """

    def __init__(self, cores: float, period_us: int = PERIOD_US) -> None:
        self.cores = check_float("cores", cores, 0.0, os.cpu_count() or 1, low_open=True)
        self.period_us = check_int("period_us", period_us, 1000, 1_000_000)
        self.path: Optional[str] = None

    def __enter__(self) -> "CpuQuota":
        reason = cpu_quota_unavailable()
        if reason is not None:
            raise PermissionError(f"cannot throttle a process: {reason}")
        path = os.path.join(CPU_CGROUP_ROOT, f"hetero_comm_{os.getpid()}_{next(_names)}")
        os.mkdir(path)
        self.path = path
        try:
            # The kernel's smallest quota is 1 ms: lengthen the period for small shares.
            period = max(self.period_us, math.ceil(MIN_QUOTA_US / self.cores))
            _write(os.path.join(path, "cpu.cfs_period_us"), period)
            _write(os.path.join(path, "cpu.cfs_quota_us"), round(self.cores * period))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the quota."""
        if self.path is None:
            raise RuntimeError("CpuQuota.add needs the quota to be entered (use it in a with)")
        _write(os.path.join(self.path, "cgroup.procs"), pid)

    def throttled_seconds(self) -> float:
        """Total time the kernel has held the group's processes back so far."""
        with open(os.path.join(self.path, "cpu.stat")) as f:
            fields = dict(line.split() for line in f if line.strip())
        return int(fields.get("throttled_time", 0)) / 1e9

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        # A cgroup can only be removed when empty: hand any process still in it back.
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            remaining = [line.strip() for line in f if line.strip()]
        for pid in remaining:
            try:
                _write(os.path.join(CPU_CGROUP_ROOT, "cgroup.procs"), pid)
            except OSError as error:
                if error.errno != errno.ESRCH:  # exited meanwhile: nothing to move
                    raise
        os.rmdir(self.path)
        self.path = None


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")
