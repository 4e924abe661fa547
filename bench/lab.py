"""The rate-limited lab for bench/allreduce.py: build it, give its cables addresses, reach it.

The lab is meshkit's own (playbooks/lab.yml: hosts are network namespaces, cables veth pairs
limited by tc tbf); setup.yml then gives every cable a point-to-point network and writes the
hostfiles (meshccl.json, mlx-ring.json) the ranks use. Ranks run inside the hosts with
`ip netns exec <lab>-node<i>`. Removing the lab (playbooks/lab.yml -e lab_state=absent) removes
everything it made, the routes added here included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


class LabError(Exception):
    pass


def parse_rate(text: str) -> float:
    """A tc rate (500mbit, 1gbit, 2Gbit) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?", text.strip().lower())
    if not m:
        raise ValueError(f"'{text}' is not a rate like 500mbit or 1gbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value


def ansible_env(tree: Path = REPO) -> dict[str, str]:
    """The environment that runs a checkout's playbooks with its own code: this one's (the shared virtual
    environment's editable install points here), or another worktree's (bench/ab.py's base), whose package
    and collection then come first on sys.path."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(
        PATH=f"{bindir}:{os.environ.get('PATH', '')}",
        ANSIBLE_CONFIG=str(tree / "ansible.cfg"),
        ANSIBLE_HOME=str(tree / ".cache" / "ansible-home"),
        ANSIBLE_NOCOLOR="1",
    )
    if tree != REPO:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / ".collections")])
    return env


@dataclass
class Link:
    host: str
    port: str
    address: str
    peer_host: str
    peer_address: str
    cable: str  # "node1:tb0 <-> node2:tb0"

    @property
    def peer_end(self) -> str:
        """The cable's other end, host:port."""
        ends = [e.strip() for e in self.cable.split("<->")]
        return next((e for e in ends if e != f"{self.host}:{self.port}"), self.peer_host)


@dataclass
class Lab:
    name: str
    shape: str
    size: int
    rate: str
    subnet: str
    log: Path
    artifacts: Path
    netns: dict[str, str] = field(default_factory=dict)  # host -> namespace
    meshccl: dict[str, Any] = field(default_factory=dict)  # meshccl.json
    built: bool = False

    @property
    def hostfiles(self) -> Path:
        return self.artifacts / "hostfiles"

    @property
    def inventory(self) -> Path:
        return REPO / "inventory" / f"{self.name}.yml"

    def _playbook(self, *args: str) -> None:
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(f"\n$ ansible-playbook {' '.join(args)}\n")
            out.flush()
            # Its own session: a Ctrl-C at the terminal reaches this driver only, which then decides
            # (stop a build, but never a removal).
            rc = subprocess.run(
                ["ansible-playbook", *args],
                cwd=REPO,
                env=ansible_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
                start_new_session=True,
            ).returncode
        if rc != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
            raise LabError(f"ansible-playbook {args[0]} failed (rc {rc}); log {self.log}:\n  " + "\n  ".join(tail))

    def _lab_vars(self, **more: Any) -> list[str]:
        variables = {
            "lab_name": self.name,
            "lab_shape": self.shape,
            "lab_size": self.size,
            "lab_link_rate": self.rate,
            "lab_mgmt_subnet": self.subnet,
            **more,
        }
        return ["-e", json.dumps(variables)]

    def up(self) -> None:
        """Builds the lab, then converges its network with setup.yml (addresses, hostfiles)."""
        self.built = True  # from here on, down() must run even if the build fails half-way
        self._playbook("playbooks/lab.yml", *self._lab_vars())
        # The ranks run this machine's own interpreter (sys.executable, inside each host's namespace), never
        # the meshccl setup.yml would build and install on every host: skip that (minutes of compiling).
        self._playbook(
            "-i",
            str(self.inventory),
            "setup.yml",
            "-e",
            f"meshkit_artifacts_dir={self.artifacts}",
            "-e",
            '{"meshkit_meshccl_install": false}',
        )
        inv = yaml.safe_load(self.inventory.read_text())
        hosts = inv["all"]["children"]["cluster"]["hosts"]
        self.netns = {name: h["meshkit_lab_netns"] for name, h in hosts.items()}
        self.meshccl = json.loads((self.hostfiles / "meshccl.json").read_text())

    def down(self) -> None:
        if self.built:
            self._playbook("playbooks/lab.yml", *self._lab_vars(lab_state="absent"))
            self.built = False

    # --- what the hostfiles say -------------------------------------------------------------

    def ranks(self) -> list[dict[str, Any]]:
        return sorted(self.meshccl["ranks"], key=lambda r: r["rank"])

    def links(self) -> list[Link]:
        """Every cable end, host by host (the rank entries of meshccl.json, one rank per host)."""
        seen: set[tuple[str, str]] = set()
        out = []
        for r in self.ranks():
            for link in r.get("links", []):
                if (r["host"], link["port"]) in seen:
                    continue
                seen.add((r["host"], link["port"]))
                out.append(
                    Link(
                        r["host"], link["port"], link["address"], link["peer_host"], link["peer_address"], link["cable"]
                    )
                )
        return out

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns[host]]

    def mlx_rank_hosts(self) -> list[str]:
        """The host of each MLX ring rank (mlx-hostfile.json lists hosts by management address)."""
        by_mgmt = {h["management"]: name for name, h in self.meshccl["hosts"].items()}
        mlx = json.loads((self.hostfiles / "mlx-hostfile.json").read_text())
        return [by_mgmt[h["ssh"]] for h in mlx["hosts"]]

    # --- reaching every rank from every rank, for Gloo ----------------------------------------

    def gloo_routes(self) -> tuple[list[tuple[str, str, str, str]], bool]:
        """Host routes so every cable address is reachable from every host over the cables.

        Gloo gives every rank one address (its GLOO_SOCKET_IFNAME's) and connects every pair of
        ranks to it; a cable's /30 only reaches the host at its other end. A /32 route per
        remote address, via the first hop of a shortest path over the cables, fixes that: ring
        neighbours always meet on their own cable, a 4-ring's opposite hosts go through a
        neighbour (which then must forward). Returns (host, address, via, port) and whether
        any path has more than one hop.
        """
        links = self.links()
        adjacent: dict[str, dict[str, tuple[str, str]]] = {}
        owner: dict[str, str] = {}
        for link in links:
            adjacent.setdefault(link.host, {}).setdefault(link.peer_host, (link.peer_address, link.port))
            owner[link.address] = link.host
        routes, forward = [], False
        for host in sorted(adjacent):
            direct = {link.peer_address for link in links if link.host == host}
            for address, other in sorted(owner.items()):
                if other == host or address in direct:
                    continue
                path = _shortest_path(adjacent, host, other)
                if path is None:
                    raise LabError(f"{other} cannot be reached from {host} over the cables")
                forward |= len(path) > 2
                via, port = adjacent[host][path[1]]
                routes.append((host, address, via, port))
        return routes, forward

    def add_gloo_routes(self) -> str:
        routes, forward = self.gloo_routes()
        for host, address, via, port in routes:
            _sh("ip", "-n", self.netns[host], "route", "replace", f"{address}/32", "via", via, "dev", port)
        if forward:
            for host in self.netns:
                _sh(*self.prefix(host), "sysctl", "-qw", "net.ipv4.ip_forward=1")
        return f"{len(routes)} host routes over the cables" + (", IP forwarding on every host" if forward else "")


def _shortest_path(adjacent: dict[str, dict[str, Any]], start: str, goal: str) -> list[str] | None:
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while (prev := previous[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for nxt in sorted(adjacent.get(node, {})):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def _sh(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {proc.stderr.strip()}")
