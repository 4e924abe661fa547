# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit watch's history: one JSON line per scheduled run in <artifacts>/watch/history.jsonl (its outcome and,
for a check, every cable's figures and flags); at HISTORY_KEEP lines the file becomes history.jsonl.1."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HISTORY_KEEP = 5000


def history_line(at: float, outcome: str, report: Mapping[str, Any] | None, reason: str = "") -> dict[str, Any]:
    """One run in history.jsonl: its outcome and, for a check, every cable's figures and flags."""
    line: dict[str, Any] = {"at": round(at, 3), "outcome": outcome}
    if reason:
        line["reason"] = reason
    if report is not None:
        line.update(quick=bool(report.get("quick")), ok=bool(report.get("ok")), flagged=report.get("flagged") or [])
        line["cables"] = {
            e["cable"]: {
                "alone": None if report.get("quick") else e.get("alone"),
                "load": None if report.get("quick") else e.get("load"),
                "expected_bps": e.get("reference_bps"),
                "rtt_us": e.get("rtt_us"),
                "loss": e.get("loss"),
                "flags": [f["flag"] for f in e.get("flags") or []],
            }
            for e in report.get("cables") or []
        }
        cluster = report.get("cluster") or {}
        if not report.get("quick") and cluster.get("busbw_bps") is not None:
            line["busbw_bps"] = cluster["busbw_bps"]
    return line


def append_history(path: Path, line: Mapping[str, Any]) -> None:
    """One line appended; at HISTORY_KEEP lines the file becomes history.jsonl.1 (the one before goes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        with path.open() as handle:
            count = sum(1 for _ in handle)
        if count >= HISTORY_KEEP:
            os.replace(path, path.with_name(path.name + ".1"))
    with path.open("a") as handle:
        handle.write(json.dumps(line, sort_keys=True) + "\n")


def read_history(path: Path) -> list[dict[str, Any]]:
    out = []
    for part in (path.with_name(path.name + ".1"), path):
        with contextlib.suppress(OSError):
            for text in part.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(text))
    return out
