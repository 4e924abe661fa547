# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshccl's install moved as one archive per host: packed on the controller, unpacked on the host.

Two kinds of archive, each with a manifest (``meshkit-archive.json``) as its first member:

- ``environment``: a ready virtual environment (made on the controller with the hosts' own
  interpreter path, from the group's wheelhouse), for one environment path. A virtual environment
  is not relocatable: it was made in a staging directory, and the only files that name that
  directory - the console scripts' shebangs and the activate scripts in ``bin/``, and
  ``pyvenv.cfg`` - are rewritten to the hosts' path as they are packed (as venv-pack does). The
  ``.pyc`` files keep the staging path in their ``co_filename``: Python replaces it with the
  file's real path when it loads them. ``bin/python`` is a symlink to the interpreter, so the
  host must have that interpreter at that path, with the same Python X.Y: the controller only
  packs one where the hosts' record says so.
- ``wheels``: the group's wheelhouse, uncompressed (wheels are compressed already), for hosts
  where an environment cannot be shipped: the host makes the environment and installs the wheels.

On the host an environment is always made beside the old one (a hidden sibling directory),
checked (``import meshccl``, the recorded build), and only then renamed into place; the old one is
removed last. A failure at any step leaves the old environment as it was.

Standard library only, and Python 3.9 compatible: the host side runs this on every host."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile

MANIFEST = "meshkit-archive.json"
ENVIRONMENT = "environment"
WHEELS = "wheels"
WHEELS_ARCHIVE = "wheelhouse.tar"
# Files of a virtual environment that name its own directory (text; rewritten when it moves).
RELOCATED_DIRS = ("bin",)
RELOCATED_FILES = ("pyvenv.cfg",)


def relocated(data: bytes, old: str, new: str) -> bytes | None:
    """``data`` with every ``old`` path replaced by ``new``; None when it names no ``old`` path or is
    not text (a binary is never edited: a different length would break it)."""
    needle = old.rstrip("/").encode()
    if needle not in data or b"\0" in data:
        return None
    return data.replace(needle, new.rstrip("/").encode())


def relocatable_files(venv: str) -> list[str]:
    """The paths (relative to ``venv``) that may name the environment's own directory."""
    out = [f for f in RELOCATED_FILES if os.path.isfile(os.path.join(venv, f))]
    for d in RELOCATED_DIRS:
        full = os.path.join(venv, d)
        if os.path.isdir(full):
            out.extend(
                os.path.join(d, f)
                for f in sorted(os.listdir(full))
                if os.path.isfile(os.path.join(full, f)) and not os.path.islink(os.path.join(full, f))
            )
    return out


def relocate_tree(venv: str, old: str, new: str) -> list[str]:
    """Rewrite, in place, the files of ``venv`` (made at ``old``) that name ``old`` to name ``new``."""
    changed = []
    for rel in relocatable_files(venv):
        path = os.path.join(venv, rel)
        with open(path, "rb") as f:
            data = relocated(f.read(), old, new)
        if data is not None:
            mode = os.stat(path).st_mode
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, mode)
            changed.append(rel)
    return changed


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _manifest_member(manifest: dict) -> tuple[tarfile.TarInfo, io.BytesIO]:
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    info = _root_owned(tarfile.TarInfo(MANIFEST))
    info.size, info.mode = len(data), 0o644
    return info, io.BytesIO(data)


def pack_environment(venv: str, archive: str, old: str, new: str, manifest: dict, level: int = 6) -> int:
    """Pack the environment ``venv`` (made at ``old``) as one at ``new``: a .tar.gz written beside
    ``archive`` and renamed to it. Returns the number of files rewritten for ``new``."""
    rewrite = set(relocatable_files(venv))
    count = 0
    fd, work = tempfile.mkstemp(prefix=".pack-", suffix=".tar.gz", dir=os.path.dirname(archive))
    os.close(fd)
    try:
        with tarfile.open(work, "w:gz", compresslevel=level, format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(*_manifest_member({**manifest, "kind": ENVIRONMENT, "venv": new}))
            for root, dirs, files in os.walk(venv):
                dirs.sort()
                for name in sorted(dirs) + sorted(files):
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, venv)
                    info = _root_owned(tar.gettarinfo(full, arcname=rel))
                    if info.islnk():  # a second name of a file already packed: packed as a file again
                        info.type, info.linkname, info.size = tarfile.REGTYPE, "", os.path.getsize(full)
                    if rel in rewrite and info.isreg():
                        with open(full, "rb") as f:
                            data = f.read()
                        moved = relocated(data, old, new)
                        if moved is not None:
                            count += 1
                            data = moved
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                    elif info.isreg():
                        with open(full, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
        os.chmod(work, 0o644)
        os.replace(work, archive)
    finally:
        if os.path.exists(work):
            os.remove(work)
    return count


def pack_wheels(wheelhouse: str, wheels: list[str], archive: str, manifest: dict) -> None:
    """The wheels of ``wheelhouse`` as one uncompressed tar (written beside ``archive``, renamed to it)."""
    fd, work = tempfile.mkstemp(prefix=".pack-", suffix=".tar", dir=os.path.dirname(archive))
    os.close(fd)
    try:
        with tarfile.open(work, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(*_manifest_member({**manifest, "kind": WHEELS, "wheels": sorted(wheels)}))
            for wheel in sorted(wheels):
                tar.add(os.path.join(wheelhouse, wheel), arcname=wheel, filter=_root_owned)
        os.chmod(work, 0o644)
        os.replace(work, archive)
    finally:
        if os.path.exists(work):
            os.remove(work)


def read_manifest(archive: str) -> dict:
    """The archive's manifest (its first member); ValueError when it has none."""
    with tarfile.open(archive) as tar:
        member = tar.next()
        if member is None or member.name != MANIFEST or not member.isreg():
            raise ValueError(f"{archive} is not a meshkit archive (no {MANIFEST} first)")
        f = tar.extractfile(member)
        return json.loads(f.read().decode()) if f else {}


def _safe(member: tarfile.TarInfo) -> bool:
    name = member.name
    if name.startswith("/") or ".." in name.split("/"):
        return False
    if member.islnk():
        return False
    return member.isreg() or member.isdir() or member.issym()


def extract(archive: str, dest: str) -> dict:
    """Unpack ``archive`` into the empty directory ``dest`` (no member outside it, no hard link or
    device; owners as the archive says only when running as root); returns the manifest."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        if not members or members[0].name != MANIFEST:
            raise ValueError(f"{archive} is not a meshkit archive (no {MANIFEST} first)")
        bad = [m.name for m in members if not _safe(m)]
        if bad:
            raise ValueError(f"{archive}: refusing members outside the directory or of odd kinds: {', '.join(bad[:5])}")
        f = tar.extractfile(members[0])
        manifest = json.loads(f.read().decode()) if f else {}
        body = members[1:]
        if hasattr(tarfile, "tar_filter"):
            # 'tar', not 'data': bin/python is a symlink to the interpreter's absolute path.
            tar.extractall(dest, members=body, filter="tar")
        else:  # Python without extraction filters (before 3.9.17 / 3.10.12 / 3.11.4): checked above
            tar.extractall(dest, members=body)
    return manifest


def sibling(path: str, what: str) -> str:
    """A new hidden directory beside ``path`` (same filesystem: it can be renamed into place), with the
    mode a directory made here gets (mkdtemp's own 0700 would keep every other user out once in place)."""
    parent = os.path.dirname(path.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    made = tempfile.mkdtemp(prefix=f".{os.path.basename(path.rstrip('/'))}.{what}-", dir=parent)
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(made, 0o777 & ~umask)
    return made


def swap_in(new: str, path: str) -> str | None:
    """Rename ``new`` to ``path``; the old ``path`` (if any) is moved aside first and returned, for
    ``restore`` or removal."""
    old = None
    if os.path.lexists(path):
        old = sibling(path, "old")
        os.rmdir(old)
        os.rename(path, old)
    try:
        os.rename(new, path)
    except OSError:
        if old:
            os.rename(old, path)
        raise
    return old


def restore(path: str, old: str | None) -> None:
    """Undo ``swap_in``: the new ``path`` removed, the old one back in place."""
    shutil.rmtree(path, ignore_errors=True)
    if old:
        os.rename(old, path)
