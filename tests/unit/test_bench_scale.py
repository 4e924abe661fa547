"""bench/scale.py without a lab: its timing callback run for real by ansible-playbook on localhost,
the growth fit, the tables and the plot from small made-up results, the subnet claims.

The run with labs is `bench/scale.py` itself (a benchmark, never run by the tests).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import scale  # noqa: E402

PLAYBOOK = """\
- name: Tiny play
  hosts: all
  gather_facts: false
  tasks:
    - name: Sleep on b only
      ansible.builtin.command: sleep {{ 1.5 if inventory_hostname == 'b' else 0 }}
      changed_when: false
    - name: Three items
      ansible.builtin.debug:
        msg: "{{ item }}"
      loop: [1, 2, 3]
    - name: Skipped on b
      ansible.builtin.debug:
        msg: a only
      when: inventory_hostname == 'a'
    - name: Change something
      ansible.builtin.command: "true"
      notify: A handler
    - name: Fail on b
      ansible.builtin.command: "false"
      when: fail_b | default(false) and inventory_hostname == 'b'
  handlers:
    - name: A handler
      ansible.builtin.debug:
        msg: handled
"""


def _playbook_run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    (tmp_path / "pb.yml").write_text(PLAYBOOK)
    (tmp_path / "hosts").write_text(
        "".join(f"{h} ansible_connection=local ansible_python_interpreter={sys.executable}\n" for h in "ab")
    )
    run = scale.Run(
        "test",
        ["ansible-playbook", "-i", str(tmp_path / "hosts"), str(tmp_path / "pb.yml"), *extra],
        tmp_path / "run.log",
        tmp_path / "timing.json",
    )
    scale.run_playbook(run, timeout=120)
    return run.to_json()


def test_callback_times_every_task_and_host(tmp_path: Path) -> None:
    result = _playbook_run(tmp_path)
    log = (tmp_path / "run.log").read_text()
    assert result["rc"] == 0 and not result["failed"], log
    assert result["timing"], "the callback wrote no JSON"
    # The default stdout callback still writes the log.
    assert "TASK [Three items]" in log and "PLAY RECAP" in log
    tasks = {t["name"]: t for t in result["tasks"]}
    names = ["Sleep on b only", "Three items", "Skipped on b", "Change something", "Fail on b", "A handler"]
    assert list(tasks) == names
    assert result["tasks_run"] == 6
    assert tasks["A handler"]["handler"] and not tasks["Change something"]["handler"]
    assert all(t["play"] == "Tiny play" and t["role"] is None for t in tasks.values())
    assert tasks["Three items"]["action"] == "ansible.builtin.debug"
    assert tasks["Three items"]["path"].endswith("pb.yml:8")

    sleep = tasks["Sleep on b only"]
    assert sleep["hosts"]["b"]["seconds"] >= 1.5
    assert sleep["hosts"]["b"]["seconds"] - sleep["hosts"]["a"]["seconds"] > 0.75  # each host's own time
    assert sleep["seconds"] >= sleep["hosts"]["b"]["seconds"]  # the task ends with its last host
    assert sleep["start"] <= sleep["hosts"]["a"]["queued"] <= sleep["hosts"]["a"]["done"] <= sleep["end"]
    assert tasks["Three items"]["hosts"]["a"]["items"] == 3
    assert {h: r["status"] for h, r in tasks["Skipped on b"]["hosts"].items()} == {"a": "ok", "b": "skipped"}
    assert {r["status"] for r in tasks["Change something"]["hosts"].values()} == {"changed"}
    # Tasks run one after another: each starts after the one before ended.
    ordered = result["tasks"]
    assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(ordered))
    assert 0 < result["in_tasks_s"] < result["wall_s"]

    # The recap: the callback's counts are the ones Ansible printed.
    assert result["recap"] == scale.parse_recap(log)
    assert result["recap"]["a"]["changed"] == 1 and result["recap"]["b"]["skipped"] == 2
    assert result["changed_total"] == 2
    assert result["host_results"] == 12
    assert result["cpu_s"] > 0.2  # ansible-playbook's own start-up alone takes more
    assert result["cpu_s"] == pytest.approx(result["cpu_user_s"] + result["cpu_sys_s"], abs=0.002)


def test_a_failed_run_is_reported_failed_with_its_recap(tmp_path: Path) -> None:
    result = _playbook_run(tmp_path, "-e", "fail_b=true")
    assert result["failed"] and result["rc"] == 2
    assert result["recap"]["b"]["failed"] == 1 and result["recap"]["a"]["failed"] == 0
    statuses = {t["name"]: {h: r["status"] for h, r in t["hosts"].items()} for t in result["tasks"]}
    assert statuses["Fail on b"] == {"a": "skipped", "b": "failed"}


def test_the_callback_is_off_unless_enabled(tmp_path: Path) -> None:
    """Without the bench's environment nothing is written, and the output is Ansible's own."""
    (tmp_path / "pb.yml").write_text(PLAYBOOK)
    (tmp_path / "hosts").write_text(f"a ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    env = scale.bench_env(tmp_path / "timing.json")
    del env["ANSIBLE_CALLBACKS_ENABLED"]
    proc = subprocess.run(
        ["ansible-playbook", "-i", str(tmp_path / "hosts"), str(tmp_path / "pb.yml")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TASK [Three items]" in proc.stdout and "PLAY RECAP" in proc.stdout
    assert not (tmp_path / "timing.json").exists()


def test_parse_recap() -> None:
    text = textwrap.dedent("""\
        PLAY RECAP *********************************************************************
        node1    : ok=20   changed=3    unreachable=0    failed=0    skipped=5    rescued=0    ignored=1
        node2    : ok=19   changed=0    unreachable=1    failed=2    skipped=4    rescued=0    ignored=0
        """)
    recap = scale.parse_recap(text)
    assert recap["node1"] == {
        "ok": 20,
        "changed": 3,
        "unreachable": 0,
        "failed": 0,
        "skipped": 5,
        "rescued": 0,
        "ignored": 1,
    }
    assert recap["node2"]["unreachable"] == 1 and recap["node2"]["failed"] == 2
    assert scale.parse_recap("no recap here") == {}


def test_fit_line() -> None:
    fit = scale.fit_line([4, 8, 16, 32], [2 * n + 3 for n in (4, 8, 16, 32)])
    assert fit is not None
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(3) and fit["r2"] == pytest.approx(1)
    noisy = scale.fit_line([4, 8, 16], [10.0, 19.0, 43.0])
    assert noisy is not None and 0.9 < noisy["r2"] < 1
    # numpy's own least squares on the same points
    assert noisy["slope"] == pytest.approx(39 / 14)  # Sxy / Sxx = 208 / (224 / 3)
    assert noisy["intercept"] == pytest.approx(24 - 39 / 14 * 28 / 3)  # through the means
    assert scale.fit_line([4], [10.0]) is None
    assert scale.fit_line([4, 4], [10.0, 11.0]) is None


# --- the report from made-up results ---------------------------------------------------------------------


def _task(
    name: str,
    start: float,
    per_host: dict[str, float],
    status: str = "ok",
    path: str = "playbooks/setup.yml:9",
    action: str = "x",
):
    hosts = {
        h: {"queued": start, "done": start + s, "status": status, "items": 0, "retries": 0, "seconds": s}
        for h, s in per_host.items()
    }
    end = start + max(per_host.values())
    return {"play": "Converge", "role": None, "name": name, "action": action, "path": f"{scale.REPO}/{path}",
            "handler": False,
            "start": start, "end": end, "seconds": end - start, "hosts": hosts}  # fmt: skip


def _run(step: str, wall: float, cpu: float, tasks: list[dict[str, Any]], rc: int = 0, changed: int = 0):
    return {"step": step, "rc": rc, "failed": rc != 0, "timed_out": False, "wall_s": wall, "cpu_s": cpu,
            "cpu_user_s": cpu, "cpu_sys_s": 0.0, "log": f"logs/{step}.log", "recap": {}, "changed_total": changed,
            "ok_total": 0, "tasks_run": len(tasks), "host_results": sum(len(t["hosts"]) for t in tasks),
            "in_tasks_s": sum(t["seconds"] for t in tasks), "timing": True, "tasks": tasks}  # fmt: skip


def _data(label: str = "before", factor: float = 1.0) -> dict[str, Any]:
    sizes = []
    for n in (2, 4):
        hosts = [f"node{i}" for i in range(1, n + 1)]
        venv = ".collections/ansible_collections/meshkit/cluster/roles/meshccl/tasks/main.yml:85"
        slow = _task("Install meshccl", 1.0, {h: 2.0 * i for i, h in enumerate(hosts, 1)}, "changed", venv)
        # The 2-host first run found the wheel cache cold: the controller built meshccl's wheel.
        wheel = "changed" if n == 2 else "ok"
        build = [_task("Build the wheel", 0.1, {"node1": 0.02}, wheel, action="meshkit.cluster.meshccl_wheel")]
        fast = [_task(f"Task {k}", 10.0 + k, dict.fromkeys(hosts, 0.05 + 0.01 * k)) for k in range(20)]
        again_tasks = [_task("Write hostfiles", 1.0, dict.fromkeys(hosts, 0.5), "changed" if n == 4 else "ok")]
        sizes.append(
            {
                "hosts": n,
                "lab": f"sc{n}",
                "build_s": 5.0 + n,
                "runs": {
                    "setup_first": _run("setup_first", factor * (10 + 5 * n), 3 * n, [*build, slow, *fast]),
                    "setup_again": _run("setup_again", factor * (4 + 2 * n), n, again_tasks, changed=n * (n == 4)),
                    "launch": _run("launch", 3.0, 1.5, [], rc=2 if n == 4 else 0),
                },
            }
        )
    return {"label": label, "date": "2026-11-25", "params": {"forks": "16", "ranks_per_host": 2},
            "machine": {"cpus": 2, "load_start": "1.0", "load_end": "2.0", "ansible_core": "2.19.14",
                        "commit": "abc1234", "dirty": False}, "sizes_run": sizes}  # fmt: skip


def test_fits_leave_failed_runs_out() -> None:
    f = scale.fits(_data())
    assert f["setup_first.wall_s"]["slope"] == pytest.approx(5)
    assert f["setup_first.wall_s"]["intercept"] == pytest.approx(10)
    assert f["setup_again.cpu_s"]["slope"] == pytest.approx(1)
    assert f["launch.wall_s"] is None  # the 4-host launch failed: one size left, no line


def test_markdown_table_growth_and_slowest_tasks() -> None:
    md = scale.markdown(_data())
    lines = md.splitlines()
    assert lines[0] == "# setup.yml and launch.yml against cluster size (before)"
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines if ln.startswith("| ")}
    assert row["2"] == ["20.0", "6.0", "8.0", "2.0", "0", "3.00", "1.50", "22 / 1 / 0", "7.0"]
    assert row["4"][:6] == ["30.0", "12.0", "12.0", "4.0", "4", "FAILED (rc 2)"]
    assert "- 4 hosts, launch.yml: failed (rc 2); log logs/launch.log" in md
    assert "- 2 hosts, setup.yml first run: the controller built meshccl's wheel (0.0 s" in md
    assert "- 4 hosts, setup.yml first run: the controller built" not in md
    assert "- 4 hosts, no-change run changed 4: Write hostfiles: node1, node2, node3, node4" in md
    assert "| setup.yml first run (wall) | 5.000 | 10.00 | 1.000 | 2 |" in md
    assert "| launch.yml (wall) | — | — | — | 0 |" in md
    # The slowest tasks at the largest size, with the spread over hosts.
    section = md.split("## The 15 slowest tasks at 4 hosts")[1]
    first = section.split("### setup.yml first run")[1].split("###")[0]
    table = [ln for ln in first.splitlines() if ln.startswith("| ") and not ln.startswith("| task")]
    assert len(table) == 15
    assert table[0] == "| Install meshccl | `roles/meshccl/tasks/main.yml:85` | 8.00 | 4 | 8.00 | 5.00 | changed 4 |"
    assert table[1] == "| Task 19 | `playbooks/setup.yml:9` | 0.24 | 4 | 0.24 | 0.24 | ok 4 |"
    assert table[-1].startswith("| Task 6 |")  # 15 of 21: the 6 fastest left out


def test_compare_section_when_both_references_exist() -> None:
    before, after = _data("before"), _data("after", factor=0.5)
    md = scale.markdown(after, (before, after))
    assert "## Reference runs side by side: before (2026-11-25) and after (2026-11-25)" in md
    assert "| setup.yml first run (wall) | 4 | 30.00 | 15.00 | 0.50 |" in md
    assert "| no-change run (wall) | 2.000 | 1.000 | 0.50 |" in md  # growth per host, halved
    assert "## Reference runs" not in scale.markdown(after)


def test_report_rebuilds_md_and_png_from_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "reference_pair", lambda: None)
    path = tmp_path / "scale-before.json"
    path.write_text(json.dumps(_data()))
    assert scale.main(["report", "--json", str(path)]) == 0
    md = (tmp_path / "scale-before.md").read_text()
    assert md == scale.markdown(_data())
    if importlib.util.find_spec("matplotlib"):  # bench/requirements.txt (make bench-deps); not make test's venv
        png = (tmp_path / "scale-before.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    else:
        assert not (tmp_path / "scale-before.png").exists()
        assert "matplotlib is not installed" in scale.plot(_data(), tmp_path / "other.png")
    assert json.loads(path.read_text()) == _data()  # the JSON itself is left as it was
    assert scale.main(["report", "--json", str(tmp_path / "missing.json")]) == 2


def test_parse_sizes() -> None:
    assert scale.parse_sizes("8,4,16,4") == [4, 8, 16]
    for bad in ("", "1,4", "4,x", "65"):
        with pytest.raises(Exception, match=r"host counts|comma list"):
            scale.parse_sizes(bad)


def test_subnet_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "CLAIMS", tmp_path)
    monkeypatch.setattr(scale, "routes_in", lambda subnet: [])
    first = scale.claim_subnet(None)
    assert first == "198.19.248.0/24" and (tmp_path / "248").read_text() == str(os.getpid())
    assert scale.claim_subnet(None) == "198.19.247.0/24"  # a live claim (ours) is never taken
    with pytest.raises(scale.ScaleError, match="claimed by another"):
        scale.claim_subnet("198.19.248.0/24")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    (tmp_path / "246").write_text(dead.stdout.strip())  # its process is gone: taken over
    assert scale.claim_subnet(None) == "198.19.246.0/24"
    scale.release(first)
    assert not (tmp_path / "248").exists() and (tmp_path / "247").exists()
    monkeypatch.setattr(scale, "routes_in", lambda subnet: ["198.19.245.0/24 dev x"])
    with pytest.raises(scale.ScaleError, match="in use on this machine"):
        scale.claim_subnet("198.19.245.0/24")


SLOW = """\
- name: Slow play
  hosts: all
  gather_facts: false
  tasks:
    - name: Sleep long
      ansible.builtin.command: sleep {{ marker }}
"""


def _sleepers(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"sleep\0{marker}" in (proc / "cmdline").read_text():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _slow_run(tmp_path: Path, marker: str) -> scale.Run:
    (tmp_path / "slow.yml").write_text(SLOW)
    (tmp_path / "hosts").write_text(f"a ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    argv = ["ansible-playbook", "-i", str(tmp_path / "hosts"), str(tmp_path / "slow.yml"), "-e", f"marker={marker}"]
    return scale.Run("slow", argv, tmp_path / "slow.log", tmp_path / "slow.json")


def _wait_for(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_run_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    marker = f"{os.getpid() % 1000 + 100}.125"
    run = scale.run_playbook(_slow_run(tmp_path, marker), timeout=3)
    result = run.to_json()
    assert result["timed_out"] and result["failed"] and result["rc"] == -9
    assert 3 <= result["wall_s"] < 20
    assert not result["timing"] and result["recap"] == {}  # killed: no recap, no callback JSON
    assert result["tasks_run"] == 1  # counted from the log instead
    _wait_for(lambda: not _sleepers(marker))  # the whole session went, the task's sleep too
    assert "FAILED (rc -9, timed out)" in scale._cell(result, "wall_s")


def test_an_interrupt_stops_the_playbook_and_its_processes(tmp_path: Path) -> None:
    """SIGTERM to the bench (as Ctrl-C): the playbook's session is stopped and KeyboardInterrupt goes on."""
    marker = f"{os.getpid() % 1000 + 100}.375"
    run = _slow_run(tmp_path, marker)

    def interrupt_once_sleeping() -> None:
        _wait_for(lambda: bool(_sleepers(marker)))
        os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=interrupt_once_sleeping, daemon=True)
    helper.start()
    with pytest.raises(KeyboardInterrupt), scale.terminate_as_interrupt():
        scale.run_playbook(run, timeout=120)
    helper.join()
    _wait_for(lambda: not _sleepers(marker))
    assert "Sleep long" in run.log.read_text()


def test_report_without_matplotlib_writes_the_table_and_says_why_no_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make test's environment has no matplotlib (bench/requirements.txt brings it): the md is still written."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(scale, "reference_pair", lambda: None)
    path = tmp_path / "scale-before.json"
    path.write_text(json.dumps(_data()))
    assert scale.main(["report", "--json", str(path)]) == 0
    assert (tmp_path / "scale-before.md").read_text() == scale.markdown(_data())
    assert not (tmp_path / "scale-before.png").exists()
    assert "matplotlib is not installed" in scale.plot(_data(), tmp_path / "other.png")
