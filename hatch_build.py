"""Wheel build hook: a regular install of meshkit carries the meshkit.cluster collection in
site-packages/ansible_collections/meshkit/cluster, where Ansible finds collections on sys.path
(as the `ansible` package ships its collections). An editable install copies nothing: there the
checkout itself is the collection (.collections/ on sys.path)."""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# What of the checkout is the collection: the same parts ansible-galaxy's artifact keeps
# (galaxy.yml's build_ignore leaves out the rest), less what only develops it.
COLLECTION = [
    "galaxy.yml",
    "LICENSE",
    "README.md",
    "meta",
    "plugins",
    "roles",
    "playbooks",
    "docs",
    "collective/CMakeLists.txt",
    "collective/pyproject.toml",
    "collective/README.md",
    "collective/include",
    "collective/src",
    "collective/python",
    "collective/tests",
]
PREFIX = "ansible_collections/meshkit/cluster"


class CollectionHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return
        for part in COLLECTION:
            build_data["force_include"][part] = f"{PREFIX}/{part}"
