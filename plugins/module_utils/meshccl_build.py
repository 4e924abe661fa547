# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshccl's build id: what the controller's wheelhouse is made from (the sources, this Python,
the pinned extra requirements). The meshccl_wheel module names wheelhouses by it; `meshkit
launch` recomputes it to tell whether the hosts' installs are still the current build."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import re
import sys

SKIP_DIRS = {"build", "__pycache__", ".pytest_cache", "dist"}
BARE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def source_files(source: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out.extend(os.path.join(root, f) for f in sorted(files) if not f.endswith((".pyc", ".so")))
    return out


def pinned(requirements: list[str]) -> list[str]:
    out = []
    for req in requirements:
        version = None
        if BARE.match(req):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(req)
        out.append(f"{req}=={version}" if version else req)
    return out


def build_id(source: str, requirements: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"{sys.version_info[:2]} {sys.platform} {os.uname().machine}\n".encode())
    h.update(("\n".join(requirements) + "\n").encode())
    for path in source_files(source):
        h.update(os.path.relpath(path, source).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]
