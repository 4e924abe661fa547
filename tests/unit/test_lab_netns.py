"""The lab's names block in a hosts file and its path checks (meshkit/lab_netns.py)."""

from __future__ import annotations

import os

from meshkit.lab_netns import (
    _blocked_by,
    names_block,
    replace_block,
    update_hosts_block,
)

BASE = "127.0.0.1 localhost\n::1 localhost\n"
OTHER = names_block("other", ["198.19.9.2\tnode1.other.meshkit.test"])


def test_a_block_is_added_replaced_and_removed_leaving_other_lines_and_labs():
    lines = ["198.19.1.2\tnode1.lab1.meshkit.test", "198.19.1.3\tnode2.lab1.meshkit.test"]
    text = replace_block(BASE + OTHER, "lab1", lines)
    assert text == BASE + OTHER + "# BEGIN meshkit lab lab1\n" + "\n".join(lines) + "\n# END meshkit lab lab1\n"
    # Built again with other addresses: one block, the new one.
    again = replace_block(text, "lab1", ["198.19.2.2\tnode1.lab1.meshkit.test"])
    assert again.count("# BEGIN meshkit lab lab1") == 1
    assert "198.19.1.2" not in again and "198.19.2.2\tnode1.lab1.meshkit.test" in again
    assert replace_block(again, "lab1", None) == BASE + OTHER


def test_every_stale_copy_of_a_block_goes_and_a_lab_named_like_a_prefix_is_not_touched():
    stale = names_block("lab1", ["192.0.2.1\tx"]) + names_block("lab1", ["192.0.2.2\ty"])
    prefixed = names_block("lab10", ["198.19.3.2\tnode1.lab10.meshkit.test"])
    text = replace_block(BASE + stale + prefixed, "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"])
    assert "192.0.2" not in text
    assert prefixed in text
    assert text.count("# BEGIN meshkit lab lab1\n") == 1


def test_update_writes_in_place_and_reports_change(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(BASE)
    inode = os.stat(hosts).st_ino
    assert update_hosts_block(str(hosts), "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"]) is True
    assert update_hosts_block(str(hosts), "lab1", ["198.19.1.2\tnode1.lab1.meshkit.test"]) is False
    assert os.stat(hosts).st_ino == inode  # the same file (a bind mount stays valid), not a renamed copy
    assert update_hosts_block(str(hosts), "lab1", None) is True
    assert hosts.read_text() == BASE
    assert update_hosts_block(str(tmp_path / "missing"), "lab1", None) is False


def test_blocked_by_names_the_directory_others_cannot_enter(tmp_path):
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    target = closed / "inner"
    for parent in reversed(tmp_path.parents):
        if parent.stat().st_mode & 0o001 == 0:
            closed = parent  # pytest's own base directory is 0700 too: that one comes first
            break
    assert _blocked_by(str(target)).startswith(f" ({closed} is mode 0700: others cannot")
    assert _blocked_by("/usr/bin") == ""
