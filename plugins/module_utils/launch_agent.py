# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-host supervisor of a launch: starts this host's ranks and stops them all on command.

The controller (module_utils/launcher.py) runs it on every host over the host's connection
(ssh, or nsenter on the lab) and talks to it through the connection's stdin and stdout, one
JSON object per line. Standard library only: it runs under whatever Python the host has; the
controller sends its source over the connection, so hosts need no copy of meshkit.

Controller -> agent (stdin):
  0. or instead of a job, a check: {"check": {...}} (see check_host()); the agent answers
     {"t": "checked", "preflight": {...}, "facts": {...}} and exits, starting nothing.
  1. the job: {"job", "dir", "files": {name: text}, "grace", "stdin": bool,
     "ranks": [{"rank", "argv", "env", "cwd"}]}
  2. then any number of {"t": "stdin", "d": text}, {"t": "stdin_eof"}, {"t": "stop", "why": text}.
  End of input (the controller or its connection is gone) stops the job like "stop".

Agent -> controller (stdout):
  {"t": "started", "r", "pid"}; {"t": "out", "r", "d"}; {"t": "exit", "r", "code", "sig", "err",
  "stopped"}; {"t": "error", "msg"}; {"t": "bye", "left": [pids killed after the ranks ended]}.

Stopping is SIGTERM to each rank's process group, SIGKILL to what is left after ``grace``
seconds, then (Linux) SIGKILL to any other descendant: the agent is a child subreaper, so a
rank's daemonised children are re-parented to it and cannot escape. Ranks get
PR_SET_PDEATHSIG, so even a killed agent takes its ranks with it.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TAIL_POLL = 0.02


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_agent() -> None:
    # Runs in the child between fork and exec.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap() -> None:
    """Collect every exited child (ranks' orphans re-parented here die as zombies of the agent)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(name))
    return out


# --- checks before a launch (the launch_preflight module and `meshkit launch` share them) ------

PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
REQUIRED_HINTS = {
    "orted": "install Open MPI (the same version as the controller's mpirun; Debian: openmpi-bin)",
}


def resolve(name: str, path: str | None, cwd: str | None) -> str | None:
    """The real path a command name runs (through ``path``), or None."""
    if "/" in name:
        full = name if os.path.isabs(name) else os.path.join(cwd or os.getcwd(), name)
        return os.path.realpath(full) if os.path.isfile(full) and os.access(full, os.X_OK) else None
    found = shutil.which(name, path=path)
    return os.path.realpath(found) if found else None


def shebang(program: str) -> list[str] | None:
    try:
        with open(program, "rb") as handle:
            head = handle.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    return head[2:].split(b"\n", 1)[0].decode(errors="replace").split()


def port_holder(port: int) -> str:
    """Who listens on a TCP port, from ss (empty when ss cannot tell)."""
    try:
        out = subprocess.run(
            ["ss", "-H", "-ltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return f" by {found.group(1)} (pid {found.group(2)})" if found else ""


def check_port(address: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {address} is in use{port_holder(port)}"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"address {address} is not on this host (run setup.yml: the cabling or addresses changed)"
            return f"cannot listen on {address}:{port}: {exc.strerror}"
    return None


def preflight(
    argv: list[str],
    path: str | None = None,
    path_prepend: list[str] | None = None,
    cwd: str | None = None,
    require: list[str] | None = None,
    ports: list[list] | None = None,
) -> dict:
    """Can this host run its share of a job? The program (through the ranks' PATH) and its
    interpreter resolved to real paths, the script or module a Python runs, further commands,
    the working directory, and every planned listening address and port. Changes nothing."""
    path = os.pathsep.join([*(path_prepend or []), path or os.environ.get("PATH", os.defpath)])
    problems: list[str] = []
    if cwd and not os.path.isdir(cwd):
        problems.append(f"working directory {cwd} does not exist")
        cwd = None
    program = resolve(argv[0], path, cwd)
    interpreter = script = None
    if program is None:
        where = "" if "/" in argv[0] else f" on PATH ({path})"
        problems.append(f"program {argv[0]} not found{where}, or not executable")
    else:
        line = shebang(program)
        if line:
            name = line[1] if os.path.basename(line[0]) == "env" and len(line) > 1 else line[0]
            interpreter = resolve(name, path, cwd)
            if interpreter is None:
                problems.append(f"{program}: its interpreter {name} (#! line) is missing")
        elif PYTHON.match(os.path.basename(argv[0])):
            interpreter = program
            rest = argv[1:]
            if rest and rest[0] == "-m" and len(rest) > 1:
                probe = subprocess.run(
                    [program, "-c", "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
                     "print(s.origin if s else '')", rest[1]],
                    capture_output=True, text=True, cwd=cwd, timeout=60, check=False,
                )  # fmt: skip
                origin = probe.stdout.strip()
                if probe.returncode != 0 or not origin:
                    problems.append(f"{program} cannot import module {rest[1]} (python -m)")
                else:
                    script = os.path.realpath(origin)
            elif rest and not rest[0].startswith("-"):
                full = rest[0] if os.path.isabs(rest[0]) else os.path.join(cwd or os.getcwd(), rest[0])
                if os.path.isfile(full):
                    script = os.path.realpath(full)
                else:
                    problems.append(f"script {rest[0]} not found (run by {program})")
    for name in require or []:
        if resolve(name, path, cwd) is None:
            hint = REQUIRED_HINTS.get(name, "install it on every host")
            problems.append(f"{name} not found on PATH ({path}); {hint}")
    for entry in ports or []:
        address, port = str(entry[0]), int(entry[1])
        what = entry[2] if len(entry) > 2 else ""
        problem = check_port(address, port)
        if problem:
            problems.append(f"{problem}{f' (planned for {what})' if what else ''}")
    return {"program": program, "interpreter": interpreter, "script": script, "problems": problems}


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def _ip(commands: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """One ``ip -json -batch`` run: the interfaces ("address show") by name, and for each
    "route get ADDRESS" the device the route leaves through."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-force", "-batch", "-"],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}, {}
    interfaces: dict[str, dict] = {}
    routes: dict[str, str] = {}
    for line in out.splitlines():
        try:
            entries = json.loads(line)
        except ValueError:
            continue
        for entry in entries if isinstance(entries, list) else []:
            if "ifname" in entry:
                interfaces[entry["ifname"]] = entry
            elif "dst" in entry and "dev" in entry:
                routes[entry["dst"]] = entry["dev"]
    return interfaces, routes


def _arp() -> dict[tuple[str, str], str]:
    """(device, address) -> MAC of every complete IPv4 neighbour entry."""
    out = {}
    for line in (_read("/proc/net/arp") or b"").decode().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 6 and int(fields[2], 16) & 0x2 and fields[3] != "00:00:00:00:00:00":
            out[(fields[5], fields[0])] = fields[3].lower()
    return out


def host_facts(spec: dict) -> dict:
    """What `meshkit launch` compares with what setup.yml left, instead of discovering again
    (Linux): the hostfiles' fingerprint, torch.env, the meshccl build, and per planned cable
    the port's state, MAC and addresses, the route to the peer's address, and the MAC that
    answers for that address on that port; plus candidate ports that are up but not planned."""
    state_dir = spec.get("state_dir") or "/var/lib/meshkit"
    facts: dict = {"platform": sys.platform}
    manifest = _read(os.path.join(state_dir, "hostfiles", "manifest.json"))
    try:
        facts["fingerprint"] = json.loads(manifest).get("fingerprint") if manifest else None
    except (ValueError, AttributeError):
        facts["fingerprint"] = None
    torch_env = _read(os.path.join(state_dir, "hostfiles", "torch.env"))
    facts["torch_env"] = hashlib.sha256(torch_env).hexdigest() if torch_env is not None else None
    if spec.get("meshccl_venv"):
        venv = spec["meshccl_venv"]
        record = _read(os.path.join(venv, "meshkit-meshccl.json"))
        try:
            build = json.loads(record).get("build") if record else None
        except (ValueError, AttributeError):
            build = None
        # The record, the venv's python and meshccl's package (its native module) all there; the
        # import itself is launch.yml's to try (about 0.2 s a host).
        native = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "meshccl", "_meshccl*"))
        present = os.path.exists(os.path.join(venv, "bin", "python")) and bool(native)
        facts["meshccl_build"] = build if present else None
    if not sys.platform.startswith("linux"):
        return facts
    links = spec.get("links") or []
    interfaces, routes = _ip(["address show", *(f"route get {link['peer_address']}" for link in links)])
    neighbours = _arp()
    wanted = [(link["port"], link["peer_address"]) for link in links]
    missing = [w for w in wanted if w not in neighbours and w[0] in interfaces]
    if missing:
        # Ask: a datagram to the discard port makes the kernel resolve the peer's address on
        # the port its route uses. Entries of a port are flushed when its carrier goes, so an
        # entry that is there is the cable's current peer.
        for _port, address in missing:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
                sock.sendto(b"meshkit", (address, 9))
        deadline = time.monotonic() + float(spec.get("arp_wait", 1.0))
        while time.monotonic() < deadline:
            time.sleep(0.005)
            neighbours = _arp()
            if all(w in neighbours for w in missing):
                break
    ports = {}
    for link in links:
        port = link["port"]
        info = interfaces.get(port)
        if info is None:
            ports[port] = {"exists": False}
            continue
        ports[port] = {
            "exists": True,
            "up": "LOWER_UP" in (info.get("flags") or []) and "UP" in (info.get("flags") or []),
            "mac": (info.get("address") or "").lower(),
            "addresses": [
                f"{a.get('local')}/{a.get('prefixlen')}"
                for a in info.get("addr_info") or []
                if a.get("family") == "inet"
            ],
            "route": routes.get(link["peer_address"]),
            "neighbour": neighbours.get((port, link["peer_address"])),
        }
    facts["ports"] = ports
    planned = {link["port"] for link in links}
    management = spec.get("management_interface") or ""
    if management:
        info = interfaces.get(management)
        facts["management_up"] = bool(info) and "UP" in (info.get("flags") or [])
    unplanned = []
    for name, info in interfaces.items():
        if not name or name in planned or name in (management, "lo"):
            continue
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.get("peer_ports") or []):
            continue
        if os.path.exists(f"/sys/class/net/{name}/bridge") or info.get("master"):
            continue  # a bridge, or a port in one: discovery does not count these as cables
        if "LOWER_UP" in (info.get("flags") or []):
            unplanned.append(name)
    facts["unplanned"] = sorted(unplanned)
    return facts


def check_host(spec: dict) -> dict:
    """The whole check of one host: {"preflight": ..., "facts": ...}."""
    job = spec.get("preflight") or {}
    result: dict = {"t": "checked"}
    result["preflight"] = preflight(
        job.get("argv") or ["true"],
        path=job.get("path"),
        path_prepend=job.get("path_prepend"),
        cwd=job.get("cwd"),
        require=job.get("require"),
        ports=job.get("ports"),
    )
    result["facts"] = host_facts(spec)
    return result


class Rank:
    def __init__(self, spec: dict, log_dir: str) -> None:
        self.rank: int = spec["rank"]
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(log_dir, f"rank-{self.rank}.log"), "ab")  # noqa: SIM115
        self.eof = False
        self.reported = False
        self.stopped = False
        self.exited_at: float | None = None
        self.stdin_pending = b""  # broadcast input this rank has not read yet
        self.stdin_eof = False  # close its stdin once the pending input is written


class Agent:
    def __init__(self, out_fd: int = 1, in_fd: int = 0) -> None:
        self.out_fd = out_fd
        self.in_fd = in_fd
        self.inbuf = b""
        self.ranks: list[Rank] = []
        self.sel = selectors.DefaultSelector()
        self.stopping_since: float | None = None
        self.killed = False

    # --- talking to the controller ------------------------------------------------------------

    def send(self, **msg: object) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            try:
                n = os.write(self.out_fd, data)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:
                # The controller is gone: nobody to tell; stopping follows from the closed stdin.
                return
            data = data[n:]

    def read_line(self) -> dict | None:
        """One whole line of input, blocking (used before the job starts)."""
        while b"\n" not in self.inbuf:
            chunk = os.read(self.in_fd, 65536)
            if not chunk:
                return None
            self.inbuf += chunk
        line, self.inbuf = self.inbuf.split(b"\n", 1)
        return json.loads(line)

    # --- the job --------------------------------------------------------------------------------

    def start(self, job: dict) -> None:
        os.makedirs(job["dir"], mode=0o700, exist_ok=True)
        for name, text in job.get("files", {}).items():
            path = os.path.join(job["dir"], name)
            with open(path + ".tmp", "w") as handle:
                handle.write(text)
            os.replace(path + ".tmp", path)
        self.grace = float(job.get("grace", 3.0))
        interactive = bool(job.get("stdin"))
        for spec in job["ranks"]:
            rank = Rank(spec, job["dir"])
            self.ranks.append(rank)
            env = dict(os.environ)
            env.update(spec.get("env", {}))
            if spec.get("path_prepend"):
                env["PATH"] = os.pathsep.join([*spec["path_prepend"], env.get("PATH", os.defpath)])
            try:
                rank.proc = subprocess.Popen(
                    spec["argv"],
                    env=env,
                    cwd=spec.get("cwd") or None,
                    stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_agent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
                )
            except (OSError, ValueError, TypeError) as exc:
                # OSError: no such program or working directory (filename says which); ValueError /
                # TypeError: an argument or variable Popen refuses (a NUL byte, not a string).
                rank.proc = None
                rank.eof = True
                rank.reported = True
                if isinstance(exc, OSError):
                    why = f"{exc.filename or spec['argv'][0]}: {exc.strerror}"
                else:
                    why = f"cannot start {spec['argv'][0]}: {exc}"
                self.send(t="exit", r=rank.rank, code=127, sig=None, err=why)
                continue
            if rank.proc.stdin:
                os.set_blocking(rank.proc.stdin.fileno(), False)
            os.set_blocking(rank.proc.stdout.fileno(), False)
            self.sel.register(rank.proc.stdout, selectors.EVENT_READ, rank)
            self.send(t="started", r=rank.rank, pid=rank.proc.pid)

    def on_input(self) -> None:
        try:
            chunk = os.read(self.in_fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(self.in_fd)
            self.stop()
            return
        self.inbuf += chunk
        self.handle_lines()

    def handle_lines(self) -> None:
        while b"\n" in self.inbuf:
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            msg = json.loads(line)
            kind = msg.get("t")
            if kind == "stop":
                self.stop()
            elif kind == "stdin":
                self.to_ranks(msg["d"].encode("utf-8", "surrogateescape"))
            elif kind == "stdin_eof":
                for rank in self.ranks:
                    rank.stdin_eof = True
                    self.feed(rank)

    def to_ranks(self, data: bytes) -> None:
        for rank in self.ranks:
            if rank.proc and rank.proc.stdin and not rank.proc.stdin.closed:
                rank.stdin_pending += data
                self.feed(rank)

    def feed(self, rank: Rank) -> None:
        """Write what a rank's stdin can take now, never blocking: a rank that does not read
        its input must not stop the agent from forwarding output or stopping the job."""
        stdin = rank.proc.stdin if rank.proc else None
        if stdin is None or stdin.closed:
            rank.stdin_pending = b""
            return
        while rank.stdin_pending:
            try:
                n = os.write(stdin.fileno(), rank.stdin_pending)
            except BlockingIOError:
                return
            except OSError:
                rank.stdin_pending = b""  # it closed its stdin or is gone; its exit is reported as usual
                break
            rank.stdin_pending = rank.stdin_pending[n:]
        if rank.stdin_eof:
            with contextlib.suppress(OSError):
                stdin.close()

    def on_output(self, rank: Rank) -> None:
        try:
            chunk = os.read(rank.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            rank.eof = True
            self.sel.unregister(rank.proc.stdout)
            rank.proc.stdout.close()
            return
        rank.log.write(chunk)
        rank.log.flush()
        self.send(t="out", r=rank.rank, d=chunk.decode("utf-8", "surrogateescape"))

    def stop(self) -> None:
        if self.stopping_since is not None:
            return
        self.stopping_since = time.monotonic()
        for rank in self.ranks:
            if rank.proc and rank.proc.returncode is None and rank.proc.poll() is None:
                rank.stopped = True
                self._signal_group(rank, signal.SIGTERM)

    def _signal_group(self, rank: Rank, sig: int) -> None:
        try:
            os.killpg(rank.proc.pid, sig)
        except OSError:
            with contextlib.suppress(OSError):
                rank.proc.send_signal(sig)

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.reported or rank.proc is None:
                continue
            code = rank.proc.poll()
            if code is None:
                continue
            # A rank that exited may leave output in its pipe (or a child holding it open):
            # report the exit once the pipe is drained, or after a short wait.
            if rank.exited_at is None:
                rank.exited_at = time.monotonic()
            if not rank.eof and time.monotonic() - rank.exited_at < 0.5:
                continue
            if not rank.eof:
                self.sel.unregister(rank.proc.stdout)
                rank.proc.stdout.close()
                rank.eof = True
            rank.reported = True
            rank.log.close()
            self.send(
                t="exit",
                r=rank.rank,
                code=code if code >= 0 else None,
                sig=-code if code < 0 else None,
                err=None,
                stopped=rank.stopped,
            )

    def escalate(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since >= self.grace:
            self.killed = True
            for rank in self.ranks:
                if rank.proc and rank.proc.poll() is None:
                    self._signal_group(rank, signal.SIGKILL)

    def sweep(self) -> list[int]:
        """Kill whatever the ranks left running (re-parented to this subreaper); their pids."""
        left: set[int] = set()
        for _ in range(50):
            _reap()
            pids = _children(os.getpid())
            if not pids:
                break
            left.update(pids)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return sorted(left)

    def run(self) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        job = self.read_line()
        if job is None:
            return 1
        if "check" in job:
            try:
                self.send(**check_host(job["check"]))
            except Exception as exc:
                self.send(t="error", msg=f"cannot check the host: {exc!r}")
            return 0
        try:
            self.start(job)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.send(t="error", msg=f"cannot start the job: {exc}")
            self.stop()
        os.set_blocking(self.in_fd, False)
        self.sel.register(self.in_fd, selectors.EVENT_READ, None)
        self.handle_lines()  # lines that came in with the job line
        while not all(r.reported for r in self.ranks):
            for key, _ in self.sel.select(TAIL_POLL):
                if key.data is None:
                    self.on_input()
                else:
                    self.on_output(key.data)
            for rank in self.ranks:
                if rank.stdin_pending:
                    self.feed(rank)
            self.reap()
            self.escalate()
        self.send(t="bye", left=self.sweep())
        return 0


def main() -> int:
    # A rank that closed its stdin must not kill the agent when input is broadcast (EPIPE is
    # handled where it happens); the ranks themselves get the default back from Popen.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # SIGTERM/SIGHUP to the agent (sshd closing the session) stop the job like end of input.
    agent = Agent()

    def _stop(_sig: int, _frame: object) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
