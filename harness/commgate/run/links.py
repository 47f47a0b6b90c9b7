"""Links of chosen speeds between local ranks: two network namespaces ("nodes") joined by a veth pair
shaped with ``tc`` (Linux, root), for the interconnect study (Qi et al., *Early Experience in
Characterizing Training Large Language Models on Modern HPC Clusters*: the communication fraction
against iteration time as the link slows).

The ranks are split in two halves, the first on node 0 and the rest on node 1, as on two machines:
traffic inside a half stays on its namespace (unshaped), traffic between the halves crosses the shaped
link. Each rank process enters its node's namespace right after it is forked (``enter``), before it
opens a socket; the rendezvous is a file store, reachable from both. The namespaces and the veth pair
are removed on exit, on failure too; nothing of the host's own network is touched.

Rate is shaped by a token bucket (``tbf``) on each end; a delay needs ``netem`` (the ``sch_netem``
kernel module), and asking for one without it is an error naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from commgate.core.errors import UsageError

_SPEC = re.compile(r"^\s*(?P<rate>\d+(\.\d+)?)\s*(?P<unit>[kmg])bit\s*(,\s*(?P<delay>\d+(\.\d+)?)\s*us)?\s*$", re.I)
NETNS = "COMMGATE_NETNS"
"""The environment variable that tells a rank process which namespace to enter (``enter``)."""
LINK = "COMMGATE_LINK"
"""The link's description, recorded in the capture's stack."""


@dataclass(frozen=True, slots=True)
class Link:
    rate_mbit: float
    delay_us: float = 0.0

    @classmethod
    def parse(cls, text: str, *, source: str = "--link") -> Link:
        """``10gbit``, ``500mbit``, ``25gbit,20us``; a bad one is a one-line usage error naming ``source``,
        where the text came from (the flag, the environment variable, a report's field)."""
        m = _SPEC.match(text)
        if not m:
            raise UsageError(f"{source} {text!r}: expected RATE[kmg]bit[,DELAYus], e.g. 10gbit or 25gbit,20us")
        rate = float(m["rate"]) * {"k": 1e-3, "m": 1.0, "g": 1e3}[m["unit"].lower()]
        if rate <= 0:
            raise UsageError(f"{source} {text!r}: the rate must be positive")
        return cls(rate_mbit=rate, delay_us=float(m["delay"] or 0))

    def __str__(self) -> str:
        rate = f"{self.rate_mbit / 1e3:g}gbit" if self.rate_mbit >= 1e3 else f"{self.rate_mbit:g}mbit"
        return rate + (f",{self.delay_us:g}us" if self.delay_us else "")


def node_of(rank: int, world: int) -> int:
    """Node 0 holds the first half of the ranks, node 1 the rest."""
    return 0 if rank < (world + 1) // 2 else 1


def refusal() -> str | None:
    """Why shaped links cannot be made here, or None."""
    if os.uname().sysname != "Linux":
        return "shaped links need Linux network namespaces"
    if os.geteuid() != 0:
        return "shaped links need root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"shaped links need {' and '.join(missing)} (iproute2)" if missing else None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"`{' '.join(argv)}` failed: {last}")


@dataclass(frozen=True, slots=True)
class Network:
    """Two namespaces joined by a shaped veth pair."""

    link: Link
    names: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]

    def env(self, rank: int, world: int) -> dict[str, str]:
        """What a rank process needs to run on its node: the namespace to enter and the interface gloo
        (and NCCL's bootstrap) open their sockets on."""
        node = node_of(rank, world)
        dev = self.devices[node]
        return {NETNS: self.names[node], "GLOO_SOCKET_IFNAME": dev, "NCCL_SOCKET_IFNAME": dev, LINK: str(self.link)}


@contextlib.contextmanager
def shaped(link: Link) -> Iterator[Network]:
    """Two namespaces joined by a veth pair shaped to ``link``, removed on exit."""
    if why := refusal():
        raise UsageError(why)
    tag = f"cg{os.getpid() % 100000}"
    names = (f"{tag}n0", f"{tag}n1")
    devices = (f"{tag}v0", f"{tag}v1")
    subnet = 16 + os.getpid() % 200
    addresses = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")
    try:
        for n in names:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", devices[0], "type", "veth", "peer", "name", devices[1])
        for n, dev, addr in zip(names, devices, addresses, strict=True):
            _run("ip", "link", "set", dev, "netns", n)
            _run("ip", "-n", n, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", n, "link", "set", dev, "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
            _shape(n, dev, link)
        yield Network(link=link, names=names, devices=devices, addresses=addresses)
    finally:
        for n in names:  # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _shape(namespace: str, dev: str, link: Link) -> None:
    """The egress qdisc of ``dev``: netem with the delay (and the rate), or a token bucket of ~1 ms at the
    rate (at least 64 KiB) queueing at most 10 ms."""
    rate = f"{link.rate_mbit:g}mbit"
    if link.delay_us:
        qdisc = ["netem", "delay", f"{link.delay_us:g}us", "rate", rate]
    else:
        qdisc = [
            "tbf",
            "rate",
            rate,
            "burst",
            str(max(64 << 10, int(link.rate_mbit * 1e6 / 8 / 1000))),
            "latency",
            "10ms",
        ]
    try:
        _run("tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", *qdisc)
    except UsageError as exc:
        if link.delay_us:
            raise UsageError(f"--link {link}: a delay needs tc's netem (kernel module sch_netem): {exc}") from None
        raise


SET_BY = "commgate run --link sets it for its ranks; unset it"
"""The fix a bad ``COMMGATE_NETNS`` or ``COMMGATE_LINK`` in a user's environment names."""


def enter() -> None:
    """In a freshly forked rank process: move into the namespace ``COMMGATE_NETNS`` names (none: stay); one
    that cannot be entered is a one-line ``UsageError`` naming the variable, what it raised and the fix."""
    name = os.environ.get(NETNS)
    if not name:
        return
    import ctypes

    clone_newnet = 0x40000000
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        finally:
            os.close(fd)
    except OSError as exc:
        raise UsageError(
            f"{NETNS} {name!r}: cannot enter network namespace /run/netns/{name} ({exc.strerror or exc}); {SET_BY}"
        ) from None


def from_environment() -> Link | None:
    """The link ``COMMGATE_LINK`` describes (None: not set); a bad one is a one-line error naming it."""
    text = os.environ.get(LINK)
    return Link.parse(text, source=f"{LINK} (environment; {SET_BY})") if text else None
