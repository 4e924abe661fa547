"""`ansible-galaxy collection build` ships the collection and no run outputs: a playbook, molecule or a test run
in a checkout leaves artifacts directories (plan.json, hostfiles, pictures, launch logs) at any depth, and none of
them may reach the artifact users install."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / ".venv" / "bin"
# Where runs leave their outputs: the default artifacts/<cluster> of a run from the checkout, a molecule
# scenario's when its artifacts directory is not set (relative to the scenario), and one deeper still.
PLANTED = [
    "artifacts/cluster/plan.json",
    "extensions/molecule/default/artifacts/lab-molecule/plan.json",
    "extensions/molecule/default/artifacts/lab-molecule/hostfiles/mlx-hostfile.json",
    "roles/meshccl/artifacts/x/launch/job/summary.json",
]


def test_a_build_after_runs_ships_no_run_outputs(tmp_path: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = tmp_path / "tree"
    for name in tracked.decode().split("\0"):
        source = REPO / name
        if not name or not source.is_file() or source.is_symlink():
            continue
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, tree / name)
    for name in PLANTED:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("{}\n")
    out = tmp_path / "out"
    build = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(out), str(tree)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (artifact,) = out.glob("meshkit-cluster-*.tar.gz")
    with tarfile.open(artifact) as tar:
        names = tar.getnames()
    assert "roles/plan/tasks/main.yml" in names and "plugins/modules/host_ports.py" in names  # the collection is there
    shipped = [name for name in names if "artifacts" in Path(name).parts]
    assert shipped == [], f"run outputs in the collection artifact: {shipped}"
