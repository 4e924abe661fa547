"""The collection's roles in a user's own playbook (not setup.yml): they converge a fresh lab, a second run
changes nothing, and setup.yml on the same lab then finds nothing to change on any host and writes the same
plan.json (same fingerprint) and the same hostfiles - setup.yml is those roles."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import run_playbook
from .test_setup import check_converged

# What a user writes: the roles, in the order of the design's flow, then the picture.
OWN_PLAYBOOK = """\
- name: My cluster's network, from meshkit's roles
  hosts: cluster
  gather_facts: false
  become: true
  roles:
    - meshkit.cluster.discovery
    - meshkit.cluster.plan
    - meshkit.cluster.peer_network
    - meshkit.cluster.hostfiles
  tasks:
    - name: Draw the cabling
      ansible.builtin.import_role:
        name: meshkit.cluster.plan
        tasks_from: picture
"""


def files_under(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def host_hostfiles(lab) -> dict[str, dict[str, str]]:
    return {host: files_under(lab.dir / "hosts" / host / "state" / "hostfiles") for host in lab.hosts()}


def test_a_users_own_playbook_of_the_roles_converges_like_setup_yml(make_lab, tmp_path):
    # A ring cabled out of name order, so that the ring and the hostfiles' rank order are the plan's own.
    lab = make_lab(lab_size=3, lab_cables=[[1, 3], [3, 2], [2, 1]])
    assert lab.up().rc == 0
    own = tmp_path / "own.yml"
    own.write_text(OWN_PLAYBOOK)
    mine, theirs = tmp_path / "mine", tmp_path / "setup"
    inventory = str(lab.inventory)

    first = run_playbook(str(own), "-e", f"meshkit_artifacts_dir={mine}", inventory=inventory)
    assert first.rc == 0, first.output
    assert all(counts["changed"] > 0 for counts in first.recap.values()), first.recap
    # Every role ran as itself, preflight once (a dependency of the others), the picture drawn.
    assert first.output.count("TASK [meshkit.cluster.preflight : Establish every host's management interface") == 1
    for role in ("discovery", "plan", "peer_network", "hostfiles"):
        assert f"TASK [meshkit.cluster.{role} : " in first.output, role
    assert (mine / "cabling.svg").read_text().lstrip().startswith(("<?xml", "<svg", "<!DOCTYPE"))
    plan = check_converged(lab, mine)
    assert plan["ring"][0] == "node1" and len(plan["cables"]) == 3

    again = run_playbook(str(own), "-e", f"meshkit_artifacts_dir={mine}", inventory=inventory)
    assert again.rc == 0, again.output
    assert again.changed == 0, again.output

    hosts_before = host_hostfiles(lab)
    setup = run_playbook(
        "setup.yml", "-e", f"meshkit_artifacts_dir={theirs}", "--skip-tags", "meshccl,slurm", inventory=inventory
    )
    assert setup.rc == 0, setup.output
    # Nothing to change on any host: the only changes are setup.yml's own files on the controller (a new
    # artifacts directory: plan.json, hostfiles, picture), reported by the tasks that run_once there.
    changed_tasks = [chunk.split("]", 1)[0] for chunk in setup.output.split("\nTASK [")[1:] if "\nchanged: [" in chunk]
    assert sorted(changed_tasks) == sorted(
        [
            "meshkit.cluster.plan : Plan cables, rings, backend and one /30 per cable",
            "meshkit.cluster.hostfiles : Write every hostfile format on the controller",
            "meshkit.cluster.plan : Draw the cabling (DOT, SVG, PNG)",
        ]
    ), setup.output
    assert host_hostfiles(lab) == hosts_before
    ours, setups = json.loads((mine / "plan.json").read_text()), json.loads((theirs / "plan.json").read_text())
    assert ours["fingerprint"] == setups["fingerprint"]
    assert ours == setups
    assert files_under(mine / "hostfiles") == files_under(theirs / "hostfiles")
    assert files_under(mine / "hostfiles")["mlx-hostfile.json"] == hosts_before["node1"]["mlx-hostfile.json"]


def test_a_role_without_its_inputs_refuses_before_changing_anything(make_lab, tmp_path):
    """peer_network alone, with no plan: it refuses naming the variable and the role that gives it; nothing on any
    host changed (the only tasks that ran are the preflight's, which change nothing)."""
    lab = make_lab(lab_size=2, lab_shape="line")
    assert lab.up().rc == 0
    alone = tmp_path / "alone.yml"
    alone.write_text(
        "- name: peer_network alone\n"
        "  hosts: cluster\n"
        "  gather_facts: false\n"
        "  become: true\n"
        "  roles:\n"
        "    - meshkit.cluster.peer_network\n"
    )
    run = run_playbook(str(alone), "-e", f"meshkit_artifacts_dir={tmp_path / 'a'}", inventory=str(lab.inventory))
    assert run.rc != 0, run.output
    assert "peer_network_plan: no plan given; run the meshkit.cluster.plan role in the play first" in run.output
    assert run.changed == 0, run.output
    assert "TASK [meshkit.cluster.peer_network : Give every cable" not in run.output
