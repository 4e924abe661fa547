# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The cabling picture: GraphViz DOT of hosts and cables, from the one plan.

Cables carry their port and address at each end; cables of parallel ring k share a colour;
host pairs without a cable (for a full mesh) are dashed grey; cables that stopped answering
(dead) and cables gone since the last plan are red. ``meshkit check``'s picture
(check_report.dot) has the same look: it draws with ``header``, ``quote`` and ``attr_list``.
"""

from __future__ import annotations

from typing import Any

RING_COLOURS = ["#1f6fb4", "#2a9d3a", "#8e44ad", "#d35400", "#16a085", "#7f8c8d"]
DEAD = "#d62728"
MISSING = "#9a9a9a"
PLAIN = "#333333"


def quote(text: str) -> str:
    """A DOT string: double-quoted, backslashes, quotes and newlines escaped."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def attr_list(**attrs: Any) -> str:
    """A DOT attribute list, ``[k="v", n=1]``: strings quoted, numbers as they are."""
    return "[" + ", ".join(f"{k}={quote(v) if isinstance(v, str) else v}" for k, v in attrs.items()) + "]"


def header(graph: str, hosts: list[str], label: str, mindist: float = 1.6) -> list[str]:
    """The first lines of a picture: ``graph <graph> {``, the graph's look and ``label`` (the
    summary lines and the legend) on top, then the look of every host box and every cable."""
    return [
        f"graph {graph} {{",
        "  "
        + attr_list(
            layout="circo" if len(hosts) > 2 else "dot",
            rankdir="LR",
            label=label,
            labelloc="t",
            fontname="Helvetica",
            fontsize=12,
            mindist=mindist,
            pad=0.4,
        ).replace("[", "graph [", 1),
        "  node " + attr_list(shape="box", style="rounded,filled", fillcolor="#f2f4f7", fontname="Helvetica"),
        "  edge " + attr_list(fontname="Helvetica", fontsize=9, labelfontsize=9, labeldistance=2.2),
    ]


def dot(
    plan: dict[str, Any],
    title: str,
    dead: list[str] | None = None,
    removed: list[str] | None = None,
    management: dict[str, str] | None = None,
) -> str:
    """DOT text. ``dead``: cable ends ("host:port") whose ping got no reply; ``removed``: cables
    ("a:p <-> b:q") of the last plan that discovery no longer finds."""
    dead_ends = set(dead or [])
    management = management or {}
    ring_of: dict[str, int] = {}
    for k, ring in enumerate(plan.get("rings") or []):
        for cable in ring:
            ring_of[cable] = k
    ring = plan.get("ring") or []
    n_rings = len(plan.get("rings") or [])
    summary = [
        f"{title}: {len(plan['hosts'])} hosts, {len(plan.get('cables', []))} cables"
        + (", full mesh" if plan.get("mesh") else ""),
        ("ring " + " - ".join(ring) + (f" ({n_rings} parallel rings)" if n_rings > 1 else ""))
        if len(ring) == len(plan["hosts"]) and ring
        else "no ring through every host",
        f"backend: {plan.get('backend') or 'none'}",
    ]
    legend = "colour = ring k   grey dashed = no cable (mesh incomplete)   red = dead / gone since last plan"
    lines = header("cabling", plan["hosts"], "\n".join([*summary, legend]))
    for host in plan["hosts"]:
        label = host + (f"\n{management[host]}" if management.get(host) else "")
        lines.append(f"  {quote(host)} {attr_list(label=label)}")
    for c in plan.get("cables", []):
        a, b = c["ends"]
        name = f"{a['host']}:{a['port']} <-> {b['host']}:{b['port']}"
        is_dead = f"{a['host']}:{a['port']}" in dead_ends or f"{b['host']}:{b['port']}" in dead_ends
        k = ring_of.get(name)
        attrs: dict[str, Any] = {
            "taillabel": f"{a['port']}\n{a['address']}",
            "headlabel": f"{b['port']}\n{b['address']}",
            "label": c["network"],
            "color": RING_COLOURS[k % len(RING_COLOURS)] if k is not None else PLAIN,
            "penwidth": 2.5 if k is not None else 1.5,
            "tooltip": name,
        }
        if is_dead:
            attrs.update(color=DEAD, fontcolor=DEAD, style="bold", label=f"DEAD (no ping reply)\n{c['network']}")
        lines.append(f"  {quote(a['host'])} -- {quote(b['host'])} {attr_list(**attrs)}")
    gone_pairs = set()
    for cable in removed or []:
        left, _sep, right = cable.partition(" <-> ")
        gone_pairs.add(frozenset((left.rsplit(":", 1)[0], right.rsplit(":", 1)[0])))
    for pair in plan.get("missing_mesh") or []:
        if frozenset(pair) in gone_pairs:
            continue  # drawn below as the cable that was there
        lines.append(
            f"  {quote(pair[0])} -- {quote(pair[1])} "
            + attr_list(style="dashed", color=MISSING, fontcolor=MISSING, label="no cable", constraint="false")
        )
    for cable in removed or []:
        left, _sep, right = cable.partition(" <-> ")
        ha, pa = left.rsplit(":", 1)
        hb, pb = right.rsplit(":", 1)
        if ha in plan["hosts"] and hb in plan["hosts"]:
            lines.append(
                f"  {quote(ha)} -- {quote(hb)} "
                + attr_list(
                    style="dashed",
                    color=DEAD,
                    fontcolor=DEAD,
                    taillabel=pa,
                    headlabel=pb,
                    label="gone since last plan",
                    constraint="false",
                )
            )
    for link in plan.get("asymmetric") or []:
        ha = link["seen_by"].rsplit(":", 1)[0]
        hb = link["peer"].rsplit(":", 1)[0]
        lines.append(
            f"  {quote(ha)} -- {quote(hb)} "
            + attr_list(style="dotted", color="#e67e22", label="one-way: " + link["reason"], constraint="false")
        )
    lines.append("}")
    return "\n".join(lines) + "\n"
