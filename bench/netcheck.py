"""TCP ceilings with iperf3: loopback one way and both ways at once; every lab link at once.

Every flow is one iperf3 server (one test, bound to one address) and one client; all clients
of a measurement run at the same time. A rate is what the receiver counted (sum_received), with
the first second left out (-O 1) so a token bucket's initial burst or slow start does not count.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from jobs import kill_group


class IperfError(Exception):
    pass


@dataclass
class Flow:
    """Data from `src` to `dst`: the server listens on dst, the client (bound to src) connects."""

    name: str
    dst_addr: str
    port: int
    dst_prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", ns]
    src_addr: str = ""
    src_prefix: list[str] = field(default_factory=list)
    reverse: bool = False  # the server sends (iperf3 -R): data runs dst -> src
    rate: float = 0.0  # bytes/s, filled in by run_flows


def available() -> str:
    """'' if iperf3 is usable, else why not."""
    return "" if shutil.which("iperf3") else "iperf3 is not installed (apt-get install iperf3)"


def _wait_listening(server: subprocess.Popen[bytes], timeout: float) -> None:
    assert server.stdout is not None
    fd, seen = server.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            seen += chunk
            if b"listening" in seen.lower():
                return
            if not chunk:
                break
    raise IperfError(f"iperf3 server did not start: {seen.decode(errors='replace').strip()[-300:]}")


def run_flows(flows: list[Flow], seconds: float) -> list[Flow]:
    """Runs every flow at once for `seconds` (+1 s left out); fills in each flow's rate."""
    servers: list[subprocess.Popen[bytes]] = []
    clients: list[subprocess.Popen[str]] = []
    try:
        for f in flows:
            servers.append(
                subprocess.Popen(
                    [*f.dst_prefix, "iperf3", "-s", "-1", "-B", f.dst_addr, "-p", str(f.port), "--forceflush"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for s in servers:
            _wait_listening(s, 10)
        for f in flows:
            argv = [*f.src_prefix, "iperf3", "-c", f.dst_addr, "-p", str(f.port), "-t", f"{seconds:g}", "-O", "1", "-J"]
            if f.src_addr:
                argv += ["-B", f.src_addr]
            if f.reverse:
                argv.append("-R")
            clients.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        for f, c in zip(flows, clients, strict=True):
            out, err = c.communicate(timeout=seconds + 30)
            report: dict[str, Any] = {}
            try:
                report = json.loads(out)
                f.rate = float(report["end"]["sum_received"]["bits_per_second"]) / 8
            except (ValueError, KeyError, TypeError) as e:
                why = report.get("error") if isinstance(report, dict) else None
                raise IperfError(f"{f.name}: iperf3 gave no rate ({why or err.strip() or e})") from None
        return flows
    except subprocess.TimeoutExpired:
        raise IperfError("iperf3 did not finish in time") from None
    finally:
        for p in [*clients, *servers]:
            if p.poll() is None:
                kill_group(p)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def loopback_ceiling(seconds: float) -> dict[str, float]:
    """Loopback TCP in bytes/s: one flow alone; then two flows in opposite directions at once."""
    one = run_flows([Flow("one way", "127.0.0.1", free_port())], seconds)[0].rate
    both = run_flows(
        [
            Flow("forward", "127.0.0.1", free_port()),
            Flow("reverse", "127.0.0.1", free_port(), reverse=True),
        ],
        seconds,
    )
    return {"oneway": one, "bidir_forward": both[0].rate, "bidir_reverse": both[1].rate}
