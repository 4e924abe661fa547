# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which jobs hold which hosts, as this controller knows: every job launch_service.run() starts
holds a lease on its hosts while it runs, and leaves a record when it ends or its preflight refuses it.

`meshkit watch` reads them: a scheduled check never starts while a job holds one of its hosts (it
would steal the job's bandwidth and measure the job, not the cables), the status page names the last
job, and the preflight's refusals become a counter Prometheus alerts on.

A host is known by how it is reached (its launch connection: the lab's network namespace, or
user@address:port), not by its inventory name alone, so two clusters whose hosts share names never
block each other. A lease whose process is gone (a controller that crashed or was killed) holds
nothing. Files live in the state directory ($MESHKIT_STATE_DIR, else $XDG_STATE_HOME/meshkit, else
~/.local/state/meshkit): jobs/running/<job id>.json, jobs/ended.jsonl, jobs/refused.jsonl (each
kept to its last LOG_KEEP lines).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

LOG_KEEP = 500


def state_dir() -> Path:
    given = os.environ.get("MESHKIT_STATE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshkit"


def host_key(connection: Mapping[str, Any]) -> str:
    """How a host is reached, as one string (see the module's text)."""
    kind = connection.get("kind")
    if kind == "nsenter":
        return f"netns:{connection.get('netns') or connection.get('pid')}"
    if kind == "ssh":
        user = f"{connection['user']}@" if connection.get("user") else ""
        return f"ssh:{user}{connection.get('host')}:{connection.get('port') or 22}"
    return f"local:{socket.gethostname()}"


def host_keys(connections: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Inventory host name -> its key."""
    return {host: host_key(conn) for host, conn in connections.items()}


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return started is None or _started_at(pid) in (None, started)


def _append(path: Path, record: Mapping[str, Any]) -> None:
    """One JSON line appended; the file cut to its last LOG_KEEP lines when it has twice as many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
    lines = path.read_text().splitlines()
    if len(lines) > 2 * LOG_KEEP:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines[-LOG_KEEP:]) + "\n")
        os.replace(tmp, path)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
    return out


@contextlib.contextmanager
def held(
    job: Mapping[str, Any], connections: Mapping[str, Mapping[str, Any]], purpose: str = "job"
) -> Iterator[dict[str, Any]]:
    """The job's lease on its hosts while the block runs; then its record in jobs/ended.jsonl. The
    block may set ``lease["outcome"]`` (ok, failed, ...) and ``lease["reason"]``. ``purpose``: "job",
    or "check" (meshkit check's own job: it holds the hosts too, but is not the last job a page names)."""
    base = state_dir() / "jobs"
    lease: dict[str, Any] = {
        "job_id": job["job_id"],
        "runtime": job.get("runtime"),
        "purpose": purpose,
        "pid": os.getpid(),
        "pid_started": _started_at(os.getpid()),
        "started": time.time(),
        "hosts": host_keys(connections),
    }
    path: Path | None = base / "running" / f"{job['job_id']}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(lease))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the job runs, unleased, and says so
        print(f"meshkit: cannot record job {job['job_id']} in {base} ({exc}); meshkit watch will not see it",
              file=sys.stderr)  # fmt: skip
        path = None
    try:
        yield lease
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()
        lease.setdefault("outcome", "ended")
        with contextlib.suppress(OSError):
            _append(base / "ended.jsonl", {**lease, "ended": time.time()})


def holding(keys: Iterator[str] | list[str] | set[str]) -> list[dict[str, Any]]:
    """The running jobs that hold any of these hosts (keys), oldest first; leases of dead processes
    are removed."""
    wanted = set(keys)
    out = []
    for path in sorted((state_dir() / "jobs" / "running").glob("*.json")):
        try:
            lease = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _alive(int(lease.get("pid") or 0), lease.get("pid_started")):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if wanted & set((lease.get("hosts") or {}).values()):
            out.append(lease)
    return sorted(out, key=lambda lease: lease.get("started") or 0)


def record_refusal(job: Mapping[str, Any], connections: Mapping[str, Mapping[str, Any]], problems: list[str]) -> None:
    """A job the preflight refused (nothing started): one line in jobs/refused.jsonl."""
    record = {"job_id": job["job_id"], "at": time.time(), "hosts": host_keys(connections), "problems": problems}
    with contextlib.suppress(OSError):
        _append(state_dir() / "jobs" / "refused.jsonl", record)


def _touches(record: Mapping[str, Any], keys: set[str]) -> bool:
    return bool(keys & set((record.get("hosts") or {}).values()))


def refusals(keys: set[str]) -> list[dict[str, Any]]:
    """Every recorded refusal of a job on any of these hosts, oldest first."""
    return [r for r in _read_lines(state_dir() / "jobs" / "refused.jsonl") if _touches(r, keys)]


def last_ended(keys: set[str], purpose: str = "job") -> dict[str, Any] | None:
    """The last job (of this purpose) that ended on any of these hosts."""
    lines = _read_lines(state_dir() / "jobs" / "ended.jsonl")
    ended = [r for r in lines if _touches(r, keys) and r.get("purpose", "job") == purpose]
    return max(ended, key=lambda r: r.get("ended") or 0) if ended else None
