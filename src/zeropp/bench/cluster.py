"""An emulated multi-node cluster on one machine: network namespaces as nodes.

Each node is a namespace `<prefix><i>` with one veth `cl0` (address
10.77.0.<i+1>) plugged into a bridge in a switch namespace `<prefix>sw`. Both
directions of every node's link are capped with `tbf` at `rate`; traffic
between the ranks of one node stays on that namespace's loopback, unshaped.
With a `delay`, `cl0` is a TUN device instead and `relay.py`, a userspace
switch, holds each packet for the delay (the kernel here has no netem). The
interface byte counters of `cl0` (read inside the namespace) are the
ground truth for what crossed nodes. Needs root and `ip netns` (iproute2);
`available()` says why not otherwise.

Always cleaned up: on exit from the `with` block, on error, on Ctrl-C; and
namespaces left by a killed run (same prefix) are removed before a new one.
PID 1 does not reap orphans here, so every helper is started with subprocess
and waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Optional

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
MAX_NODES = 253  # 10.77.0.1 .. 10.77.0.253 on one /24
BURST, LATENCY_S = 65536, 0.02  # every link's tbf: bytes let through at once, queue bound
CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built or used; the message says why."""


def parse_rate(rate: str) -> str:
    """A tc rate such as 100mbit or 1gbit; anything else is a clear error."""
    if not isinstance(rate, str) or not _RATE.match(rate.strip().lower()):
        raise ValueError(f"unparsable link rate {rate!r}; use a number followed by bit, kbit, "
                         "mbit or gbit, e.g. 100mbit or 1gbit")
    return rate.strip().lower()


def parse_delay(delay) -> float:
    """A one-way link delay such as 50ms (or seconds as a number), in seconds."""
    if isinstance(delay, (int, float)) and not isinstance(delay, bool) and 0 <= delay < 10:
        return float(delay)
    m = _DELAY.match(delay.strip().lower()) if isinstance(delay, str) else None
    if m is None:
        raise ValueError(f"unparsable link delay {delay!r}; use a number followed by us, ms "
                         "or s, e.g. 50ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def enter_netns(name: str, hostname: Optional[str] = None) -> None:
    """Move the calling thread, and every thread it starts from now on, into network
    namespace `name` (what `ip netns exec` does for a new process). `hostname`: also
    a UTS namespace of its own whose host name is that (the node's address), for code
    that advertises `socket.gethostname()` to its peers, as torchft's stores do."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise ClusterError(f"cannot enter network namespace {name}: "
                               f"{os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    if hostname is not None:
        if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(
                hostname.encode(), len(hostname)) != 0:
            raise ClusterError(f"cannot give node {name} the host name {hostname}: "
                               f"{os.strerror(ctypes.get_errno())}")


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, the reason)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    probe = f"zppprobe{os.getpid()}"  # concurrent callers must not collide
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def _tc(ns: str, dev: str, rate: str) -> None:
    r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", str(BURST), "latency", f"{LATENCY_S * 1000:g}ms"], capture_output=True, text=True)
    if r.returncode != 0:
        raise ClusterError(f"tc tbf {rate} on {ns}/{dev} failed: {r.stderr.strip()}")


def link_counters(net_dev: str, dev: str = "cl0") -> Optional[tuple[int, int]]:
    """(rx, tx) bytes of `dev` from the text of /proc/net/dev; None if absent."""
    for line in net_dev.splitlines():
        if line.strip().startswith(f"{dev}:"):
            f = line.split(":", 1)[1].split()
            return int(f[0]), int(f[8])
    return None


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """SIGINT and SIGTERM recorded inside, then handed to their handlers at the end (a
    KeyboardInterrupt, main()'s Terminated). Python runs its handlers in the main thread,
    whichever thread a signal reaches, so none is lost, as one ignored or blocked in one
    thread could be."""
    stops = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(
            signal.getsignal, stops):  # (a handler not set from Python cannot be put back)
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in stops}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in got[:1]:
            if callable(old[s]):
                old[s](s, None)
            elif old[s] == signal.SIG_DFL:
                signal.raise_signal(s)


def leftovers(prefix: str) -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                       start_new_session=True)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(re.escape(prefix) + r"(\d+|sw)", n)]


class Cluster:
    def __init__(self, nodes: int, rate: Optional[str] = "100mbit", prefix: str = "zpp",
                 delay=0.0) -> None:
        """`rate` None: unshaped links (veth speed; a compute baseline). `delay`: each
        packet's one-way delay between two nodes (e.g. "50ms": a 100 ms round trip)."""
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes!r} is invalid; the emulated subnet holds 1 to "
                             f"{MAX_NODES} nodes")
        self.nodes, self.prefix = nodes, prefix
        self.rate = None if rate is None else parse_rate(rate)
        self.switch = f"{prefix}sw"
        self.delay = parse_delay(delay)
        self.relay: Optional[subprocess.Popen] = None
        # with a delay, after the cluster is torn down: (src node, dst node, sport, dport,
        # IP bytes, TCP payload bytes) of every flow the relay carried
        self.flows: list[tuple[int, int, int, int, int, int]] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    @staticmethod
    def addr(i: int) -> str:
        return f"10.77.0.{i + 1}"

    def __enter__(self) -> Cluster:
        ok, why = available()
        if not ok:
            raise ClusterError(why)
        self.teardown()  # a killed run's namespaces must not break this one
        try:
            if self.delay > 0:
                self._tun_links()
                return self
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.nodes):
                ns, port = self.ns(i), f"p{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", "cl0", "netns", ns, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "cl0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "cl0")
                if self.rate is not None:
                    _tc(ns, "cl0", self.rate)            # uplink
                    _tc(self.switch, port, self.rate)    # downlink
        except BaseException:
            self.teardown()
            raise
        return self

    def _tun_links(self) -> None:
        for i in range(self.nodes):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            _ip("-n", ns, "tuntap", "add", "dev", "cl0", "mode", "tun")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "cl0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "cl0")
            if self.rate is not None:
                _tc(ns, "cl0", self.rate)  # uplink; the relay serializes the downlink
        rate = float("inf") if self.rate is None else rate_bytes_per_s(self.rate)
        self.relay = subprocess.Popen(
            [sys.executable, "-m", "zeropp.bench.relay", self.prefix, str(self.nodes),
             repr(self.delay), repr(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        if self.relay.stdout.readline().strip() != "ready":
            self.relay.kill()
            self.relay.wait()
            raise ClusterError("the link relay (zeropp.bench.relay) did not start; its error "
                               "is above")

    def flow_bytes(self) -> list[tuple[int, int, int, int, int, int]]:
        """With a delay: the flows the relay has carried so far (see `flows`)."""
        if self.relay is None:
            raise ClusterError("flow_bytes needs a cluster with a delay (the relay counts)")
        self.relay.stdin.write("\n")
        self.relay.stdin.flush()
        return [tuple(f) for f in json.loads(self.relay.stdout.readline())]

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        # Whole, even at a Ctrl-C or SIGTERM, raised after it: one raised between two `ip
        # netns del`s left namespaces behind (and the `ip`s took the terminal's Ctrl-C)
        with _stops_held():
            self._teardown()

    def _teardown(self) -> None:
        if self.relay is not None:
            try:  # stdin closing is its signal to stop; it answers with its flows
                out, _ = self.relay.communicate(timeout=10)
                self.flows = [tuple(f) for f in json.loads(out.splitlines()[-1])]
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                self.relay.kill()
                self.relay.wait()
            self.relay = None
        for name in leftovers(self.prefix):
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                      text=True, start_new_session=True).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True,
                           start_new_session=True)

    def counters(self, i: int) -> tuple[int, int]:
        """(rx, tx) bytes of node i's link, read inside its namespace."""
        r = subprocess.run(["ip", "netns", "exec", self.ns(i), "cat", "/proc/net/dev"],
                           capture_output=True, text=True, check=True)
        counters = link_counters(r.stdout)
        if counters is None:
            raise ClusterError(f"no cl0 interface in {self.ns(i)}")
        return counters

    def popen(self, i: int, cmd: Sequence[str], env: Optional[dict] = None,
              **kw) -> subprocess.Popen:
        """Start `cmd` inside node i (gloo told to use the node's link)."""
        full_env = dict(os.environ, GLOO_SOCKET_IFNAME="cl0", **(env or {}))
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd], env=full_env, **kw)


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (see parse_rate) in bytes per second."""
    num, unit = _RATE.match(parse_rate(rate)).groups()
    return float(num) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[unit] / 8
