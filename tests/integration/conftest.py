"""Helpers for tests that build real labs: namespaces, veth cables, sshd, Ansible over SSH.

Every lab a test builds has its own name (prefix "mkt") and its own management
subnet inside 198.19.0.0/16, so the tests coexist with a developer's `make demo`
lab (198.18.0.0/24) and with each other (make test runs them on two pytest-xdist
workers at once); each is removed when its test ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshkit import lab_claims

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
# Without COLUMNS/LINES: pytest-xdist's workers have COLUMNS=80, and `ps` (procps) then cuts every
# command line at 80 characters (the process listings on lab hosts would miss what they look for).
ENV = dict(
    {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
    PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
    ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
    ANSIBLE_NOCOLOR="1",
    ANSIBLE_FORCE_COLOR="0",
)
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


# Modules whose tests share one lab (a module-scoped fixture; molecule's lab has a fixed name): under
# pytest-xdist with --dist loadgroup (make test: -n 2), one worker runs each such module whole, every
# other test goes wherever a worker is free (pytest_xdist_make_scheduler below). They are collected
# first, the longest first, so that they never start last.
SHARED_LAB_MODULES = ("test_launch.py", "test_molecule.py", "test_reboot.py", "test_lifecycle.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's own loadgroup (tests marked xdist_group) needs a nodeid it can rewrite, which pytest 9's
    nodes no longer let it: the same grouping by module name instead, for --dist loadgroup."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedLabScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if Path(module).name in SHARED_LAB_MODULES else nodeid

    return SharedLabScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() != 0 and any("integration" in str(i.path) for i in items):
        pytest.exit("the lab tests build network namespaces and need root: run `make test` as root", returncode=1)
    first = {name: rank for rank, name in enumerate(SHARED_LAB_MODULES)}
    items.sort(key=lambda i: first.get(i.path.name, len(first)) if "integration" in str(i.path) else len(first) + 1)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=check, cwd=REPO, stdin=subprocess.DEVNULL)


def ip_json(*args: str) -> Any:
    out = sh("ip", "-j", *args).stdout
    return json.loads(out) if out.strip() else []


@dataclass
class PlaybookRun:
    rc: int
    output: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        return sum(r["changed"] for r in self.recap.values())


def run_playbook(playbook: str, *extra: str, inventory: str | None = None) -> PlaybookRun:
    cmd = ["ansible-playbook", playbook, *extra]
    if inventory:
        cmd += ["-i", inventory]
    proc = sh(*cmd, check=False)
    output = proc.stdout + proc.stderr
    recap = {
        m.group(1): {
            "ok": int(m.group(2)),
            "changed": int(m.group(3)),
            "unreachable": int(m.group(4)),
            "failed": int(m.group(5)),
        }
        for m in RECAP.finditer(output)
    }
    return PlaybookRun(proc.returncode, output, recap)


def lab_vars(**variables: Any) -> list[str]:
    return ["-e", json.dumps(variables)]


@dataclass
class LabHandle:
    name: str
    subnet: str
    variables: dict[str, Any]
    build: PlaybookRun | None = None

    @property
    def dir(self) -> Path:
        return REPO / ".lab" / self.name

    @property
    def inventory(self) -> Path:
        return REPO / "inventory" / f"{self.name}.yml"

    @property
    def cabling_file(self) -> Path:
        return REPO / "inventory" / f"{self.name}.cabling.yml"

    def all_vars(self, **more: Any) -> dict[str, Any]:
        return {"lab_name": self.name, "lab_mgmt_subnet": self.subnet, **self.variables, **more}

    def up(self, *extra: str, **more: Any) -> PlaybookRun:
        return run_playbook("playbooks/lab.yml", *lab_vars(**self.all_vars(**more)), *extra)

    def down(self) -> PlaybookRun:
        return run_playbook("playbooks/lab.yml", *lab_vars(**self.all_vars(lab_state="absent")))

    def cabling(self) -> dict[str, Any]:
        return yaml.safe_load(self.cabling_file.read_text())

    def hosts(self) -> dict[str, dict[str, Any]]:
        inv = yaml.safe_load(self.inventory.read_text())
        return inv["all"]["children"]["cluster"]["hosts"]

    def ansible(self, *args: str, pattern: str = "all") -> subprocess.CompletedProcess[str]:
        return sh("ansible", "-i", str(self.inventory), pattern, *args, check=False)

    def leftovers(self) -> list[str]:
        """Anything of this lab still on the machine."""
        left = [f"netns {n['name']}" for n in ip_json("netns", "list") if n["name"].startswith(self.name + "-")]
        left += [
            f"link {link['ifname']}" for link in ip_json("link", "show") if link["ifname"].startswith(self.name + "-")
        ]
        left += [f"file {p}" for p in (self.dir, self.inventory, self.cabling_file) if p.exists()]
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if f"/.lab/{self.name}/" in cmdline:
                    left.append(f"process {proc.name}: {cmdline.strip()}")
        return left


_counter = iter(range(1, 10_000))


def claim_subnet() -> str:
    """A free 198.19.x.0/24 for one test lab, claimed for this process (meshkit/lab_claims.py): test runs
    of several checkouts, xdist workers and the scale bench on one machine never pick the same one."""
    subnet = lab_claims.first_free(range(1, 250))
    if subnet is None:
        raise RuntimeError(f"no free 198.19.x.0/24 for a test lab (claims in {lab_claims.CLAIMS})")
    return subnet


release_subnet = lab_claims.release


def new_lab(name: str | None = None, subnet: str | None = None, *, tag: str = "x", **variables: Any) -> LabHandle:
    """A lab handle with a name and subnet no other test (or test run, or pytest-xdist worker) on this
    machine uses: the name carries the third octet of the subnet this process claimed (``tag`` says
    which test it is for, in a listing), so two processes never make the same name."""
    subnet = subnet or claim_subnet()
    return LabHandle(name or f"mkt{subnet.split('.')[2]}{tag}{next(_counter)}", subnet, variables)


def drop_lab(handle: LabHandle) -> None:
    handle.down()
    release_subnet(handle.subnet)


@pytest.fixture
def make_lab() -> Iterator[Any]:
    """Build labs with unique names and subnets; every one is removed at the end of the test."""
    made: list[LabHandle] = []

    def factory(*, name: str | None = None, subnet: str | None = None, **variables: Any) -> LabHandle:
        handle = new_lab(name, subnet, **variables)
        made.append(handle)
        return handle

    yield factory
    for handle in made:
        drop_lab(handle)


def kernel_cables(hosts: dict[str, str]) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The veth cables between the given hosts ({host: netns}), as the kernel reports them."""
    host_of = {ns: h for h, ns in hosts.items()}
    name_of: dict[tuple[str, int], str] = {}
    ends = []
    for host, ns in hosts.items():
        nsids = {e["nsid"]: e.get("name") for e in ip_json("-n", ns, "netns", "list-id")}
        for link in ip_json("-n", ns, "-d", "link", "show"):
            name_of[(host, link["ifindex"])] = link["ifname"]
            if link.get("linkinfo", {}).get("info_kind") == "veth" and link["ifname"] != "mgmt0":
                ends.append(
                    (host, link["ifname"], host_of.get(nsids.get(link.get("link_netnsid"))), link.get("link_index"))
                )
    cables = {tuple(sorted([(h, p), (peer, name_of.get((peer, idx), "?"))])) for h, p, peer, idx in ends}
    return sorted(cables)  # type: ignore[arg-type]


def ping_hosts(lab: LabHandle) -> dict[str, str]:
    """`ansible all -m ping` over the lab inventory: {host: SUCCESS|UNREACHABLE|FAILED}."""
    proc = lab.ansible("-m", "ansible.builtin.ping")
    return dict(re.findall(r"^(\S+) \| (SUCCESS|UNREACHABLE!|FAILED!)", proc.stdout, re.M))


def launch_allreduce(handle: LabHandle, artifacts: Path, job: str) -> tuple[PlaybookRun, dict[str, Any]]:
    """launch.yml running meshccl's all-reduce (tests/integration/programs/meshccl_allreduce.py) on every host,
    one rank each, as job ``job``: the playbook run and the job's summary.json (the run must succeed)."""
    program = Path(__file__).parent / "programs" / "meshccl_allreduce.py"
    settings = {
        "launch_program": ["python3", str(program)],
        "launch_ranks_per_host": 1,
        "launch_timeout": 120,
        "launch_job_id": job,
    }
    run = run_playbook(
        "launch.yml",
        "-e",
        f"meshkit_artifacts_dir={artifacts}",
        "-e",
        json.dumps(settings),
        inventory=str(handle.inventory),
    )
    assert run.rc == 0, run.output
    return run, json.loads((artifacts / "launch" / job / "summary.json").read_text())
