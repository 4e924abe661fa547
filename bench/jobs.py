"""Library jobs for bench/allreduce.py: start the ranks, talk to them, stop them.

A job is one library at one rank count. Its ranks (worker.py) connect to one UNIX control
socket; the driver sends each rank the same command and waits for every reply. Every process
is started in its own session, so a job is stopped by its own process ids (the whole group
of a process we started), never by a name pattern.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("worker.py")


class JobError(Exception):
    """A job that could not start or did not answer; the message says why."""


@dataclass
class Proc:
    """One process to start: argv (a worker, or mpirun running workers) and extra environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Launch:
    """How to start one library at one rank count."""

    label: str  # as shown in tables: meshccl, meshccl-tcp, gloo, mlx, mpi-shm, mpi-tcp
    ranks: int
    job: str  # id the ranks present to the driver (unique per start)
    procs: list[Proc]
    note: str = ""  # how it runs (transport, interface), for the report
    missing: str = ""  # why it cannot run here (a tool not installed); then it is not started


def worker_argv(lib: str, ctl: str, job: str, prefix: list[str] | None = None) -> list[str]:
    return [*(prefix or []), sys.executable, str(WORKER), "--lib", lib, "--ctl", ctl, "--job", job]


class Control:
    """The driver's UNIX control socket, shared by every job of a run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)

    def accept(self, timeout: float) -> socket.socket | None:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        conn, _ = self.sock.accept()
        return conn

    def close(self) -> None:
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)


class Job:
    def __init__(self, launch: Launch, log: Path) -> None:
        self.launch, self.id, self.log = launch, launch.job, log
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: dict[int, tuple[socket.socket, IO[str]]] = {}
        self.error = ""
        self.info = ""  # what the ranks reported about themselves (e.g. meshccl's transports)

    @property
    def label(self) -> str:
        return self.launch.label

    def tail(self, lines: int = 6) -> str:
        try:
            text = [line.strip() for line in self.log.read_text(errors="replace").strip().splitlines()]
        except OSError:
            return ""
        unique = [line for i, line in enumerate(text) if line and (i == 0 or line != text[i - 1])]
        return " | ".join(unique[-lines:])

    def start(self, ctl: Control, timeout: float) -> None:
        """Starts every process and waits until each rank has said hello."""
        if self.launch.missing:
            raise JobError(self.launch.missing)
        with open(self.log, "wb") as out:
            for proc in self.launch.procs:
                try:
                    self.procs.append(
                        subprocess.Popen(
                            proc.argv,
                            env={**os.environ, **proc.env},
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                except OSError as e:
                    raise JobError(f"cannot start {proc.argv[0]}: {e}") from None
        deadline = time.monotonic() + timeout
        while len(self.conns) < self.launch.ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JobError(
                    f"{len(self.conns)}/{self.launch.ranks} ranks ready after {timeout:.0f} s: {self.tail()}"
                )
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise JobError(f"exited with status {dead[0].returncode} while starting: {self.tail()}")
            conn = ctl.accept(min(left, 0.2))
            if conn is None:
                continue
            conn.settimeout(10)
            f = conn.makefile("rw", encoding="utf-8")
            try:
                hello = json.loads(f.readline() or "{}")
            except (OSError, ValueError):
                hello = {}
            if hello.get("job") != self.id or hello.get("size") != self.launch.ranks:
                conn.close()  # a stray connection (an older job's rank): not ours
                continue
            self.conns[int(hello["rank"])] = (conn, f)
            if hello.get("rank") == 0 and hello.get("info"):
                self.info = str(hello["info"])

    def command(self, msg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Sends `msg` to every rank; every rank's reply, in rank order."""
        line = json.dumps(msg) + "\n"
        try:
            for conn, f in self.conns.values():
                conn.settimeout(timeout)
                f.write(line)
                f.flush()
            deadline = time.monotonic() + timeout
            replies = []
            for rank in sorted(self.conns):
                conn, f = self.conns[rank]
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                text = f.readline()
                if not text:
                    raise JobError(f"rank {rank} went away: {self.tail()}")
                replies.append(json.loads(text))
            return replies
        except TimeoutError:
            raise JobError(f"no answer within {timeout:.0f} s: {self.tail()}") from None
        except OSError as e:
            raise JobError(f"control connection failed ({e}): {self.tail()}") from None

    def stop(self, grace: float = 10) -> None:
        """Asks every rank to quit, then ends whatever is left of the processes we started."""
        for conn, f in self.conns.values():
            try:
                conn.settimeout(2)
                f.write(json.dumps({"cmd": "quit"}) + "\n")
                f.flush()
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                kill_group(p)
        for conn, f in self.conns.values():
            for closable in (f, conn):
                with contextlib.suppress(OSError):
                    closable.close()
        self.conns.clear()


def kill_group(p: subprocess.Popen[Any]) -> None:
    """Ends a process we started in its own session, with its children (its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue
