# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""How the launch agent's parts reach a host that has no copy of the collection.

The controller (meshkit/launcher.py, agent_source()) sends one program down the host's connection:
this file's source, then a call of run() with the sources of AGENT_PARTS, read from the controller's
collection ({short name: source}). run() puts a SentSources finder first on sys.meta_path and
imports the agent from those sources: the agent and everything it imports from the collection are
the copies the controller sent, never one the host may have of another version. A check may carry
more module_utils' sources (the preflight's cable checks: macos, linux_net); module_util() adds them
to the same finder. Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.machinery  # imported before SentSources is in place: an import from it would come back to it
import sys
from typing import Any

MODULE_UTILS = "ansible_collections.meshkit.cluster.plugins.module_utils"
# What the agent imports from the collection, itself included (this file is the program: run()
# makes it known by its name). tests/unit/test_agent_sources.py checks that nothing is missing.
AGENT_PARTS = (
    "port_rules",
    "host_facts",
    "agent_jobdir",
    "agent_procs",
    "agent_watchdog",
    "agent_preflight",
    "launch_agent",
)


class SentSources:
    """An import finder for the collection's module_utils whose sources the controller sent ({short
    name: source}): the host has no copy of the collection. The packages on the way are empty, so
    nothing else of a collection the host may have is found through them."""

    def __init__(self, sources: dict) -> None:
        self.sources = dict(sources)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == MODULE_UTILS or MODULE_UTILS.startswith(name + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        short = name[len(MODULE_UTILS) + 1 :] if name.startswith(MODULE_UTILS + ".") else None
        if short in self.sources:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return None

    def exec_module(self, module: Any) -> None:
        name = module.__name__
        if name == MODULE_UTILS or MODULE_UTILS.startswith(name + "."):
            module.__path__ = []
            return
        short = name[len(MODULE_UTILS) + 1 :]
        exec(compile(self.sources[short], f"<meshkit {short}.py>", "exec"), module.__dict__)


def install(sources: dict) -> SentSources:
    """This process's SentSources finder, first on sys.meta_path, holding ``sources`` too."""
    for finder in sys.meta_path:
        if isinstance(finder, SentSources):
            finder.sources.update(sources)
            return finder
    finder = SentSources(sources)
    sys.meta_path.insert(0, finder)
    return finder


def module_util(name: str, sources: dict | None) -> Any:
    """The collection's module_utils ``name``: from the sources the controller sent (this host has
    no collection), else imported as usual (the agent imported as a module, in tests)."""
    if sources:
        install(sources)
    return importlib.import_module(f"{MODULE_UTILS}.{name}")


def run(sources: dict, main: str = "launch_agent") -> int:
    """The sent program's entry: ``sources`` (the agent's parts) importable, this program known as
    agent_sources, then ``main``'s main() (the launch agent's), from the sources."""
    sys.modules.setdefault(f"{MODULE_UTILS}.agent_sources", sys.modules[__name__])
    install(sources)
    return importlib.import_module(f"{MODULE_UTILS}.{main}").main()
