"""The job's directory on a host (module_utils/agent_jobdir.py): the login user's own, mode 0700, in a
shared sticky parent; a parent or a directory another user could change is refused naming the fix, and
everything is written through the directory's descriptor. (The agent using it end to end, and ranks of
a non-root login user: test_launcher.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.meshkit.cluster.plugins.module_utils import agent_jobdir

NOBODY = 65534


def made(path: Path) -> os.stat_result:
    """Make a job directory as the agent does; the stat of what its descriptor holds."""
    fd = agent_jobdir.job_directory(str(path))
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def test_the_job_directory_is_the_users_own_in_a_shared_sticky_parent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    job = state / "jobs" / "j1"
    first = made(job)
    # Missing, the shared parent is made as setup.yml makes it (sticky, world-writable: root here).
    assert (state / "jobs").stat().st_mode & 0o7777 == 0o1777
    assert job.stat().st_mode & 0o7777 == 0o700 and job.stat().st_uid == os.geteuid()
    assert (first.st_ino, first.st_dev) == (job.stat().st_ino, job.stat().st_dev)
    assert made(job).st_ino == first.st_ino  # the same job id again: its own private directory, kept

    squatted = state / "jobs" / "j2"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)
    with pytest.raises(
        agent_jobdir.JobDirError, match=rf"j2 exists and is not a private directory of .*owner uid {NOBODY}"
    ):
        agent_jobdir.job_directory(str(squatted))
    (state / "jobs" / "j3").symlink_to(tmp_path)  # a directory of this user's, through a link
    with pytest.raises(agent_jobdir.JobDirError, match=r"j3 exists and is not a private directory .*\(a symbolic link"):
        agent_jobdir.job_directory(str(state / "jobs" / "j3"))
    (state / "jobs" / "j5").write_text("")
    with pytest.raises(agent_jobdir.JobDirError, match=r"j5 exists and is not a private directory .*\(not a directory"):
        agent_jobdir.job_directory(str(state / "jobs" / "j5"))
    (state / "jobs" / "j4").mkdir(mode=0o755)
    os.chmod(state / "jobs" / "j4", 0o755)
    with pytest.raises(agent_jobdir.JobDirError, match=r"mode 0755\); nothing was started"):
        agent_jobdir.job_directory(str(state / "jobs" / "j4"))


@pytest.mark.parametrize(
    ("owner", "mode", "why"),
    [
        (0, 0o777, "every user may write to it and it is not sticky"),
        (NOBODY, 0o1777, f"it belongs to uid {NOBODY}, neither root nor"),
        (NOBODY, 0o755, f"it belongs to uid {NOBODY}, neither root nor"),
        (0, 0o775, f"group {NOBODY} may write to it and it is not sticky"),
    ],
)
def test_a_jobs_directory_others_could_change_is_refused_naming_the_fix(
    tmp_path: Path, owner: int, mode: int, why: str
) -> None:
    jobs = tmp_path / "state" / "jobs"
    jobs.mkdir(parents=True)
    os.chown(jobs, owner, NOBODY)
    jobs.chmod(mode)
    with pytest.raises(agent_jobdir.JobDirError) as refused:
        agent_jobdir.job_directory(str(jobs / "j1"))
    assert str(refused.value).startswith(f"{jobs} is not a safe place for job directories: {why}"), refused.value
    assert str(refused.value).endswith(f"run setup.yml, or as root: chown root {jobs} && chmod 1777 {jobs}")
    assert not (jobs / "j1").exists()  # refused before anything was made


@pytest.mark.parametrize(("owner", "mode"), [(0, 0o1777), (0, 0o755), (0, 0o1770), ("me", 0o700), ("me", 0o770)])
def test_a_jobs_directory_only_root_or_the_user_can_change_is_used(tmp_path: Path, owner: Any, mode: int) -> None:
    jobs = tmp_path / "state" / "jobs"
    jobs.mkdir(parents=True)
    os.chown(jobs, os.geteuid() if owner == "me" else owner, os.getegid())
    jobs.chmod(mode)
    assert made(jobs / "j1").st_mode & 0o7777 == 0o700


def test_everything_the_agent_writes_goes_through_the_job_directorys_descriptor(tmp_path: Path) -> None:
    """Once the job directory is open, replacing it by a symbolic link (to a directory of the
    attacker's choosing) redirects nothing: files, rank logs and agent.log land in the directory
    that was made, wherever it now is."""
    jobs = tmp_path / "jobs"
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    fd = agent_jobdir.job_directory(str(jobs / "j1"))
    try:
        (jobs / "j1").rename(jobs / "moved")
        (jobs / "j1").symlink_to(decoy)
        agent_jobdir.write_job_file(fd, "meshccl.json", "{}\n")
        with agent_jobdir.job_file(fd, "rank-0.log", "ab") as log:
            log.write(b"line\n")
        with pytest.raises(ValueError, match="plain name"):
            agent_jobdir.write_job_file(fd, "../escape", "x")
    finally:
        os.close(fd)
    assert sorted(p.name for p in (jobs / "moved").iterdir()) == ["meshccl.json", "rank-0.log"]
    assert list(decoy.iterdir()) == []
