# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Link rates as people write them, in bits per second.

``40gbit``, ``200mbit`` (tc's words: bit is bits), ``40Gb/s``, ``40 Gb/s`` (as macOS's
system_profiler shows a Thunderbolt link), ``5GB/s`` (bytes) and ``125mbps`` (tc: bps is BYTES per
second) are all understood. The controller's (the inventory check, ``meshkit check``); no host needs it.
"""

from __future__ import annotations

import re

_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(bit|bps|b/s|B/s|bit/s)\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: object) -> float:
    """Bits per second of a rate; ValueError (saying what is understood) for anything else."""
    match = _RATE.match(str(text)) if isinstance(text, (str, int, float)) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a link rate; write it as 40gbit, 200mbit or 40Gb/s")
    number, prefix, unit = float(match.group(1)), match.group(2).lower(), match.group(3)
    in_bytes = unit in ("bps", "B/s")
    return number * _SCALE[prefix] * (8 if in_bytes else 1)


def rate_in(text: str | None) -> float | None:
    """The first "N Gb/s" (or Mb/s) figure in a text such as system_profiler's "40 Gb/s" or
    Linux thunderbolt's "2 x 20 Gb/s"; None when there is none (an idle "Up to 40 Gb/s" port
    has no negotiated speed)."""
    if not text or str(text).strip().startswith("Up to"):
        return None
    lanes = re.search(r"([0-9]+)\s*x\s*([0-9.]+)\s*([GM])b/s", str(text))
    if lanes:
        return int(lanes.group(1)) * float(lanes.group(2)) * (1e9 if lanes.group(3) == "G" else 1e6)
    single = re.search(r"([0-9.]+)\s*([GM])b/s", str(text))
    if single:
        return float(single.group(1)) * (1e9 if single.group(2) == "G" else 1e6)
    return None


def format_rate(bits: float | None) -> str:
    """Gb/s with three significant digits (Mb/s below 1 Gb/s); "?" when unknown."""
    if bits is None:
        return "?"
    if bits >= 1e9:
        return f"{bits / 1e9:.3g} Gb/s"
    return f"{bits / 1e6:.3g} Mb/s"
