"""Real rate-limited links between local ranks: one network namespace per rank, joined by veth
pairs, every link shaped by a token-bucket qdisc (tbf).

Benchmarks and tests use this to put a real, slow network between gloo ranks on one machine,
never a sleep. Two ranks are joined directly; more go through a bridge in a namespace of its
own, each rank's link shaped in both directions. Only 10.x addresses inside namespaces this
module creates are used, and everything is deleted on exit, also when the body raises.
Needs root and iproute2; :func:`netlab_unavailable` says why it cannot run elsewhere.
"""

import itertools
import os
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["RateLimitedNetwork", "netlab_unavailable", "parse_rate"]

_labs = itertools.count()
KERNEL_HZ = 250  # tbf must be able to send a tick's worth of bytes in one burst
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str) -> int:
    """``"100mbit"``, ``"1gbit"``, ``"10gbit"`` (bits per second) -> bits per second."""
    text = str(rate).strip().lower()
    if not text.endswith("bit"):
        raise ValueError(f"rate must look like '100mbit' or '1gbit'; got {rate!r}")
    number, unit = text[:-3], ""
    if number and number[-1] in "kmg":
        number, unit = number[:-1], number[-1]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"rate must look like '100mbit' or '1gbit'; got {rate!r}") from None
    if not value >= 1e3:
        raise ValueError(f"rate must be at least 1kbit; got {rate!r}")
    return int(value)


def netlab_unavailable() -> Optional[str]:
    """``None`` if :class:`RateLimitedNetwork` can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces and qdiscs need root; run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")
    return result.stdout


class RateLimitedNetwork:
    """``num_ranks`` namespaces with rate-limited links; a context manager.

    Rank ``i`` lives in namespace :meth:`namespace` ``(i)`` with interface :meth:`interface`
    ``(i)`` and address :meth:`address` ``(i)`` (``10.77.0.<i+1>``); its outgoing traffic is
    shaped to ``rate`` (and, through a bridge, its incoming traffic too). Start a rank's
    process with :meth:`command` or :meth:`popen`; :meth:`tx_bytes` / :meth:`rx_bytes` read
    the kernel's interface counters.

    With ``sites`` the network has a topology: each site's ranks hang on a bridge of their own
    (each rank's link at ``rate``), and every site's bridge joins a core bridge through an uplink
    shaped to ``inter_site_rate`` in both directions, so traffic between two sites crosses two
    slow links (out of one site, into the other) and traffic inside a site none.

    Args:
        num_ranks: >= 2.
        rate: e.g. ``"100mbit"``, ``"1gbit"``, ``"10gbit"``; ``None`` leaves the links
            unshaped (with ``sites``: each rank's link to its site).
        sites: ``sites[rank]``, the site of each rank (any labels; at least two sites).
        inter_site_rate: the rate of each site's uplink (``None``: unshaped); only with
            ``sites``.

    Example::

        >>> with RateLimitedNetwork(2, "100mbit") as net:
        ...     workers = [net.popen(r, [sys.executable, "worker.py"],
        ...                          env=dict(MASTER_ADDR=net.address(0), RANK=str(r)))
        ...                for r in range(2)]
        ...     for w in workers: w.wait()
    """

    def __init__(self, num_ranks: int, rate: Optional[str] = "100mbit", *,
                 sites: Optional[Sequence] = None, inter_site_rate: Optional[str] = None) -> None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
            raise ValueError(f"num_ranks must be an integer >= 2; got {num_ranks!r}")
        self.num_ranks = num_ranks
        self.rate_bits = parse_rate(rate) if rate is not None else None
        self.sites: Optional[List[int]] = None
        if sites is not None:
            labels = list(dict.fromkeys(sites))
            if len(sites) != num_ranks or len(labels) < 2:
                raise ValueError(f"sites needs one label per rank ({num_ranks}) and at least two "
                                 f"sites; got {list(sites)!r}")
            self.sites = [labels.index(site) for site in sites]
        elif inter_site_rate is not None:
            raise ValueError("inter_site_rate needs sites")
        self.inter_site_bits = parse_rate(inter_site_rate) if inter_site_rate is not None else None
        self.prefix = f"hc{os.getpid()}x{next(_labs)}"
        self._created: List[str] = []
        self._processes: List[subprocess.Popen] = []
        self._site_anchors: Dict[int, subprocess.Popen] = {}

    # ------------------------------------------------------------------------ names
    def namespace(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    def interface(self, rank: int) -> str:
        return f"hcv{rank}"  # inside the rank's own namespace, so it never clashes

    def address(self, rank: int) -> str:
        return f"10.77.0.{rank + 1}"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}br"

    # ---------------------------------------------------------------------- set-up
    def __enter__(self) -> "RateLimitedNetwork":
        reason = netlab_unavailable()
        if reason is not None:
            raise PermissionError(f"cannot build rate-limited links: {reason}")
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def _netns(self, namespace: str, *argv: str) -> str:
        return _run("ip", "netns", "exec", namespace, *argv)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        self._netns(name, "ip", "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str, rate_bits: Optional[int] = None,
               action: str = "add") -> None:
        rate_bits = self.rate_bits if rate_bits is None else rate_bits
        if rate_bits is None:
            return
        burst = max(2 * int(rate_bits / 8 / KERNEL_HZ), 32 * 1024)
        self._netns(namespace, "tc", "qdisc", action, "dev", device, "root", "tbf",
                    "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "50ms")

    def set_inter_site_rate(self, rate: str) -> None:
        """Change every site's uplink to ``rate`` while the ranks run (a network built with
        ``sites`` and an ``inter_site_rate``)."""
        if self.sites is None or self.inter_site_bits is None:
            raise ValueError("set_inter_site_rate needs a network built with sites and an "
                             "inter_site_rate")
        self.inter_site_bits = parse_rate(rate)
        for site in range(max(self.sites) + 1):
            self._shape(self.bridge_namespace, f"hcd{site}", self.inter_site_bits, "change")
            self._shape(self.site_namespace(site), "hcup", self.inter_site_bits, "change")

    def _add_bridge(self, namespace: str) -> None:
        self._add_namespace(namespace)
        self._netns(namespace, "ip", "link", "add", "hcbr", "type", "bridge")
        self._netns(namespace, "ip", "link", "set", "hcbr", "up")

    def _attach(self, bridge: str, port: str, peer_namespace: str, peer: str) -> None:
        """A veth pair: ``port`` on ``bridge``'s bridge, ``peer`` in ``peer_namespace``."""
        self._netns(bridge, "ip", "link", "add", port, "type", "veth", "peer", "name", peer,
                    "netns", peer_namespace)
        self._netns(bridge, "ip", "link", "set", port, "master", "hcbr")
        self._netns(bridge, "ip", "link", "set", port, "up")

    def site_namespace(self, site: int) -> str:
        return f"{self.prefix}s{site}"

    def _build_sites(self) -> list:
        """Ranks on their site's bridge; every site's bridge on the core bridge by an uplink."""
        core = self.bridge_namespace
        self._add_bridge(core)
        for site in range(max(self.sites) + 1):
            namespace = self.site_namespace(site)
            self._add_bridge(namespace)
            self._attach(core, f"hcd{site}", namespace, "hcup")
            self._netns(namespace, "ip", "link", "set", "hcup", "master", "hcbr")
            self._netns(namespace, "ip", "link", "set", "hcup", "up")
            self._shape(core, f"hcd{site}", self.inter_site_bits)  # into the site
            self._shape(namespace, "hcup", self.inter_site_bits)  # out of the site
        ends = []
        for rank, site in enumerate(self.sites):
            self._attach(self.site_namespace(site), f"hcp{rank}", self.namespace(rank),
                         self.interface(rank))
            self._shape(self.site_namespace(site), f"hcp{rank}")  # towards the rank
            ends.append((self.namespace(rank), self.interface(rank)))
        return ends

    def _build(self) -> None:
        for rank in range(self.num_ranks):
            self._add_namespace(self.namespace(rank))
        if self.sites is not None:
            ends = self._build_sites()
        elif self.num_ranks == 2:
            a, b = self.namespace(0), self.namespace(1)
            self._netns(a, "ip", "link", "add", self.interface(0), "type", "veth", "peer",
                        "name", self.interface(1), "netns", b)
            ends = [(a, self.interface(0)), (b, self.interface(1))]
        else:
            bridge = self.bridge_namespace
            self._add_bridge(bridge)
            ends = []
            for rank in range(self.num_ranks):
                self._attach(bridge, f"hcp{rank}", self.namespace(rank), self.interface(rank))
                self._shape(bridge, f"hcp{rank}")  # towards the rank
                ends.append((self.namespace(rank), self.interface(rank)))
        for rank, (namespace, device) in enumerate(ends):
            self._netns(namespace, "ip", "addr", "add", f"{self.address(rank)}/24", "dev", device)
            self._netns(namespace, "ip", "link", "set", device, "up")
            self._shape(namespace, device)  # from the rank

    # ----------------------------------------------------------------------- running
    def command(self, rank: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> List[str]:
        """``argv`` wrapped to run in rank ``rank``'s namespace, with gloo told to use its
        interface (``env`` entries are added to the environment)."""
        settings = {"GLOO_SOCKET_IFNAME": self.interface(rank), **(env or {})}
        return ["ip", "netns", "exec", self.namespace(rank), "env",
                *[f"{k}={v}" for k, v in settings.items()], *argv]

    def popen(self, rank: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` in rank ``rank``'s namespace; it is killed on exit if still running."""
        process = subprocess.Popen(self.command(rank, argv, env), **kwargs)
        self._processes.append(process)
        return process

    def _counter(self, rank: int, name: str) -> int:
        path = f"/sys/class/net/{self.interface(rank)}/statistics/{name}"
        return int(self._netns(self.namespace(rank), "cat", path))

    def site_tx_bytes(self, site: int) -> int:
        """Bytes that left site ``site`` (its uplink's counter; only with ``sites``). Cheap
        enough to sample often while ranks run: it reads the counter through a process kept
        in the site's namespace instead of starting one per read."""
        if self.sites is None:
            raise ValueError("site_tx_bytes needs a network built with sites")
        with open(f"/proc/{self._site_anchor(site).pid}/net/dev") as table:
            for line in table:
                name, _, fields = line.partition(":")
                if name.strip() == "hcup":
                    return int(fields.split()[8])  # the first transmit column
        raise RuntimeError(f"site {site}'s namespace has no uplink")

    def _site_anchor(self, site: int) -> subprocess.Popen:
        """A sleeping process in site ``site``'s namespace (started once, killed on exit)."""
        if site not in self._site_anchors:
            namespace = self.site_namespace(site)
            anchor = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "infinity"])
            self._processes.append(anchor)
            target = os.stat(f"/run/netns/{namespace}").st_ino
            deadline = time.monotonic() + 10.0
            while os.stat(f"/proc/{anchor.pid}/ns/net").st_ino != target:  # until it has entered
                if anchor.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"could not enter namespace {namespace}")
                time.sleep(0.01)
            self._site_anchors[site] = anchor
        return self._site_anchors[site]

    def tx_bytes(self, rank: int) -> int:
        """Bytes rank ``rank``'s interface has sent (Ethernet frames, headers included)."""
        return self._counter(rank, "tx_bytes")

    def rx_bytes(self, rank: int) -> int:
        """Bytes rank ``rank``'s interface has received."""
        return self._counter(rank, "rx_bytes")

    # ---------------------------------------------------------------------- teardown
    def __exit__(self, *exc) -> None:
        self._teardown()

    def _teardown(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        self._processes = []
        self._site_anchors = {}
        errors = []
        for name in reversed(self._created):  # deleting a namespace deletes its veth ends
            result = subprocess.run(["ip", "netns", "delete", name], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                errors.append(f"{name}: {result.stderr.strip()}")
        self._created = []
        if errors:
            raise RuntimeError(f"could not delete network namespaces: {'; '.join(errors)}")

    def leftovers(self) -> List[str]:
        """Namespaces of this network still present (empty after exit)."""
        listed = _run("ip", "netns", "list")
        return [line.split()[0] for line in listed.splitlines()
                if line.split() and line.split()[0].startswith(self.prefix)]
