"""The cabling picture: DOT text from a plan, and GraphViz accepting it."""

from __future__ import annotations

import shutil
import subprocess

from meshkit.picture import DEAD, MISSING, RING_COLOURS, dot

from .test_hostfiles import plan_of

MESH_BUT_1_3 = [(1, 2), (1, 4), (2, 3), (2, 4), (3, 4)]


def edges(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if " -- " in line]


def test_cables_carry_ports_and_addresses_and_ring_colour():
    plan = plan_of(MESH_BUT_1_3, 4)
    text = dot(plan, "lab-x", management={"node1": "198.18.0.2"})
    assert text.startswith("graph cabling {")
    assert '"node1" [label="node1\\n198.18.0.2"]' in text
    first = edges(text)[0]
    assert first.startswith('"node1" -- "node2" [taillabel="tb0\\n10.50.0.1", headlabel="tb0\\n10.50.0.2"')
    assert f'color="{RING_COLOURS[0]}"' in first
    assert "lab-x: 4 hosts, 5 cables\\nring node1 - node2 - node3 - node4\\nbackend: ring" in text


def test_missing_dead_and_removed_cables_are_drawn_as_such():
    plan = plan_of(MESH_BUT_1_3, 4)
    text = dot(plan, "x", dead=["node2:tb1"], removed=["node1:tb9 <-> node3:tb9"])
    lines = edges(text)
    dead = [e for e in lines if "DEAD (no ping reply)" in e]
    assert len(dead) == 1 and dead[0].startswith('"node2" -- "node3"') and f'color="{DEAD}"' in dead[0]
    gone = [e for e in lines if "gone since last plan" in e]
    assert len(gone) == 1 and gone[0].startswith('"node1" -- "node3"') and 'taillabel="tb9"' in gone[0]
    # The pair is drawn once, as the cable that was there, not again as "no cable".
    assert not [e for e in lines if "no cable" in e]
    text = dot(plan, "x")
    (missing,) = [e for e in edges(text) if "no cable" in e]
    assert missing.startswith('"node1" -- "node3" [style="dashed"') and f'color="{MISSING}"' in missing


def test_parallel_rings_get_their_own_colours_and_graphviz_renders_it(tmp_path):
    plan = plan_of([(1, 2), (1, 2), (2, 3), (2, 3), (3, 1), (3, 1)], 3)
    text = dot(plan, "x")
    assert "(2 parallel rings)" in text
    colours = {c for c in RING_COLOURS[:2] if f'color="{c}"' in text}
    assert colours == set(RING_COLOURS[:2])
    (tmp_path / "c.dot").write_text(text)
    dot_bin = shutil.which("dot")
    assert dot_bin, "GraphViz is a system dependency of make test (scripts/system-deps)"
    subprocess.run([dot_bin, "-Tsvg", "-o", str(tmp_path / "c.svg"), str(tmp_path / "c.dot")], check=True)
    assert "<svg" in (tmp_path / "c.svg").read_text()
