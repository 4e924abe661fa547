"""The job's processes (module_utils/agent_procs.py) on recorded or written ps output. (With real
processes: the portable mode in test_launch_agent_portable.py, the Linux mode in test_launcher.py.)"""

from __future__ import annotations

from ansible_collections.meshkit.cluster.plugins.module_utils import agent_procs


def test_marked_groups_from_ps_keep_only_groups_holding_the_job() -> None:
    # `ps -E -ww -A -o pgid=,command=` on macOS: the environment follows the command.
    ps = (
        "  401 /usr/bin/python3 train.py TERM=xterm MESHKIT_JOB_MARK=77-abc HOME=/Users/a\n"
        "  402 /bin/sleep 600 HOME=/Users/b\n"
        "  403 /bin/sleep 600 MESHKIT_JOB_MARK=77-abcd\n"
        "  404 -zsh\n"
    )
    assert agent_procs.marked_groups({401, 402, 403, 405}, "77-abc", ps) == {401}
