"""A NAT lab built from Linux network namespaces: a public segment and private LANs behind NAT
routers doing nftables masquerade. Needs root, `ip` (iproute2) and `nft` (nftables).

    with NatLab() as lab:
        lab.add_public("relay")                     # a host on the public segment
        lab.add_private("a", nat="cone")            # a host behind its own router
        lab.add_private("b", nat="symmetric")
        lab.run("a", ["ping", "-c", "1", lab.ip("relay")])
        argv = lab.prefix("a") + ["shardnet", "join", ...]   # run anything inside a host

Topology: a hub namespace holds a bridge, the public segment 203.0.113.0/24 (TEST-NET-3; another
with ``NatLab(public_net=...)``).
Public hosts sit on it directly. Each private host has a router namespace with a WAN leg on the
bridge (203.0.113.100 + i) and a LAN leg to the host: 198.51.100.0/24 (TEST-NET-2) cut into
/28s, router .1, host .2 of each. Routers forward, masquerade what leaves the WAN leg and, like
home routers, silently drop unsolicited inbound packets (no RST that would abort a hole punch).

NAT types:
- ``cone``: endpoint-independent mapping: Linux masquerade keeps the source port when it is
  free, so a socket's mapping is the same towards every destination. TCP hole punching works.
- ``symmetric``: ``masquerade fully-random``: every connection gets a random public port, so
  the port a third party observed is useless to anyone else. Hole punching fails.

Namespace names start with ``snl<pid>-`` so parallel runs do not collide and leftovers of a
crashed run can be found: ``python -m shardnet.testing.natlab cleanup`` deletes those whose process is
gone. Teardown kills every process still running inside the lab's namespaces, then deletes them;
it runs on exit from the ``with`` block whatever happened inside.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardnet.errors import ShardnetError
from shardnet.testing.localswarm import LocalSwarm, ShardnetProcess

log = logging.getLogger(__name__)

PUBLIC_NET = ipaddress.ip_network("203.0.113.0/24")
#: A public segment outside the special-purpose ranges, for peers that refuse to hole punch to
#: documentation addresses (js-libp2p counts TEST-NET ranges as private). The lab's namespaces
#: have no route out of the lab, so no real host at these addresses is ever reached.
GLOBAL_NET = ipaddress.ip_network("16.0.113.0/24")
PRIVATE_NETS = list(ipaddress.ip_network("198.51.100.0/24").subnets(new_prefix=28))
NAT_TYPES = ("cone", "symmetric")


class LabError(ShardnetError, RuntimeError):
    """A lab command failed, or the lab cannot be built here."""

    code = "lab"


def available() -> str | None:
    """None if a lab can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` (apt install {'iproute2' if tool == 'ip' else 'nftables'})"
    name = f"snl{os.getpid()}-probe"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "exec", name, "nft", "add", "table", "ip", "probe")
    except LabError as e:
        return f"network namespaces or nftables are unavailable: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _sh(*argv: str, input: str | None = None) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30, input=input)
    if res.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    router: str | None = None  # the router's namespace, for private hosts
    public_ip: str | None = None  # what the rest of the lab sees: the router's WAN address
    nat: str | None = None


class NatLab:
    def __init__(self, public_net: str | ipaddress.IPv4Network = PUBLIC_NET) -> None:
        self.public_net = ipaddress.ip_network(public_net)
        if self.public_net.num_addresses < 256 or any(self.public_net.overlaps(n) for n in PRIVATE_NETS):
            raise ValueError(f"the public segment must be a /24 or larger, apart from {PRIVATE_NETS[0].supernet(4)}")
        self.tag = f"snl{os.getpid()}-"
        self.hub = self.tag + "hub"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._publics = 0
        self._routers = 0
        self.processes: list[ShardnetProcess] = []

    # -- building -----------------------------------------------------------------------------

    def __enter__(self) -> NatLab:
        why = available()
        if why:
            raise LabError(why)
        try:
            self._netns(self.hub)
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._namespaces.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _ip(self, netns: str, *argv: str) -> None:
        _sh("ip", "-n", netns, *argv)

    def _to_hub(self, netns: str, ifname: str, hub_if: str, addr: str) -> None:
        _sh("ip", "link", "add", ifname, "netns", netns, "type", "veth", "peer", "name", hub_if, "netns", self.hub)
        self._ip(self.hub, "link", "set", hub_if, "master", "br0", "up")
        self._ip(netns, "addr", "add", f"{addr}/{self.public_net.prefixlen}", "dev", ifname)
        self._ip(netns, "link", "set", ifname, "up")

    def add_public(self, name: str) -> Host:
        """A host with an address on the public segment."""
        self._check_name(name)
        self._publics += 1
        ip = str(self.public_net[10 + self._publics])
        host = Host(name, self.tag + name, ip, public_ip=ip)
        self._netns(host.netns)
        self._to_hub(host.netns, "eth0", f"p{self._publics}", ip)
        self.hosts[name] = host
        return host

    def add_private(self, name: str, nat: str = "cone") -> Host:
        """A host alone on a private LAN behind its own NAT router."""
        if nat not in NAT_TYPES:
            raise ValueError(f"unknown NAT type {nat!r} (choose from {', '.join(NAT_TYPES)})")
        self._check_name(name)
        if self._routers >= len(PRIVATE_NETS):
            raise LabError("out of private networks")
        lan = PRIVATE_NETS[self._routers]
        self._routers += 1
        wan_ip = str(self.public_net[100 + self._routers])
        router = self.tag + "r-" + name
        host = Host(name, self.tag + name, str(lan[2]), router=router, public_ip=wan_ip, nat=nat)
        self._netns(router)
        self._netns(host.netns)
        self._to_hub(router, "wan0", f"r{self._routers}", wan_ip)
        _sh("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        self._ip(router, "addr", "add", f"{lan[1]}/{lan.prefixlen}", "dev", "lan0")
        self._ip(router, "link", "set", "lan0", "up")
        self._ip(host.netns, "addr", "add", f"{lan[2]}/{lan.prefixlen}", "dev", "eth0")
        self._ip(host.netns, "link", "set", "eth0", "up")
        self._ip(host.netns, "route", "add", "default", "via", str(lan[1]))
        _sh("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        masquerade = "masquerade fully-random" if nat == "symmetric" else "masquerade"
        _sh("ip", "netns", "exec", router, "nft", "-f", "-", input=f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" {masquerade}
    }}
}}
table ip filter {{
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }}
}}
""")
        self.hosts[name] = host
        return host

    def _check_name(self, name: str) -> None:
        if name in self.hosts or not name.isidentifier() or len(self.tag + "r-" + name) > 40:
            raise ValueError(f"bad or duplicate host name {name!r}")

    # -- using --------------------------------------------------------------------------------

    def ip(self, name: str) -> str:
        """The host's own address (private hosts: on their LAN)."""
        return self.hosts[name].ip

    def public_ip(self, name: str) -> str:
        """The address the public segment sees the host at."""
        return self.hosts[name].public_ip

    def prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command inside the host."""
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def run(self, name: str, argv: list[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(self.prefix(name) + argv, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise LabError(f"{name}: {' '.join(argv)} exited {res.returncode}: {res.stderr.strip()[-300:]}")
        return res

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.prefix(name) + argv, **kw)

    # -- shardnet processes in the lab (stopped by the lab on close, before its namespaces go) --

    def start_relay(self, name: str, workdir: Path, *, port: int = 4001) -> tuple[ShardnetProcess, str]:
        """`shardnet relay` on host ``name``; the process and its full address."""
        relay = self._track(ShardnetProcess(name, ["relay", "--identity", str(workdir / f"{name}.key"), "--listen",
                                                   f"/ip4/0.0.0.0/tcp/{port}", "--reservation-ttl", "30"],
                                            workdir=workdir, prefix=self.prefix(name)))
        rid = relay.wait_for_line(lambda s: s.startswith("relay node "), 60).split()[-1]
        relay.wait_for_line(lambda s: s.startswith("ready"), 30)
        return relay, f"/ip4/{self.ip(name)}/tcp/{port}/p2p/{rid}"

    def start_node(self, name: str, workdir: Path, *extra: str, port: int = 4001) -> tuple[ShardnetProcess, str]:
        """`shardnet node --events` on host ``name``; the process and its peer ID."""
        p = self._track(ShardnetProcess(name, ["node", "--events", "--identity", str(workdir / f"{name}.key"),
                                               "--listen", f"/ip4/0.0.0.0/tcp/{port}", *extra],
                                        workdir=workdir, prefix=self.prefix(name)))
        return p, LocalSwarm.wait_ready(p, 60)["peer_id"]

    def _track(self, p: ShardnetProcess) -> ShardnetProcess:
        self.processes.append(p)
        return p

    # -- tearing down -------------------------------------------------------------------------

    def close(self) -> None:
        for p in self.processes:
            p.stop()
        self.processes.clear()
        for ns in reversed(self._namespaces):
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._namespaces.clear()
        self.hosts.clear()


def wait_until(probe, timeout: float, what: str, step: float = 0.3, detail=lambda: ""):
    """``probe()`` until it returns something truthy, which is returned; AssertionError naming
    ``what`` (and ``detail()``) if it does not within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s{detail()}")
        time.sleep(step)
    return got


def wait_status(p: ShardnetProcess, pred, timeout: float, what: str, step: float = 0.3) -> dict:
    """Poll a `node --events` process's status until ``pred(status)`` holds; AssertionError naming
    ``what`` and the last status if it does not within ``timeout`` s."""
    last: dict = {}

    def probe() -> dict | None:
        last["status"] = st = p.command({"cmd": "status"})
        return st if pred(st) else None

    return wait_until(probe, timeout, what, step, detail=lambda: ": " + json.dumps(last.get("status"), indent=1))


def wait_reserved(p: ShardnetProcess, relay_addr: str, timeout: float = 30) -> dict:
    rid = relay_addr.rsplit("/p2p/", 1)[1]
    return wait_status(p, lambda st: rid in st["reservations"], timeout, f"reservation at {rid}")


def wait_direct(p: ShardnetProcess, peer: str, timeout: float = 30) -> dict:
    return wait_status(p, lambda st: any(not c["relayed"] for c in st["connections"].get(peer, [])), timeout,
                       f"direct connection to {peer}")


def _kill_inside(netns: str) -> None:
    res = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith("snl") or "-" not in name:
            continue
        pid = name[3:name.index("-")]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "demo"
    if cmd == "cleanup":
        for name in cleanup_stale():
            print(f"removed {name}")
        return 0
    if cmd == "demo":
        with NatLab() as lab:
            lab.add_public("relay")
            lab.add_private("a", "cone")
            lab.add_private("b", "symmetric")
            for name, h in lab.hosts.items():
                print(f"{name:6} {h.nat or 'public':9} {h.ip:15} seen as {h.public_ip}")
            probe = ("import socket; s = socket.create_connection((%r, 9), timeout=2)" % lab.ip("relay"))
            res = lab.run("a", [sys.executable, "-c", probe], check=False)
            print("a -> relay:", "refused (reachable, nothing listening)" if "refused" in res.stderr
                  else res.stderr.strip().splitlines()[-1] if res.stderr else "connected")
        return 0
    print("usage: python -m shardnet.testing.natlab [demo|cleanup]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
