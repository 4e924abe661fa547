"""Secrets in a launch (issue 18). One rule says which environment variables are secrets
(launch_plan.is_secret); the plan, job.json, the logs and the summary hold none of their values
while the ranks get them; every rank of every runtime gets a fresh job token and the job id;
`meshkit launch` never hands a secret's value to Ansible; launch.yml's actions read the values
from a variable, never from a task argument, so Ansible shows none even at -vvv with its task
arguments displayed; and check mode writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from meshkit import cli, launch_plan
from meshkit.launch_plan import HIDDEN, LaunchError, is_secret, redact, secret_values
from meshkit.launcher import Launcher, host_jobs
from meshkit.topology import Observation, build_plan

REPO = Path(__file__).resolve().parents[2]
ENV = dict(
    os.environ,
    PATH=f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
    ANSIBLE_NOCOLOR="1",
)
HOSTS = ["node1", "node2", "node3"]

# A rank that says what secrets it got: their hashes and lengths, its job id, any value on a command line.
RANK = str(Path(__file__).parents[1] / "integration" / "programs" / "rank_secrets.py")


def plan_of_ring() -> dict[str, Any]:
    obs = []
    for a, b, pa, pb in [(1, 2, "tb0", "tb0"), (2, 3, "tb1", "tb0"), (3, 1, "tb1", "tb1")]:
        obs.append(Observation(f"node{a}", pa, f"id-{a}-{pa}", [f"id-{b}-{pb}"]))
        obs.append(Observation(f"node{b}", pb, f"id-{b}-{pb}", [f"id-{a}-{pa}"]))
    return build_plan(HOSTS, obs, "10.50.0.0/24", "", False).as_dict()


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def fresh() -> str:
    return f"v-{uuid.uuid4().hex}"


def everything_under(*roots: Path) -> bytes:
    """Every file's bytes under ``roots`` (each file's name first), for a search."""
    out = b""
    for root in roots:
        for path in sorted(root.rglob("*")) if root.exists() else []:
            if path.is_file():
                out += str(path).encode() + b"\n" + path.read_bytes() + b"\n"
    return out


# ---- the rule --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["API_TOKEN", "token", "HF_TOKEN", "MESHCCL_TOKEN", "AWS_SECRET_ACCESS_KEY", "ssh_key", "ApiKey", "DB_PASSWORD",
     "my_password_file", "Secret", "KEYRING"],
)  # fmt: skip
def test_a_name_holding_token_key_secret_or_password_is_a_secret(name: str) -> None:
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PATH", "MESHKIT_RANK", "MESHCCL_JOB_ID", "MY_PASS", "NCCL_IB_HCA", "MASTER_PORT"])
def test_other_names_are_not_unless_marked(name: str) -> None:
    assert not is_secret(name)
    assert is_secret(name, [name]) and is_secret(name, [name.lower()])  # marked (any case)
    assert not is_secret(name, ["SOMETHING_ELSE"])


def test_redact_hides_exactly_the_secrets() -> None:
    env = {"API_TOKEN": "a", "MY_PASS": "b", "GREETING": "hi", "PATH": "/bin"}
    assert redact(env, ["MY_PASS"]) == {"API_TOKEN": HIDDEN, "MY_PASS": HIDDEN, "GREETING": "hi", "PATH": "/bin"}
    assert redact(env) == {**env, "API_TOKEN": HIDDEN}
    assert env["API_TOKEN"] == "a"  # a copy


# ---- the plan and job.json -------------------------------------------------------------------------


def test_every_runtime_plans_the_token_and_job_id_and_holds_no_secret_value(tmp_path: Path) -> None:
    api, pw = fresh(), fresh()
    for runtime in launch_plan.RUNTIMES:
        settings = launch_plan.validate(
            {
                "program": "python3 x.py",
                "runtime": runtime,
                "env": {"API_TOKEN": api, "MY_PASS": pw, "GREETING": "hi"},
                "secret_env": ["MY_PASS"],
            }
        )
        inputs = {"state_dir": "/s", "cluster": "c", "dest": str(tmp_path / runtime)}
        job = launch_plan.record_job(launch_plan.make_job(plan_of_ring(), settings, inputs, "job-7"), inputs["dest"])
        assert job["secret_env"] == ["MESHCCL_TOKEN", "API_TOKEN", "MY_PASS"], runtime
        for r in job["ranks"]:
            env = r["env"]
            assert env["MESHCCL_TOKEN"] == env["API_TOKEN"] == env["MY_PASS"] == HIDDEN, runtime
            assert env["MESHCCL_JOB_ID"] == "job-7" and env["GREETING"] == "hi", runtime
        written = (tmp_path / runtime / "job-7" / "job.json").read_text()
        for text in (json.dumps(job), written):
            assert api not in text and pw not in text, runtime
        assert json.loads(written)["ranks"][0]["env"]["API_TOKEN"] == HIDDEN


def test_job_json_hides_a_secret_that_reached_a_rank_anyway(tmp_path: Path) -> None:
    """shown() is the last word before anything is written: a value put into the plan by hand is
    hidden too, by the job's secret_env and by the rule."""
    settings = launch_plan.validate({"program": "x", "runtime": "plain", "secret_env": ["MY_PASS"]})
    job = launch_plan.make_job(plan_of_ring(), settings, {"state_dir": "/s", "cluster": "c"}, "j")
    job["ranks"][0]["env"] |= {"MESHCCL_TOKEN": "tok-value", "OTHER_SECRET": "s-value", "MY_PASS": "p-value"}
    job["secret_env"] = ["MESHCCL_TOKEN", "MY_PASS"]
    launch_plan.record_job(job, str(tmp_path))
    written = (tmp_path / "j" / "job.json").read_text()
    assert "-value" not in written
    assert json.loads(written)["ranks"][0]["env"]["OTHER_SECRET"] == HIDDEN


def test_a_bad_setting_is_named_without_showing_a_secret() -> None:
    api, pw = fresh(), fresh()
    with pytest.raises(LaunchError) as caught:
        launch_plan.validate(
            {"program": "x", "env": {"API_TOKEN": api, "MY_PASS": pw, "BAD": [1]}, "secret_env": ["MY_PASS"]}
        )
    text = str(caught.value)
    assert text.startswith("bad launch settings; nothing was started:\n  - launch_env = {"), text
    assert "'API_TOKEN': '<hidden>'" in text and "'MY_PASS': '<hidden>'" in text, text
    assert api not in text and pw not in text


def test_secret_values_a_fresh_token_per_job_and_the_users_secrets() -> None:
    job = {"job_id": "j", "secret_env": ["MESHCCL_TOKEN", "API_TOKEN"]}
    first, second = secret_values(job, {"API_TOKEN": "a"}), secret_values(job, {"API_TOKEN": "a"})
    assert re.fullmatch(r"[0-9a-f]{64}", first["MESHCCL_TOKEN"]), first
    assert first["MESHCCL_TOKEN"] != second["MESHCCL_TOKEN"]
    assert first["API_TOKEN"] == "a" and set(first) == {"MESHCCL_TOKEN", "API_TOKEN"}
    # A token the user gives is used; the plan's placeholder is not a value.
    assert secret_values(job, {"API_TOKEN": "a", "MESHCCL_TOKEN": "mine"})["MESHCCL_TOKEN"] == "mine"
    with pytest.raises(LaunchError, match=r"job j: no value for the secret variable API_TOKEN; give it in launch_env"):
        secret_values(job, {"API_TOKEN": HIDDEN, "OTHER": "x"})


# ---- the ranks get the values; nothing written has them --------------------------------------------


def test_ranks_get_the_values_and_no_file_summary_or_command_line_has_them(tmp_path: Path) -> None:
    api, pw = fresh(), fresh()
    job_id = f"secrets-{uuid.uuid4().hex[:8]}"
    given = {"API_TOKEN": api, "MY_PASS": pw, "GREETING": "hi"}
    settings = launch_plan.validate(
        {"program": [sys.executable, RANK], "runtime": "plain", "env": given, "secret_env": ["MY_PASS"]}
    )
    inputs = {"state_dir": str(tmp_path / "state"), "cluster": "c", "dest": str(tmp_path / "artifacts")}
    job = launch_plan.record_job(launch_plan.make_job(plan_of_ring(), settings, inputs, job_id), inputs["dest"])
    values = secret_values(job, given)
    shares = host_jobs(job, {h: {"kind": "local", "python": sys.executable} for h in HOSTS}, values)
    for share in shares:  # what the agents are started with: no value on their command lines
        assert not any(v in " ".join(share.argv) for v in values.values())
    result = Launcher(shares, job_id, Path(job["log_dir"]), grace=1.0).run()
    assert result.ok, result.summary()
    token = values["MESHCCL_TOKEN"]
    expected = (
        f"MESHCCL_TOKEN={sha(token)}/64 API_TOKEN={sha(api)}/{len(api)} MY_PASS={sha(pw)}/{len(pw)} "
        f"job={job_id} argv-leaks=none"
    )
    assert [r.tail[-1] for r in result.ranks] == [f"secrets rank {r} {expected}" for r in range(3)]
    found = everything_under(tmp_path / "artifacts", tmp_path / "state")
    assert b"summary.json" in found and b"job.json" in found and b"rank-2.log" in found and b"agent.log" in found
    for value in (token, api, pw):
        assert value.encode() not in found
        assert value not in json.dumps(result.summary())


# ---- meshkit launch: Ansible never gets a secret's value --------------------------------------------


def test_meshkit_launch_hands_ansible_the_names_of_its_secrets_never_their_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, pw, db = fresh(), fresh(), fresh()
    monkeypatch.setenv("DB_PASSWORD", db)
    args = cli.parser().parse_args(
        ["launch", "-i", str(tmp_path / "inv.yml"), "-x", f"API_TOKEN={api}", "-x", f"MY_PASS={pw}",
         "--secret", "MY_PASS", "-x", "GREETING=hi", "-x", "DB_PASSWORD", "--", "prog"]
    )  # fmt: skip
    assert dict(args.env)["DB_PASSWORD"] == db  # -x NAME: its value here
    seen: dict[str, Any] = {}

    def run(**kwargs: Any) -> SimpleNamespace:
        seen.update(kwargs)
        seen["environment"] = dict(os.environ)  # what ansible-runner would copy (and record)
        return SimpleNamespace(rc=0)

    import ansible_runner

    monkeypatch.setattr(ansible_runner, "run", run)
    assert cli.prepare(args, ["prog"], tmp_path / "job.json", tmp_path / "runner") == (0, [])
    extravars = seen["extravars"]
    assert extravars["launch_env"] == {"API_TOKEN": HIDDEN, "MY_PASS": HIDDEN, "GREETING": "hi", "DB_PASSWORD": HIDDEN}
    assert extravars["launch_secret_env"] == ["MY_PASS"]
    everything = json.dumps(seen, default=str)
    assert api not in everything and pw not in everything and db not in everything
    assert os.environ["DB_PASSWORD"] == db  # given back afterwards
    # A -x NAME that is not set is refused without a value shown.
    monkeypatch.delenv("DB_PASSWORD")
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["launch", "-i", "x", "-x", "DB_PASSWORD", "--", "prog"])


def test_meshkit_launch_puts_the_secrets_values_in_when_it_starts_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's own start (after launch.yml or the quick checks prepared the job): the job holds
    <hidden>; the ranks get the values of -x; nothing the launch prints or writes has them."""
    api, pw = fresh(), fresh()
    job_id = f"secrets-{uuid.uuid4().hex[:8]}"
    settings = launch_plan.validate(
        {
            "program": [sys.executable, RANK],
            "runtime": "plain",
            "env": {"API_TOKEN": HIDDEN, "MY_PASS": HIDDEN},
            "secret_env": ["MY_PASS"],
        }
    )  # fmt: skip  (as launch.yml plans from what prepare() gave it)
    inputs = {"state_dir": str(tmp_path / "state"), "cluster": "c", "dest": str(tmp_path / "artifacts")}
    job = launch_plan.record_job(launch_plan.make_job(plan_of_ring(), settings, inputs, job_id), inputs["dest"])
    prepared = {"job": job, "connections": {h: {"kind": "local", "python": sys.executable} for h in HOSTS}}
    monkeypatch.setattr(cli, "quick", lambda _args, _program: prepared)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115 - what a launch from a script has
    code = cli.main(
        ["launch", "-i", str(tmp_path / "inv.yml"), "--no-stdin", "-x", f"API_TOKEN={api}", "-x", f"MY_PASS={pw}",
         "--secret", "MY_PASS", "--", "unused"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = re.findall(r"^\[\d\|node\d\] secrets rank \d (.*)$", out, re.M)
    assert len(lines) == 3, out
    for line in lines:
        assert f"API_TOKEN={sha(api)}/{len(api)} MY_PASS={sha(pw)}/{len(pw)}" in line and "argv-leaks=none" in line
        assert re.search(r"MESHCCL_TOKEN=[0-9a-f]{64}/64 ", line), line
    assert len({re.search(r"MESHCCL_TOKEN=(\S+)", line).group(1) for line in lines}) == 1  # one token per job
    found = everything_under(tmp_path) + out.encode() + err.encode()
    assert api.encode() not in found and pw.encode() not in found


# ---- launch.yml's actions through Ansible itself ----------------------------------------------------

PLAYBOOK = """
- name: Plan and launch a job whose environment holds secrets
  hosts: cluster
  gather_facts: false
  tasks:
    - name: Plan the job
      meshkit.cluster.launch_plan:
        plan: "{{ lookup('ansible.builtin.file', plan_file) | from_json }}"
        settings:
          program: "{{ program }}"
          runtime: plain
          secret_env: "{{ launch_secret_env | default([]) }}"
        env_var: launch_env
        job_id: "{{ job_id }}"
        state_dir: "{{ state_dir }}"
        cluster: c
        master_port: 29500
        meshccl_port: 29600
        dest: "{{ dest }}"
      run_once: true
      delegate_to: localhost
      register: planned

    - name: Start every rank
      meshkit.cluster.launch:
        job: "{{ planned.job }}"
        env_var: launch_env
      run_once: true
      delegate_to: localhost
      register: launched
"""


def ansible_launch(tmp_path: Path, *extra: str, **variables: Any) -> subprocess.CompletedProcess[str]:
    """The two actions as launch.yml runs them, on three local "hosts", at -vvv with every task's
    arguments shown (display_args_to_stdout)."""
    (tmp_path / "plan.json").write_text(json.dumps(plan_of_ring()))
    (tmp_path / "launch.yml").write_text(PLAYBOOK)
    inventory = {
        "all": {
            "children": {"cluster": {"hosts": {host: {} for host in HOSTS}}},
            "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        }
    }
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    given = {
        "plan_file": str(tmp_path / "plan.json"),
        "program": [sys.executable, RANK],
        "state_dir": str(tmp_path / "state"),
        "dest": str(tmp_path / "artifacts" / "launch"),
        **variables,
    }
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps(given))
    vars_file.chmod(0o600)
    return subprocess.run(
        ["ansible-playbook", "-vvv", "-i", str(tmp_path / "inventory.yml"), "-e", f"@{vars_file}", *extra,
         str(tmp_path / "launch.yml")],
        capture_output=True, text=True, env=dict(ENV, ANSIBLE_DISPLAY_ARGS_TO_STDOUT="True"), cwd=tmp_path,
        check=False, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip


def listing(*roots: Path) -> list[tuple[str, int, int]]:
    """Every path under ``roots`` with its size and modification time."""
    paths = [p for root in roots if root.exists() for p in sorted(root.rglob("*"))]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]


def test_launch_yml_actions_show_no_secret_even_at_vvv_and_the_ranks_get_them(tmp_path: Path) -> None:
    api, pw = fresh(), fresh()
    job_id = f"secrets-{uuid.uuid4().hex[:8]}"
    run = ansible_launch(
        tmp_path,
        job_id=job_id,
        launch_env={"API_TOKEN": api, "MY_PASS": pw, "GREETING": "hi"},
        launch_secret_env=["MY_PASS"],
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "TASK [Plan the job plan=" in out and "env_var=launch_env" in out, out  # the arguments were shown
    lines = re.findall(r"^\[\d\|node\d\] secrets rank \d (.*)$", out, re.M)
    assert len(lines) == 3, out
    for line in lines:
        assert f"API_TOKEN={sha(api)}/{len(api)} MY_PASS={sha(pw)}/{len(pw)} job={job_id} argv-leaks=none" in line
    found = everything_under(tmp_path / "artifacts", tmp_path / "state")
    assert b"job.json" in found and b"summary.json" in found
    for value in (api, pw):
        assert value not in out, "a secret in Ansible's output"
        assert value.encode() not in found
    job = json.loads((tmp_path / "artifacts" / "launch" / job_id / "job.json").read_text())
    assert {r["env"]["API_TOKEN"] for r in job["ranks"]} == {r["env"]["MY_PASS"] for r in job["ranks"]} == {HIDDEN}
    # The planned job, as Ansible shows its result (YAML, ansible.cfg's callback_result_format): 3 ranks.
    assert len(re.findall(r"^ +API_TOKEN: <hidden>$", out, re.M)) == 3, out


def test_launch_yml_actions_in_check_mode_write_nothing(tmp_path: Path) -> None:
    (tmp_path / "artifacts" / "launch").mkdir(parents=True)
    before = listing(tmp_path / "artifacts", tmp_path / "state")
    job_id = f"check-{uuid.uuid4().hex[:8]}"
    run = ansible_launch(tmp_path, "--check", job_id=job_id, launch_env={"API_TOKEN": fresh()})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert f"check mode: job {job_id} would start 3 ranks" in out, out
    assert listing(tmp_path / "artifacts", tmp_path / "state") == before
    assert not (tmp_path / "state").exists()
