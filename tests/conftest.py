"""Make the collection importable as ansible_collections.meshkit.cluster from the checkout."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".collections"))
