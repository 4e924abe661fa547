"""Claims on the labs' management subnets, so that labs built at once on one machine never share one.

Test labs (tests/integration/conftest.py, counting up from 198.19.1.0/24) and the scale bench
(bench/scale.py, counting down from 198.19.248.0/24) each take a 198.19.x.0/24. A claim is a file named
after x in ``CLAIMS``, created with O_EXCL and holding the claiming process's pid: test runs of several
checkouts, pytest-xdist workers and benches never pick the same subnet, and the claim of a process that
is gone is taken over.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

CLAIMS = Path("/run/meshkit-test-subnets")
LAB_RANGE = ipaddress.ip_network("198.19.0.0/16")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def machine_routes() -> list[dict]:
    """This machine's IPv4 routes, every table (``ip -j route``)."""
    argv = ["ip", "-j", "-4", "route", "show", "table", "all"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return json.loads(proc.stdout or "[]") if proc.returncode == 0 else []


def overlapping(routes: list[dict], subnet: str) -> list[str]:
    """Those of ``routes`` that overlap ``subnet``, as ``DST dev DEV``."""
    net = ipaddress.ip_network(subnet)
    out = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("", "default"):
            continue
        try:
            if ipaddress.ip_network(dst, strict=False).overlaps(net):
                out.append(f"{dst} dev {route.get('dev', '?')}")
        except ValueError:
            continue
    return out


def routes_in(subnet: str) -> list[str]:
    """This machine's routes (every table) that overlap ``subnet``, as ``DST dev DEV``."""
    return overlapping(machine_routes(), subnet)


def claim(octet: int, claims: Path = CLAIMS) -> bool:
    """Claim 198.19.<octet>.0/24 for this process: True when it is now ours (a dead owner's is taken
    over), False when a live process holds it.

    Claimers take ``claims/.lock`` (flock) first: between creating a claim and writing its pid, and
    between finding a dead owner and taking its claim over, another claimer would see an empty file
    or a claim just taken and count it as free (two pytest-xdist workers starting at once both got
    198.19.1.0/24)."""
    claims.mkdir(parents=True, exist_ok=True)
    path = claims / str(octet)
    with open(claims / ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            owner = int(path.read_text().strip() or 0)
        except FileNotFoundError:
            owner = 0
        except (OSError, ValueError):
            return False
        if owner and alive(owner):
            return False
        tmp = claims / f".{octet}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, path)  # the claim appears with its owner in it, also to claimers without the lock
        return True


def release(subnet: str, claims: Path = CLAIMS) -> None:
    """Give ``subnet``'s claim back, if this process holds it."""
    net = ipaddress.ip_network(subnet)
    if not net.subnet_of(LAB_RANGE):
        return
    path = claims / str(net.network_address.packed[2])
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def first_free(
    octets: Iterable[int], claims: Path = CLAIMS, routes: Callable[[str], list[str]] | None = None
) -> str | None:
    """The first 198.19.<octet>.0/24 of ``octets`` that no route of this machine touches (``routes``:
    the routes overlapping a subnet; by default from one read of the routing tables), now claimed for
    this process; None when every one is taken."""
    if routes is None:
        table = machine_routes()

        def routes(subnet: str) -> list[str]:
            return overlapping(table, subnet)

    for octet in octets:
        subnet = f"198.19.{octet}.0/24"
        if not routes(subnet) and claim(octet, claims):
            return subnet
    return None
