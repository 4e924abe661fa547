# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job's directory on a host: made safely, and every file of the job written through it.

``<state_dir>/jobs/<job id>``: mode 0700 and the login user's own, inside a parent every user may
write to (sticky, like /tmp); a parent or a directory another user could change is refused, and
everything there is made relative to the directory's open descriptor, never through a path that
could be redirected. The launch agent's ranks' logs and its agent.log (log_line()) live there.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import IO, Any


class JobDirError(Exception):
    """The job's directory cannot be made safely; says why and what to do."""


def user_label() -> str:
    """Who this process runs as, for messages: "name (uid N)"."""
    try:
        import pwd

        return f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def _unsafe_parent(st: os.stat_result) -> str | None:
    """Why a directory is no place to make a job's directory in (None: it is): another user could
    rename, remove or replace what is made there. Safe: owned by root or this user, and sticky (like
    /tmp: no one removes or renames another's entry) or writable by nobody else."""
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid}, neither root nor {user_label()}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return "every user may write to it and it is not sticky"
    if mode & stat.S_IWGRP and st.st_gid not in (0, os.getegid()):
        return f"group {st.st_gid} may write to it and it is not sticky"
    return None


def job_directory(path: str) -> int:
    """Make this job's directory and return an open descriptor of it: mode 0700, this user's own.
    Its parent, ``<state_dir>/jobs``, is shared by every user who launches (setup.yml makes it
    root's, sticky and world-writable, like /tmp); a parent another user could change under the
    job (not root's or this user's, or writable by others without the sticky bit) is refused. The
    directory is made exclusively and opened with O_NOFOLLOW relative to the parent's descriptor;
    one already there (the same job id again) is used only when it is a real directory of this
    user's that no one else can enter. Everything the agent writes there is made relative to the
    returned descriptor (dir_fd), so no later path lookup can be redirected."""
    path = path.rstrip("/") or "/"
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        try:
            os.makedirs(os.path.dirname(parent) or "/", exist_ok=True)
            os.mkdir(parent)
        except FileExistsError:
            pass
        except OSError as exc:
            raise JobDirError(
                f"cannot create {parent} as {user_label()}: {exc.strerror}; setup.yml creates it (mode 1777, like "
                f"/tmp); run setup.yml, or as root: install -d -m 1777 {parent}"
            ) from None
        else:
            if os.geteuid() == 0:
                # The layout setup.yml makes, whoever is first: every login user can launch.
                os.chmod(parent, 0o1777)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise JobDirError(f"cannot open {parent} as {user_label()}: {exc.strerror}; run setup.yml") from None
    try:
        st = os.fstat(parent_fd)
        why = _unsafe_parent(st)
        if why:
            raise JobDirError(
                f"{parent} is not a safe place for job directories: {why} (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace a job's directory; nothing was "
                f"started: run setup.yml, or as root: chown root {parent} && chmod 1777 {parent}"
            )
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass  # checked below, through the descriptor
        except PermissionError:
            raise JobDirError(
                f"cannot create {path}: {parent} is not writable by {user_label()}; setup.yml makes it sticky and "
                f"world-writable (mode 1777, like /tmp) so that every login user can launch: run setup.yml, or "
                f"as root: chmod 1777 {parent}"
            ) from None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError:
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except OSError as exc:
                raise JobDirError(f"cannot open {path} as {user_label()}: {exc.strerror}") from None
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise JobDirError(
                f"{path} exists and is not a private directory of {user_label()} ({kind}, owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o}); nothing was started: remove it, or launch with another job id"
            ) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise JobDirError(
                f"{path} exists and is not a private directory of {user_label()} (a directory, owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o}); nothing was started: remove it, or launch with another job id"
            )
        os.fchmod(fd, 0o700)
        return fd
    finally:
        os.close(parent_fd)


def _plain(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file of the job must have a plain name, not {name!r}")
    return name


def job_file(dir_fd: int, name: str, mode: str = "w") -> IO[Any]:
    """Open ``name`` in the job's directory for writing ("w", "wb": from empty; "a", "ab": appended),
    relative to its descriptor and never through a symbolic link."""
    _plain(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    return os.fdopen(fd, mode)


def write_job_file(dir_fd: int, name: str, text: str) -> None:
    """A file of the job, written whole under a temporary name and renamed into place (several
    agents may share a directory on one machine), all relative to the directory's descriptor."""
    tmp = f".{_plain(name)}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def log_line(fd: int | None, text: str) -> None:
    """A line in the job's agent.log, through its descriptor (opened once, O_APPEND)."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n".encode(errors="replace"))
