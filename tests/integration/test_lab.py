"""playbooks/lab.yml on this machine: real namespaces, veth cables, bridges and sshd."""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, ip_json, kernel_cables, ping_hosts, sh

SHAPE_PAIRS = {
    "mesh": lambda n: [(i, j) for i in range(1, n + 1) for j in range(i + 1, n + 1)],
    "line": lambda n: [(i, i + 1) for i in range(1, n)],
    "ring": lambda n: [(i, i % n + 1) for i in range(1, n + 1)] if n > 2 else [(1, 2)],
}


def host_pairs(cabling: dict) -> Counter:
    return Counter(frozenset(end["host"] for end in c["ends"]) for c in cabling["cables"])


def recorded_cables(cabling: dict) -> list:
    return sorted(tuple(sorted((e["host"], e["port"]) for e in c["ends"])) for c in cabling["cables"])


def lab_netns(lab) -> list[str]:
    """This lab's namespaces (other labs, of other test runs, come and go meanwhile)."""
    return sorted(n["name"] for n in ip_json("netns", "list") if n["name"].startswith(lab.name + "-"))


def check_lab_matches_record(lab) -> dict:
    """The kernel has exactly the recorded cables; each host exactly its own ports, in bridge0 with STP."""
    cabling = lab.cabling()
    hosts = lab.hosts()
    netns = {name: h["meshkit_lab_netns"] for name, h in hosts.items()}
    assert kernel_cables(netns) == recorded_cables(cabling)
    for name, ns in netns.items():
        links = {link["ifname"]: link for link in ip_json("-n", ns, "-d", "link", "show")}
        own = sorted(e["port"] for c in cabling["cables"] for e in c["ends"] if e["host"] == name)
        assert sorted(n for n in links if n.startswith("tb")) == own, name
        assert set(links) == {"lo", "mgmt0", "bridge0", *own}, name
        assert links["bridge0"]["linkinfo"]["info_data"]["stp_state"] == 1
        for port in own:
            assert links[port].get("master") == "bridge0", (name, port)
            mac = next(e["mac"] for c in cabling["cables"] for e in c["ends"] if (e["host"], e["port"]) == (name, port))
            assert links[port]["address"] == mac
    return cabling


# Each shape once, and the smallest lab (a 2-host mesh, ring and line are the same one cable): the shapes'
# cabling at every size is tested in tests/unit/test_lab_spec.py; a 16-host mesh below, rings of 5 and 16
# and a 3-host line in test_setup.py.
@pytest.mark.parametrize(("shape", "size"), [("line", 2), ("ring", 4), ("mesh", 4), ("ring", 8)])
def test_lab_shape_builds_answers_over_ssh_and_leaves_nothing(make_lab, shape, size):
    lab = make_lab(lab_size=size, lab_shape=shape)
    run = lab.up()
    assert run.rc == 0, run.output
    cabling = check_lab_matches_record(lab)
    expected = Counter(frozenset((f"node{a}", f"node{b}")) for a, b in SHAPE_PAIRS[shape](size))
    assert host_pairs(cabling) == expected
    assert ping_hosts(lab) == {f"node{i}": "SUCCESS" for i in range(1, size + 1)}

    down = lab.down()
    assert down.rc == 0, down.output
    assert lab.leftovers() == []


def test_explicit_cables_with_a_parallel_cable_and_rate_limit(make_lab):
    lab = make_lab(lab_cables=[[1, 2], [2, 3], [1, 2]], lab_link_rate="200mbit")
    run = lab.up()
    assert run.rc == 0, run.output
    cabling = check_lab_matches_record(lab)
    assert host_pairs(cabling) == Counter({frozenset({"node1", "node2"}): 2, frozenset({"node2", "node3"}): 1})
    assert sorted(lab.hosts()) == ["node1", "node2", "node3"]
    assert lab.hosts()["node1"]["meshkit_lab_ports"] == ["tb0", "tb1"]
    for name, host in lab.hosts().items():
        for port in host["meshkit_lab_ports"]:
            qdisc = ip_json("-n", host["meshkit_lab_netns"], "link", "show", port)  # port exists
            assert qdisc, (name, port)
            tc = sh("tc", "-n", host["meshkit_lab_netns"], "qdisc", "show", "dev", port).stdout
            assert "tbf" in tc and "rate 200Mbit" in tc, (name, port, tc)
    assert ping_hosts(lab) == {"node1": "SUCCESS", "node2": "SUCCESS", "node3": "SUCCESS"}


def test_rerun_changes_nothing_hosts_are_isolated_check_mode_is_truthful(make_lab):
    lab = make_lab(lab_size=4, lab_shape="mesh")
    assert lab.up().rc == 0
    before_cabling = lab.cabling_file.read_text()
    before_netns = lab_netns(lab)

    again = lab.up()
    assert again.rc == 0, again.output
    assert again.changed == 0, again.output

    # --check for a bigger lab says it would change and changes nothing.
    check = lab.up("--check", "--diff", lab_size=5)
    assert check.rc == 0, check.output
    assert check.changed > 0
    assert "+lab " in check.output and "5 hosts" in check.output
    assert lab.cabling_file.read_text() == before_cabling
    assert lab_netns(lab) == before_netns

    # Each host: its own hostname, its own state directory, its own process table; and root's home is its own,
    # as on a freshly installed host: the distribution's dotfiles (never this machine's ~/.bashrc, whose version
    # manager every host would share), its own caches.
    write = lab.ansible(
        "-m", "ansible.builtin.shell", "-a", "hostname | tee /var/lib/meshkit/mark > ~/.cache/mark", pattern="node1"
    )
    assert write.returncode == 0, write.stdout + write.stderr
    look = lab.ansible(
        "-m",
        "ansible.builtin.shell",
        "-a",
        "echo host=$(hostname) mark=$(cat /var/lib/meshkit/mark 2>/dev/null || echo none) "
        "pid1=$(cat /proc/1/cmdline | tr '\\0' ' ' | grep -o lab_init.py) "
        "cache=$(cat ~/.cache/mark 2>/dev/null || echo none) "
        "bashrc=$(cmp -s ~/.bashrc /usr/share/base-files/dot.bashrc && echo distro || echo other) path=$PATH",
    )
    assert look.returncode == 0, look.stdout + look.stderr
    for i in range(1, 5):
        mark = "node1" if i == 1 else "none"
        assert f"host=node{i} mark={mark} pid1=lab_init.py cache={mark} bashrc=distro path=" in look.stdout, look.stdout
    assert ".pyenv" not in look.stdout, look.stdout
    assert not Path("/root/.cache/mark").exists()
    # The machine runs four lab_init.py processes for this lab; node2 sees only its own, as PID 1.
    ps = lab.ansible("-m", "ansible.builtin.command", "-a", "ps -e -o pid=,args=", pattern="node2")
    inits = [line.split()[0] for line in ps.stdout.splitlines() if "lab_init.py" in line]
    assert inits == ["1"], ps.stdout

    # The faster connection plugin reaches the same hosts.
    fast = lab.ansible(
        "-e",
        "ansible_connection=meshkit.cluster.netns",
        "-m",
        "ansible.builtin.command",
        "-a",
        "cat /var/lib/meshkit/mark",
        pattern="node1",
    )
    assert fast.returncode == 0 and "node1" in fast.stdout, fast.stdout + fast.stderr


def settled_state(lab) -> dict[str, list[str]]:
    """Per host, what is not settled yet, read straight from the kernel: mgmt0's address; an IPv6
    link-local address on every interface that is up and has carrier (a bridge: one of its members
    has), unless it generates none (networkd's bridge ports); nothing tentative."""
    lacking: dict[str, list[str]] = {}
    base = lab.subnet.rsplit(".", 1)[0]
    for name, host in lab.hosts().items():
        ns = host["meshkit_lab_netns"]
        mgmt_ip = f"{base}.{int(name.removeprefix('node')) + 1}"
        links = {link["ifname"]: link for link in ip_json("-n", ns, "-d", "link", "show")}
        carrier = {n for n, link in links.items() if "LOWER_UP" in link["flags"]}
        for addrs in ip_json("-n", ns, "addr", "show"):
            ifname, infos = addrs["ifname"], addrs.get("addr_info", [])
            link = links[ifname]
            if ifname == "lo":
                continue
            members = [n for n, m in links.items() if m.get("master") == ifname]
            has_carrier = ifname in carrier or (
                link.get("linkinfo", {}).get("info_kind") == "bridge" and carrier & set(members)
            )
            wants_ll = "UP" in link["flags"] and has_carrier and link.get("inet6_addr_gen_mode") != "none"
            if wants_ll and not any(a["family"] == "inet6" and a.get("scope") == "link" for a in infos):
                lacking.setdefault(name, []).append(f"{ifname}: no link-local")
            lacking.setdefault(name, []).extend(
                f"{ifname}: {a['local']} tentative" for a in infos if a.get("tentative")
            )
            if ifname == "mgmt0" and not any(a.get("local") == mgmt_ip for a in infos):
                lacking.setdefault(name, []).append("mgmt0: no management address")
    return {k: v for k, v in lacking.items() if v}


def test_the_lab_is_settled_when_the_playbook_returns(make_lab):
    lab = make_lab(lab_size=3, lab_shape="mesh")
    # A deadline shorter than STP needs to let bridge0 forward: the play fails naming what is missing.
    early = lab.up(lab_settle_timeout=1)
    assert early.rc != 0
    assert "did not settle within 1 s (lab_settle_timeout)" in early.output, early.output
    assert "bridge0: no IPv6 link-local address yet" in early.output, early.output
    # The normal deadline: when the play returns, every host already has everything.
    run = lab.up()
    assert run.rc == 0, run.output
    assert settled_state(lab) == {}
    assert ping_hosts(lab) == {"node1": "SUCCESS", "node2": "SUCCESS", "node3": "SUCCESS"}
    # A rebuild (another size) is settled too when the play returns.
    bigger = lab.up(lab_size=4)
    assert bigger.rc == 0, bigger.output
    assert settled_state(lab) == {}


def test_host_key_checking_is_on(make_lab):
    lab = make_lab(lab_size=2, lab_shape="line")
    assert lab.up().rc == 0
    inventory = lab.inventory.read_text()
    assert "StrictHostKeyChecking=yes" in inventory
    assert "StrictHostKeyChecking=no" not in inventory
    known_hosts = lab.dir / "known_hosts"
    good = known_hosts.read_text()
    assert len(good.splitlines()) == 2
    # A known_hosts entry with another key for node1 must make SSH refuse node1.
    other = sh("ssh-keygen", "-y", "-f", str(lab.dir / "id_ed25519")).stdout.split()[:2]
    node1_ip = lab.hosts()["node1"]["ansible_host"]
    known_hosts.write_text(
        "\n".join(line for line in good.splitlines() if not line.startswith(node1_ip + " "))
        + f"\n{node1_ip} {other[0]} {other[1]}\n"
    )
    try:
        proc = lab.ansible("-m", "ansible.builtin.ping")
        assert "node2 | SUCCESS" in proc.stdout
        assert "node1 | UNREACHABLE" in proc.stdout
        assert "Host key verification failed" in proc.stdout + proc.stderr
    finally:
        known_hosts.write_text(good)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"lab_size": 1}, "lab_size = 1: min value is 2"),
        ({"lab_size": 4, "lab_cables": [[1, 2], [2, 7]]}, "lab_cables[1] = [2, 7]: host 7 does not exist"),
        ({"lab_cables": [[1, 2], [3, 3]]}, "lab_cables[1] = [3, 3]: a cable from host 3 to itself"),
        ({"lab_shape": "star"}, "lab_shape = 'star': unallowed value star"),
        ({"lab_mgmt_subnet": "127.1.0.0/24"}, "overlaps routes this machine already has"),
    ],
)
def test_bad_input_fails_before_anything_is_built(make_lab, variables, message):
    lab = make_lab(**variables)
    run = lab.up()
    assert run.rc != 0
    assert message in run.output, run.output
    assert lab.leftovers() == []


def test_two_labs_coexist_and_removing_one_keeps_the_other(make_lab):
    first = make_lab(lab_size=2, lab_shape="line")
    second = make_lab(lab_size=3, lab_shape="ring")
    assert first.up().rc == 0
    assert second.up().rc == 0
    clash = make_lab(lab_size=2, subnet=first.subnet)
    refused = clash.up()
    assert refused.rc != 0
    assert f"dev {first.name}-mgmt" in refused.output
    assert first.down().rc == 0
    assert first.leftovers() == []
    assert ping_hosts(second) == {"node1": "SUCCESS", "node2": "SUCCESS", "node3": "SUCCESS"}


def test_sixteen_host_mesh(make_lab):
    lab = make_lab(lab_size=16, lab_shape="mesh")
    start = time.monotonic()
    run = lab.up()
    elapsed = time.monotonic() - start
    assert run.rc == 0, run.output
    print(f"\n16-host mesh: ansible-playbook playbooks/lab.yml took {elapsed:.1f} s")
    cabling = check_lab_matches_record(lab)
    assert len(cabling["cables"]) == 120
    assert set(ping_hosts(lab).values()) == {"SUCCESS"}
    assert len(ping_hosts(lab)) == 16


MACHINE_FILES = ("/etc/passwd", "/etc/shadow", "/etc/group", "/etc/gshadow", "/etc/sudoers")


def file_digests(paths) -> dict[str, str]:
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths if Path(p).exists()}


def test_sudo_access_logs_in_as_a_user_that_becomes_root(make_lab):
    before = file_digests(MACHINE_FILES)
    lab = make_lab(lab_size=2, lab_shape="line", lab_access="sudo")
    run = lab.up()
    assert run.rc == 0, run.output
    inventory = yaml.safe_load(lab.inventory.read_text())
    assert inventory["all"]["vars"]["ansible_user"] == "meshadmin"
    every_var = {**inventory["all"]["vars"], **{k: v for h in lab.hosts().values() for k, v in h.items()}}
    assert not [k for k in every_var if "become" in k]  # the plays ask for it, not the inventory
    # Without become: the login user, in an SSH session. With become (sudo): root, and sudo's
    # env_reset has dropped the SSH session's variables.
    plain = lab.ansible("-m", "ansible.builtin.shell", "-a", "id -un; echo ssh=${SSH_CONNECTION:-none}")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert plain.stdout.count("meshadmin") == 2 and plain.stdout.count("ssh=198.") == 2, plain.stdout
    become = lab.ansible("-b", "-m", "ansible.builtin.command", "-a", "id")
    assert become.returncode == 0, become.stdout + become.stderr
    assert become.stdout.count("uid=0(root)") == 2, become.stdout
    env = lab.ansible("-b", "-m", "ansible.builtin.command", "-a", "env", pattern="node1")
    assert env.returncode == 0 and "USER=root" in env.stdout, env.stdout
    assert "SSH_CONNECTION" not in env.stdout, env.stdout
    # Root cannot log in over SSH.
    ssh = ["ssh", "-F", str(lab.dir / "ssh_config")]
    root = sh(*ssh, "-l", "root", "node1", "id", check=False)
    assert root.returncode == 255 and "Permission denied" in root.stderr, root.stderr
    assert "(meshadmin)" in sh(*ssh, "node1", "id").stdout
    # Programs in the checkout (the shared filesystem) run as the login user.
    program = REPO / "tests" / "integration" / "programs" / "daemon_family.py"
    runs = lab.ansible("-m", "ansible.builtin.command", "-a", f"test -r {program} -a -x {REPO}", pattern="node2")
    assert runs.returncode == 0, runs.stdout + runs.stderr
    # Each host has its own home, passwd and sudoers; the machine's own files are untouched.
    mark = lab.ansible("-m", "ansible.builtin.shell", "-a", "touch ~/mark && ls -d /home/meshadmin", pattern="node1")
    assert mark.returncode == 0, mark.stdout
    look = lab.ansible("-m", "ansible.builtin.shell", "-a", "test -e ~/mark && echo has-mark || echo no-mark")
    assert "no-mark" in look.stdout and "has-mark" in look.stdout, look.stdout
    assert file_digests(MACHINE_FILES) == before
    assert "meshadmin" not in Path("/etc/passwd").read_text()
    # The faster connection logs in as the same user and becomes root the same way.
    fast = lab.ansible("-e", "ansible_connection=meshkit.cluster.netns", "-m", "ansible.builtin.command", "-a", "id")
    assert fast.stdout.count("uid=2000(meshadmin)") == 2, fast.stdout + fast.stderr
    fast_b = lab.ansible(
        "-e", "ansible_connection=meshkit.cluster.netns", "-b", "-m", "ansible.builtin.command", "-a", "id"
    )
    assert fast_b.stdout.count("uid=0(root)") == 2, fast_b.stdout + fast_b.stderr


def test_sudo_access_refuses_a_shared_path_the_user_cannot_reach(make_lab, tmp_path):
    # pytest's tmp_path lies under /tmp/pytest-of-root, mode 0700: the login user cannot enter it.
    python = tmp_path / "python3"
    python.symlink_to("/usr/bin/python3")
    lab = make_lab(lab_size=2, lab_shape="line", lab_access="sudo")
    run = lab.up(lab_host_python=str(python))
    assert run.rc != 0
    assert f"the hosts' login user meshadmin cannot read and enter {python}" in run.output, run.output
    assert "others cannot enter it" in run.output, run.output


def hosts_blocks(name: str) -> list[str]:
    text = Path("/etc/hosts").read_text()
    return re.findall(rf"^# BEGIN meshkit lab {name}\n(.*?)^# END meshkit lab {name}\n", text, re.M | re.S)


def test_names_resolve_on_the_controller_and_on_the_hosts(make_lab):
    first = make_lab(lab_size=3, lab_shape="ring", lab_names=True)
    second = make_lab(lab_size=2, lab_shape="line", lab_names=True)
    # A stale block of the first lab (a crashed run) is replaced, not duplicated.
    stale = [f"# BEGIN meshkit lab {first.name}", f"192.0.2.9\tnode1.{first.name}.meshkit.test"]
    with open("/etc/hosts", "a") as handle:  # under the lock the lab takes too
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write("\n".join([*stale, f"# END meshkit lab {first.name}", ""]))
    assert first.up().rc == 0
    assert second.up().rc == 0
    hosts = first.hosts()
    assert hosts["node1"]["ansible_host"] == f"node1.{first.name}.meshkit.test"
    assert len(hosts_blocks(first.name)) == 1
    block = hosts_blocks(first.name)[0]
    assert "192.0.2.9" not in block
    for i in (1, 2, 3):
        fqdn = f"node{i}.{first.name}.meshkit.test"
        ip = first.subnet.rsplit(".", 1)[0] + f".{i + 1}"
        assert f"{ip}\t{fqdn}" in block
        assert sh("getent", "hosts", fqdn).stdout.split()[0] == ip
    # On the hosts: every lab name, and the host's own short name on 127.0.1.1 as Debian has it.
    look = first.ansible(
        "-m", "ansible.builtin.shell",
        "-a", f"getent hosts node3.{first.name}.meshkit.test; getent hosts $(hostname); sudo -n true 2>&1 || true",
        pattern="node1",
    )  # fmt: skip
    assert look.returncode == 0, look.stdout + look.stderr
    answers = [line.split() for line in look.stdout.splitlines()[1:]]
    assert [first.subnet.rsplit(".", 1)[0] + ".4", f"node3.{first.name}.meshkit.test"] in answers, look.stdout
    assert ["127.0.1.1", "node1"] in answers, look.stdout
    assert "unable to resolve host" not in look.stdout
    # known_hosts entries are by name, checked against the generated keys (ssh by name works).
    known = (first.dir / "known_hosts").read_text().splitlines()
    assert sorted(line.split()[0] for line in known) == [f"node{i}.{first.name}.meshkit.test" for i in (1, 2, 3)]
    assert ping_hosts(first) == {"node1": "SUCCESS", "node2": "SUCCESS", "node3": "SUCCESS"}
    ssh = sh("ssh", "-F", str(first.dir / "ssh_config"), "node2", "hostname", check=False)
    assert ssh.stdout.strip() == "node2", ssh.stderr
    # Removing one lab removes its block only.
    assert first.down().rc == 0
    assert hosts_blocks(first.name) == []
    assert len(hosts_blocks(second.name)) == 1
    assert sh("getent", "hosts", f"node1.{first.name}.meshkit.test", check=False).returncode != 0


@pytest.fixture
def short_tmp():
    """A working directory with a short path: the lab keeps Ansible's ssh control sockets under it, and a
    Unix socket's path must fit 108 bytes (pytest's own temporary directories are too deep)."""
    path = Path(tempfile.mkdtemp(prefix="mk"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_meshkit_command_builds_converges_launches_and_removes_a_lab_outside_the_checkout(short_tmp):
    """`meshkit lab`, `meshkit setup`, `meshkit launch`, `meshkit lab --down` run from a directory that is
    not the checkout, with no ansible.cfg there: the lab's inventory and the artifacts go under it."""
    from .conftest import ENV, new_lab, release_subnet

    tmp_path = short_tmp

    handle = new_lab(lab_size=2, lab_shape="ring")
    env = {k: v for k, v in ENV.items() if k not in ("ANSIBLE_CONFIG", "ANSIBLE_HOME")}
    env["MESHKIT_LAUNCH_CACHE"] = str(tmp_path / "cache")
    meshkit = str(REPO / ".venv" / "bin" / "meshkit")
    names = ["-e", f"lab_name={handle.name}", "-e", f"lab_mgmt_subnet={handle.subnet}"]

    def run(*argv: str) -> str:
        proc = subprocess.run(
            [meshkit, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
            stdin=subprocess.DEVNULL, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    try:
        run("lab", *names, "-e", "lab_size=2", "-e", "lab_shape=ring")
        inventory = tmp_path / "inventory" / f"{handle.name}.yml"
        assert inventory.is_file() and (tmp_path / ".lab" / handle.name).is_dir()
        out = run("setup", "-i", str(inventory), "--diff")
        assert re.search(r"node2\s+:\s+ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", out), out
        artifacts = tmp_path / "artifacts" / f"lab-{handle.name}"
        assert (artifacts / "plan.json").is_file() and (artifacts / "hostfiles" / "manifest.json").is_file()
        again = run("setup", "-i", str(inventory), "--check")
        assert re.findall(r"changed=(\d+)", again) == ["0", "0"], again
        out = run("launch", "-i", str(inventory), "-r", "plain", "--no-stdin", "--", "hostname")
        assert "all 2 ranks exited 0" in out and str(artifacts / "launch") in out, out
    finally:
        run("lab", "--down", *names)
        release_subnet(handle.subnet)
    assert not [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(f"{handle.name}-")]


def host_links_now(ns: str) -> dict[str, tuple[int, str]]:
    """A host's interfaces: name -> (ifindex, MAC)."""
    return {link["ifname"]: (link["ifindex"], link.get("address", "")) for link in ip_json("-n", ns, "link", "show")}


def host_addrs_now(ns: str) -> dict[str, list[str]]:
    return {
        a["ifname"]: sorted(f"{i['local']}/{i['prefixlen']}" for i in a.get("addr_info", []))
        for a in ip_json("-n", ns, "addr", "show")
    }


def holders(lab) -> dict[str, int]:
    return json.loads((lab.dir / "state.json").read_text())["holders"]


def said(run) -> str:
    """A play's output on one line (the callback folds long messages)."""
    return " ".join(run.output.split())


def frames_cross(ends: list[tuple[str, str]], timeout: float = 30.0) -> dict[str, int]:
    """Wait until every (netns, port) has received frames (STP hellos, IPv6 neighbour discovery from
    its far end: link-layer traffic across the cable); the received counts, 0 where none came in time."""
    deadline = time.monotonic() + timeout
    while True:
        counts = {
            f"{ns}:{port}": ip_json("-s", "-n", ns, "link", "show", port)[0]["stats64"]["rx"]["packets"]
            for ns, port in ends
        }
        if all(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_a_running_lab_grows_is_recabled_and_shrinks_in_place(make_lab):
    """A 3-host ring grows to 4 (node4 between node3 and node1), a cable moves, node4 goes again:
    each time only what changed is touched, the hosts keep running, the new host answers over SSH,
    new cables carry frames; the same request again changes nothing; a host's bridge goes back to its
    factory state (lab_factory_network); nothing of the lab is left at the end."""
    lab = make_lab(lab_size=3, lab_shape="ring")
    assert lab.up().rc == 0
    ns = {name: h["meshkit_lab_netns"] for name, h in lab.hosts().items()}
    mark = lab.ansible("-m", "ansible.builtin.shell", "-a", "echo kept > /var/lib/meshkit/mark", pattern="node2")
    assert mark.returncode == 0, mark.stdout + mark.stderr
    links, addrs, pids = (
        {h: host_links_now(n) for h, n in ns.items()},
        {h: host_addrs_now(n) for h, n in ns.items()},
        holders(lab),
    )

    grown = "added node4; cables added node3:tb1-node4:tb0, node4:tb1-node1:tb1; removed node3:tb1-node1:tb1"
    check = lab.up("--check", "--diff", lab_size=4)
    assert check.rc == 0 and check.changed > 0, check.output
    assert f"changed in place: {grown}" in said(check), check.output
    assert lab_netns(lab) == sorted(ns.values())

    grow = lab.up(lab_size=4)
    assert grow.rc == 0, grow.output
    assert f"lab {lab.name} changed in place: {grown}" in said(grow), grow.output
    check_lab_matches_record(lab)
    assert ping_hosts(lab) == {f"node{i}": "SUCCESS" for i in range(1, 5)}
    # node2 untouched: every link, address and process as before; node1 and node3 too but the port
    # recabled, which has a new far end (a new veth).
    assert host_links_now(ns["node2"]) == links["node2"] and host_addrs_now(ns["node2"]) == addrs["node2"]
    for host in ("node1", "node3"):
        now = host_links_now(ns[host])
        assert {k: v for k, v in now.items() if k != "tb1"} == {k: v for k, v in links[host].items() if k != "tb1"}
        assert now["tb1"][1] != links[host]["tb1"][1], host
    assert {h: p for h, p in holders(lab).items() if h != "node4"} == pids
    assert (
        "kept"
        in lab.ansible("-m", "ansible.builtin.command", "-a", "cat /var/lib/meshkit/mark", pattern="node2").stdout
    )
    ns["node4"] = lab.hosts()["node4"]["meshkit_lab_netns"]
    new_ends = [(ns["node3"], "tb1"), (ns["node4"], "tb0"), (ns["node4"], "tb1"), (ns["node1"], "tb1")]
    assert all(frames_cross(new_ends).values()), frames_cross(new_ends, 0)
    assert settled_state(lab) == {}
    again = lab.up(lab_size=4)
    assert again.rc == 0 and again.changed == 0, again.output

    # node4's cable to node1 moves to node2 (its third port): one cable out, one in.
    links = {h: host_links_now(n) for h, n in ns.items()}
    moved = lab.up(lab_size=4, lab_cables=[[1, 2], [2, 3], [3, 4], [4, 2]])
    assert moved.rc == 0, moved.output
    assert "moved node4:tb1-node1:tb1 -> node4:tb1-node2:tb2" in said(moved), moved.output
    check_lab_matches_record(lab)
    assert host_links_now(ns["node3"]) == links["node3"]
    assert "tb1" not in host_links_now(ns["node1"])
    assert all(frames_cross([(ns["node4"], "tb1"), (ns["node2"], "tb2")]).values())

    # Back to the 3-host ring: node4 goes with its cables, and nothing of it is left.
    shrink = lab.up(lab_size=3, lab_cables=[])
    assert shrink.rc == 0, shrink.output
    assert "removed node4; cables added node3:tb1-node1:tb1;" in said(shrink), shrink.output
    check_lab_matches_record(lab)
    assert lab_netns(lab) == sorted(n for h, n in ns.items() if h != "node4")
    assert not [link for link in ip_json("link", "show") if link["ifname"] == f"{lab.name}-m4"]
    assert not (lab.dir / "hosts" / "node4").exists()
    assert len((lab.dir / "known_hosts").read_text().splitlines()) == 3
    assert not [p for p in lab.leftovers() if "node4" in p]
    assert holders(lab) == pids
    assert ping_hosts(lab) == {"node1": "SUCCESS", "node2": "SUCCESS", "node3": "SUCCESS"}

    # node2's ports taken out of bridge0 with an address (as setup.yml leaves them), then put back.
    sh("ip", "-n", ns["node2"], "link", "set", "tb0", "nomaster")
    sh("ip", "-n", ns["node2"], "addr", "add", "10.250.0.1/30", "dev", "tb0")
    back = lab.up(lab_factory_network="node2")
    assert back.rc == 0 and back.changed > 0, back.output
    assert "node2: cable ports back in bridge0" in said(back), back.output
    tb0 = ip_json("-n", ns["node2"], "addr", "show", "tb0")[0]
    assert tb0.get("master") == "bridge0" and "10.250.0.1" not in str(tb0["addr_info"])
    assert settled_state(lab) == {}
    same = lab.up(lab_factory_network="node2")
    assert same.rc == 0 and same.changed == 0, same.output

    assert lab.down().rc == 0
    assert lab.leftovers() == []
