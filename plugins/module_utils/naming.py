# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Name ordering shared by the controller-side planner and host-side modules (no third-party
imports: module_utils that run on hosts may import it)."""

from __future__ import annotations

import re
from typing import Any


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort node2 before node10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
