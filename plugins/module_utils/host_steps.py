# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The work of meshkit's host modules as steps: each ``step(module) -> result`` reads
``module.params`` (its own options), fails through ``module.fail_json`` and returns its result
instead of exiting. Each single-purpose module (bridge_detach, discover, rdma_facts, peer_link,
cable_check, hostfiles) is one step; host_ports and host_network run several in one call on a
host: one round trip instead of one per step (issue 23). ``Step`` shows a step its own options
and turns its failure into ``StepFailed``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import time
from collections.abc import Callable
from typing import Any

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.meshkit.cluster.plugins.module_utils import (
    host_record,
    hostfiles,
    linux_net,
    linux_persist,
    macos,
    management,
    port_rules,
    rdma,
)
from ansible_collections.meshkit.cluster.plugins.module_utils.common import (
    MANAGEMENT_ARGS,
    apply,
    find_management_interface,
    run_parallel,
    runner,
)
from ansible_collections.meshkit.cluster.plugins.module_utils.defaults import MLX_STARTING_PORT


class StepFailed(Exception):
    """A step called fail_json: ``step`` names it, ``result`` holds fail_json's keyword arguments."""

    def __init__(self, step: str, result: dict[str, Any]):
        super().__init__(result.get("msg", ""))
        self.step = step
        self.result = result


class Step:
    """The module as one step sees it: its own options (validated against its argument spec,
    defaults filled in), fail_json raising StepFailed; everything else (check_mode, run_command,
    warn, get_bin_path) is the module's."""

    def __init__(self, module: Any, name: str, spec: dict[str, dict[str, Any]], params: dict[str, Any]):
        self._module = module
        self.name = name
        checked = ArgumentSpecValidator(spec).validate(dict(params))
        if checked.error_messages:
            raise StepFailed(name, {"msg": f"{name}: " + "; ".join(checked.error_messages)})
        self.params = checked.validated_parameters

    def fail_json(self, **result: Any):
        raise StepFailed(self.name, result)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._module, attr)


def merge_diffs(results: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The --diff of several steps as one list of diffs, each headed by its step."""
    out: list[dict[str, Any]] = []
    for name, result in results:
        diff = result.get("diff")
        for d in diff if isinstance(diff, list) else [diff] if diff else []:
            out.append({"before_header": name, "after_header": name, **d})
    return out


class Run:
    """One module call that runs several steps: ``out`` is what the module returns, ``step`` runs one
    step (``changes=True``: its changed flag and diff count for the call's)."""

    def __init__(self, module: Any):
        self.module = module
        self.out: dict[str, Any] = {"changed": False}
        self.done: list[tuple[str, dict[str, Any]]] = []

    def step(
        self,
        name: str,
        spec: dict[str, dict[str, Any]],
        params: dict[str, Any],
        work: Callable[[Any], dict[str, Any]],
        *,
        changes: bool = True,
    ) -> dict[str, Any]:
        result = work(Step(self.module, name, spec, params))
        if changes:
            self.done.append((name, result))
        return result

    @property
    def changed(self) -> bool:
        return any(result.get("changed") for _name, result in self.done)


def run_steps(module: Any, body: Callable[[Run], None]) -> None:
    """Run ``body``'s steps and exit the module: on a step's failure, fail_json with what the steps
    before it returned, whether they changed anything and the failed step's name (the steps after it do
    not run); else exit_json with ``changed`` and every changing step's diff, each headed by its step."""
    run = Run(module)
    try:
        body(run)
    except StepFailed as failed:
        module.fail_json(**{**run.out, **failed.result, "changed": run.changed, "step": failed.step})
    run.out["changed"] = run.changed
    diffs = merge_diffs(run.done)
    if diffs:
        run.out["diff"] = diffs
    module.exit_json(**run.out)


# ---- bridge_detach -------------------------------------------------------------------------------

# Options of the steps that change the network and keep (or read) the host's record (record.json).
UNDO_ARGS: dict[str, dict[str, Any]] = {
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "state_dir": {"type": "path"},
    "own_only": {"type": "bool", "default": False},
}

BRIDGE_ARGS: dict[str, dict[str, Any]] = {
    "bridge": {"type": "str", "default": "bridge0"},
    "peer_ports": {"type": "list", "elements": "str", "default": []},
    "service": {"type": "str", "default": "Thunderbolt Bridge"},
    "pool": {"type": "str"},
    **MANAGEMENT_ARGS,
    **linux_persist.PERSIST_ARGS,
    **UNDO_ARGS,
}


def file_diff(file_changes: list[dict[str, Any]]) -> tuple[str, str]:
    before = "".join(f"--- {c['path']}\n{c['before']}" for c in file_changes)
    after = "".join(f"+++ {c['path']}\n{c['after']}" for c in file_changes)
    return before, after


def found_linux(module: Any, run, state_dir: str | None) -> list[str]:
    """meshkit's own configuration already on a Linux host (before a record is taken: then the record
    cannot say what the host had before meshkit)."""
    found = host_record.networkd_own_files(module.params["networkd_dir"])
    if module.get_bin_path("nmcli"):
        with contextlib.suppress(RuntimeError):
            found += [f"NetworkManager profile {n}" for n in host_record.nm_own_profiles(run)]
    if state_dir and os.path.exists(os.path.join(state_dir, "hostfiles", "manifest.json")):
        found.append(os.path.join(state_dir, "hostfiles"))
    return found


def keep_record_darwin(module: Any, run, bridge: str, service: str, mgmt: str | None) -> dict[str, Any]:
    """Take the Mac's record before the step's first change, where it has none."""
    if not module.params["state_dir"]:
        return {"changed": False}

    def take() -> dict[str, Any]:
        return {"platform": "Darwin", "management_interface": mgmt, **macos.read_undo_record(run, bridge, service)}

    return host_record.ensure(module, module.params["state_dir"], take)


def keep_record(
    module: Any, run, manager: str | None, bridge: str | None, patterns: list[str], mgmt: str | None
) -> dict[str, Any]:
    """Take the host's record before the step's first change, where it has none (Linux)."""
    p = module.params
    if not p["state_dir"]:
        return {"changed": False}

    def take() -> dict[str, Any]:
        all_links = linux_net.links(run)
        nm = {}
        if manager == "networkmanager" and bridge:
            members = [link["ifname"] for link in all_links if link.get("master") == bridge]
            nm = host_record.nm_bridge_autoconnect(run, bridge, members)
        return host_record.linux_take(
            all_links,
            linux_net.addresses(run),
            patterns,
            mgmt,
            bridge,
            manager,
            found_linux(module, run, p["state_dir"]),
            nm,
        )

    return host_record.ensure(module, p["state_dir"], take)


def record_diff(kept: dict[str, Any]) -> tuple[str, str]:
    if not kept.get("changed"):
        return "", ""
    return f"--- {kept['path']}\n", f"+++ {kept['path']}\n" + json.dumps(
        kept["record"], indent=2, sort_keys=True
    ) + "\n"


def load_record(module: Any) -> dict[str, Any] | None:
    if not module.params["state_dir"]:
        module.fail_json(msg="state: absent needs state_dir, the directory that holds the host's record.json")
    try:
        return host_record.load(module.params["state_dir"])
    except host_record.RecordError as exc:
        module.fail_json(msg=str(exc))
    return None


def refuse_without_record(module: Any, record: dict[str, Any] | None, what: list[str], whose: str) -> None:
    """No trustworthy record: refuse to guess (say what undo would remove), unless own_only."""
    if host_record.trusted(record) or not what or module.params["own_only"]:
        return
    if record is None:
        why = f"this host has no {host_record.path(module.params['state_dir'])}"
    else:
        why = (
            f"{host_record.path(module.params['state_dir'])} was taken while meshkit's configuration was already "
            f"here ({', '.join(record.get('meshkit_found', []))})"
        )
    module.fail_json(
        msg=f"{whose}: no record of what this host had before setup.yml ({why}); refusing to guess what to restore. "
        f"With own_only, undo removes meshkit's own configuration only and restores nothing: {'; '.join(what)}. "
        f"See {host_record.RUNBOOK}. Nothing was changed",
        changed=False,
        would_remove=what,
    )


def bridge_detach(module: Any) -> dict[str, Any]:
    """Take the peer ports out of the Thunderbolt bridge and disable it (module bridge_detach); with
    state absent, put back what the host's record says it had (bridge_undo)."""
    p = module.params
    if p["state"] == "absent":
        return bridge_undo(module)
    run = runner(module)
    files = linux_persist.FileSet()
    kept: dict[str, Any] = {"changed": False}
    try:
        if platform.system() == "Darwin":
            state = macos.read_bridge_state(run, p["bridge"], p["service"])
            mgmt = find_management_interface(module, run, darwin=True)
            plan = macos.plan_bridge(state, p["bridge"], p["service"], mgmt)
            persistence = plan["persistence"]
            if not plan["refused"]:
                kept = keep_record_darwin(module, run, p["bridge"], p["service"], mgmt)
        else:
            all_links = linux_net.links(run)
            mgmt = find_management_interface(module, run, darwin=False)
            plan = linux_net.plan_bridge(all_links, p["bridge"], p["peer_ports"], mgmt)
            manager = linux_persist.module_manager(module, run)
            persistence = linux_persist.describe(manager)
            if not plan["refused"]:
                kept = keep_record(module, run, manager, p["bridge"], p["peer_ports"], mgmt)
            # Every peer port, detached now or in an earlier run, stays out of the bridge at boot.
            ports = sorted(
                set(plan["detach"])
                | {
                    link["ifname"]
                    for link in port_rules.candidate_ports(all_links, p["peer_ports"], mgmt)
                    if p["peer_ports"] and not link.get("master")
                }
            )
            if manager == "networkd" and not plan["refused"]:
                for port in ports:
                    path, content = linux_persist.networkd_port(p["networkd_dir"], port)
                    files.wanted[path] = content
                if p["bridge"] in {link["ifname"] for link in all_links} and not plan["kept"]:
                    # The bridge stays down at boot too, as it is left now.
                    path, content = linux_persist.networkd_bridge_down(p["networkd_dir"], p["bridge"])
                    files.wanted[path] = content
            elif manager == "networkmanager" and not plan["refused"]:
                plan["commands"] += linux_persist.nm_bridge_commands(run, ports, p["bridge"])
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    result = {
        "changed": bool(plan["commands"] or file_changes or kept["changed"]),
        "record": kept.get("path"),
        "members": plan["members"],
        "detached": plan["detach"],
        "kept": plan["kept"],
        "commands": plan["commands"],
        "management_interface": mgmt,
        "persistence": persistence,
        "notes": plan.get("notes", []),
        "files": [c["path"] for c in file_changes],
    }
    if plan["refused"]:
        module.fail_json(msg=plan["refused"], **{**result, "changed": False})
    if result["changed"]:
        before, after = record_diff(kept)
        if plan["commands"] or file_changes:
            before += f"{p['bridge']} members: {', '.join(plan['members']) or '(none)'}\n"
            after += (
                f"{p['bridge']} members: {', '.join(plan['kept']) or '(none)'}"
                + ("" if plan["kept"] else f"; {p['bridge']} disabled")
                + "\n"
            )
        files_before, files_after = file_diff(file_changes)
        result["diff"] = {"before": before + files_before, "after": after + files_after}
    apply(module, run, plan["commands"])
    linux_persist.module_write(module, run, files, file_changes)
    if platform.system() != "Darwin" and not module.check_mode and (plan["commands"] or file_changes):
        # A port out of the bridge gets its own IPv6 link-local address a moment later (networkd reconfiguring
        # it, then duplicate-address detection). Return once it has: a peer probing it in the next task must
        # find it answering, or that cable is seen from one end only and left out of the plan.
        wait_for_link_local(run, [link["ifname"] for link in linux_net.links(run) if ready_to_answer(link, ports)], 10)
    return result


def ready_to_answer(link: dict[str, Any], ports: list[str]) -> bool:
    """Whether one of ``ports`` is out of any bridge and has carrier: it will get a link-local address."""
    return link["ifname"] in ports and not link.get("master") and port_rules.has_carrier(link)


def bridge_undo(module: Any) -> dict[str, Any]:
    """Put the peer ports back into the bridge they were in, as the host's record says, with the IPv6
    address generation, link-local addresses and up/down state they had; remove meshkit's persistent
    bridge configuration (networkd files, NetworkManager profiles); then the record itself (module
    bridge_detach, state absent). The cables' addresses must be gone first (peer_link, state absent)."""
    p = module.params
    run = runner(module)
    record = load_record(module)
    files = linux_persist.FileSet()
    commands: list[list[str]] = []
    notes: list[str] = []
    try:
        if platform.system() == "Darwin":
            return bridge_undo_darwin(module, run, record)
        all_links = linux_net.links(run)
        addrs = linux_net.addresses(run)
        mgmt = find_management_interface(module, run, darwin=False)
        left = host_record.pool_addresses(all_links, addrs, p["pool"], mgmt)
        if left:
            cables_first(
                module,
                notes,
                "the cables' addresses are still on "
                + ", ".join(f"{port} ({', '.join(a)})" for port, a in sorted(left.items())),
            )
        manager = linux_persist.module_manager(module, run)
        nm_own = host_record.nm_own_profiles(run) if module.get_bin_path("nmcli") else []
        own = host_record.networkd_own_files(p["networkd_dir"])
        refuse_without_record(
            module, record, host_record.linux_own_configuration(p["networkd_dir"], nm_own), "discovery undo"
        )
        if host_record.trusted(record):
            plan = host_record.plan_bridge_undo(all_links, addrs, record or {}, mgmt)
            if plan["refused"]:
                module.fail_json(msg=plan["refused"], changed=False)
            commands = plan["commands"]
            notes += plan["notes"]
        elif own or nm_own:
            notes.append("own_only: meshkit's configuration removed; the peer ports stay as they are now")
        for path in own:
            files.wanted[path] = None
        if nm_own or (manager == "networkmanager" and host_record.trusted(record)):
            commands += host_record.nm_undo_commands(run, record if host_record.trusted(record) else None)
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    gone = host_record.leftovers(p["state_dir"], record)
    result: dict[str, Any] = {
        "changed": bool(commands or file_changes or gone),
        "commands": commands,
        "notes": notes,
        "files": [c["path"] for c in file_changes],
        "removed": gone,
        "management_interface": mgmt,
    }
    if result["changed"]:
        before, after = file_diff(file_changes)
        before += "".join(f"--- {g}\n" for g in gone)
        after = "".join(" ".join(c) + "\n" for c in commands) + after
        result["diff"] = {"before": before, "after": after}
    apply(module, run, commands)
    linux_persist.module_write(module, run, files, file_changes)
    if not module.check_mode:
        host_record.remove(gone)
    return result


def cables_first(module: Any, notes: list[str], what: str) -> None:
    """The bridge's undo waits for the cables' (peer_link, state absent): refuse while their configuration is
    still there. In check mode, where the cables' undo before it in the same play only said what it would
    do, note it instead."""
    if module.check_mode:
        notes.append(f"{what}: a real run refuses unless the peer_network role's undo runs first (teardown.yml does)")
        return
    module.fail_json(
        msg=f"{what}: take them off first (the peer_network role with state absent), then put the ports back into "
        "the bridge. Nothing was changed",
        changed=False,
    )


def bridge_undo_darwin(module: Any, run, record: dict[str, Any] | None) -> dict[str, Any]:
    """bridge_undo on a Mac: bridge0's members, its saved member list and its service back as recorded
    (macos.plan_bridge_undo), then the record. The cables' services and routes must be gone first."""
    p = module.params
    mgmt = find_management_interface(module, run, darwin=True)
    commands: list[list[str]] = []
    notes: list[str] = []
    left = macos.meshkit_present(run, p["pool"]) if p["pool"] else []
    if left:
        cables_first(module, notes, f"meshkit's cable configuration is still here ({'; '.join(left)})")
    if host_record.trusted(record):
        plan = macos.plan_bridge_undo(run, record, p["bridge"], p["service"], mgmt)
        if plan["refused"]:
            module.fail_json(msg=plan["refused"], changed=False)
        commands = plan["commands"]
        notes += plan["notes"]
    elif record is not None:
        # Nothing of meshkit's own is on a Mac's bridge side: without a usable record nothing is restored,
        # and nothing guessed.
        notes.append(
            f"{host_record.path(p['state_dir'])} was taken while meshkit's configuration was already here: "
            f"{p['bridge']} was not restored; see {host_record.RUNBOOK}"
        )
    gone = host_record.leftovers(p["state_dir"], record)
    result: dict[str, Any] = {
        "changed": bool(commands or gone),
        "commands": commands,
        "notes": notes,
        "files": [],
        "removed": gone,
        "management_interface": mgmt,
    }
    if result["changed"]:
        result["diff"] = {
            "before": "".join(f"--- {g}\n" for g in gone),
            "after": "".join(" ".join(c) + "\n" for c in commands),
        }
    apply(module, run, commands)
    if not module.check_mode:
        host_record.remove(gone)
    return result


# ---- management ----------------------------------------------------------------------------------

ESTABLISH_ARGS: dict[str, dict[str, Any]] = {
    "host": {"type": "str"},
    "address": {"type": "str"},
    "controller_addresses": {"type": "list", "elements": "str", "default": []},
    "interface": {"type": "str"},
    "bridge": {"type": "str"},
    "pool": {"type": "str"},
    "peer_ports": {"type": "list", "elements": "str", "default": []},
}


def establish(module: Any) -> dict[str, Any]:
    """Which interface carries the management connection, or a refusal (module management);
    changes nothing."""
    system = platform.system()
    try:
        result = management.establish(module.params, runner(module), system, management.system_resolve)
    except (management.ManagementError, ValueError) as exc:
        module.fail_json(msg=str(exc), platform=system)
    if result.pop("failed", False):
        module.fail_json(platform=system, **result)
    return {"changed": False, "platform": system, **result}


# ---- discover ------------------------------------------------------------------------------------

DISCOVER_ARGS: dict[str, dict[str, Any]] = {
    "peer_ports": {"type": "list", "elements": "str", "required": True},
    **MANAGEMENT_ARGS,
    "probe_seconds": {"type": "int", "default": 1},
}

# A reply in ping's output: "64 bytes from fe80::1c2:3ff:fe04:506%tb1: icmp_seq=1 ttl=64 time=0.07 ms".
REPLY = re.compile(r"\bfrom (fe80:[0-9a-fA-F:]+)%([^:\s]+):")


def probe_linux(module: Any, ports: list[str], seconds: int) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Find who answers on every port (all at once), then resolve each answerer's MAC ourselves.

    First an IPv6 all-nodes ping bound to the port: its replies name the link-local address at the
    other end. Then one unicast ping to that address, so this host asks for the peer's MAC itself
    (neighbour solicitation and advertisement) and its neighbour table holds it whatever state the
    table was in: a reboot or a cable taken out empties it, and the peer may answer the multicast
    ping from a cache of its own without asking anything. One echo each, no interval: iputils ping
    refuses multicast intervals under 1 s to users other than root, and discovery runs as the login
    user. A port with no answer is asked once more (a single lost echo). Returns what went wrong
    per port (ping's own error), for ports that could not be probed at all, and per port the
    link-local addresses that answered."""
    errors: dict[str, str] = {}
    answering: dict[str, set[str]] = {port: set() for port in ports}
    silent = list(ports)
    for _round in range(2):
        # Each ping at once (a killed one, past its own deadline, reads as not sent).
        runs = run_parallel(
            module,
            {port: ["ping", "-6", "-n", "-L", "-c", "1", "-w", str(seconds), "-I", port, "ff02::1"] for port in silent},
            timeout=seconds + 5,
        )
        for port, (rc, out, err) in runs.items():
            for address, dev in REPLY.findall(out):
                if dev == port:
                    answering[port].add(address)
            if rc not in (0, 1):  # 1: sent, nothing came back; 2 and more: not sent
                errors[port] = (err.strip().splitlines() or [f"ping exit {rc}"])[-1]
        silent = [port for port in silent if not answering[port] and port not in errors]
        if not silent:
            break
    run_parallel(
        module,
        {
            f"{address}%{port}": ["ping", "-6", "-n", "-c", "1", "-w", str(seconds), f"{address}%{port}"]
            for port, addresses in answering.items()
            for address in sorted(addresses)
        },
        timeout=seconds + 5,
    )
    return errors, answering


def wait_for_link_local(run, names: list[str], seconds: float) -> list[str]:
    """Wait until every port in names has a usable IPv6 link-local address (duplicate-address
    detection done: the probe's source); the ports still without one at the deadline. A port that
    has just left a bridge (networkd reconfiguring it) gets its address a second or two later."""
    deadline = time.monotonic() + seconds
    while True:
        ready = {
            a["ifname"]
            for a in linux_net.addresses(run)
            if any(
                i.get("family") == "inet6" and i.get("scope") == "link" and not i.get("tentative")
                for i in a.get("addr_info", [])
            )
        }
        waiting = [n for n in names if n not in ready]
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(0.1)


def discover_linux(module: Any, run, params: dict) -> tuple[list[dict], str | None]:
    all_links = linux_net.links(run)
    mgmt = find_management_interface(module, run, darwin=False)
    candidates = port_rules.candidate_ports(all_links, params["peer_ports"], mgmt)
    probe = [p for p in candidates if not p.get("master") and "UP" in p.get("flags", [])]
    errors: dict[str, str] = {}
    answering: dict[str, set[str]] = {}
    if probe:
        # Only ports with carrier will get a link-local address; an unplugged one is not waited for
        # (nor is its probe's failure news: it has no cable).
        carrier = [p["ifname"] for p in probe if port_rules.has_carrier(p)]
        wait_for_link_local(run, carrier, 10)
        errors, answering = probe_linux(module, carrier, params["probe_seconds"])
    for port, why in sorted(errors.items()):
        module.warn(f"{port}: the probe could not run ({why}); what is cabled to it is not known")
    neigh = linux_net.neighbours(run)
    own_macs = {link.get("address", "").lower() for link in all_links}
    ports = []
    for link in candidates:
        name = link["ifname"]
        # On a probed port, only the neighbours that answered this probe: the table may still hold hosts the
        # port reached before (a cable moved, or a new host's bridge that joined two ports for a while).
        answered = answering.get(name)
        seen = sorted(
            {
                n["lladdr"].lower()
                for n in neigh
                if n.get("dev") == name
                and n.get("lladdr")
                and n["lladdr"].lower() not in own_macs
                and (answered is None or n.get("dst") in answered)
            }
        )
        speed = None
        try:
            with open(f"/sys/class/net/{name}/speed") as handle:
                value = int(handle.read().strip())
                speed = f"{value} Mb/s" if value > 0 else None
        except (OSError, ValueError):
            pass
        thunderbolt = linux_net.thunderbolt_peer("/sys", name)
        if thunderbolt and thunderbolt["speed"]:
            speed = thunderbolt["speed"]
        ports.append(
            {
                "port": name,
                "ident": link.get("address", "").lower(),
                "seen": seen if not link.get("master") else [],
                "in_bridge": link.get("master"),
                "up": "UP" in link.get("flags", []),
                "speed": speed,
                "mtu": link.get("mtu"),
                "rdma": None,
                "generation": macos.thunderbolt_generation(thunderbolt["speed"]) if thunderbolt else None,
                "thunderbolt": thunderbolt,
                "probe_error": errors.get(name),
            }
        )
    return ports, mgmt


def discover(module: Any) -> dict[str, Any]:
    """Which port is cabled to which host, as this host sees it (module discover); changes nothing."""
    run = runner(module)
    system = platform.system()
    try:
        if system == "Darwin":
            ports = macos.discover(run)
            mgmt = find_management_interface(module, run, darwin=True)
            ports = [p for p in ports if p["port"] != mgmt]
        else:
            ports, mgmt = discover_linux(module, run, module.params)
    except (linux_net.NetError, macos.MacError, ValueError) as exc:
        module.fail_json(msg=str(exc))
    return {"changed": False, "ports": ports, "platform": system, "management_interface": mgmt}


# ---- rdma_facts ----------------------------------------------------------------------------------

RDMA_ARGS: dict[str, dict[str, Any]] = {
    "ports": {"type": "list", "elements": "str", "default": []},
    "generations": {"type": "dict", "default": {}},
    "require": {"type": "bool", "default": False},
    "backend": {"type": "str", "default": ""},
    "system": {"type": "str", "default": "auto", "choices": ["auto", "Linux", "Darwin"]},
    "sysfs_root": {"type": "path", "default": "/sys"},
    "rdma_ctl": {"type": "str", "default": "rdma_ctl"},
    "ibv_devices": {"type": "str", "default": "ibv_devices"},
    "ibv_devinfo": {"type": "str", "default": "ibv_devinfo"},
    "system_profiler": {"type": "str", "default": "system_profiler"},
    "networksetup": {"type": "str", "default": "networksetup"},
    "ifconfig": {"type": "str", "default": "ifconfig"},
}


def tool(module: Any, name: str) -> str | None:
    """A command's path: ``name`` itself when it holds a slash (None when that is no executable), else PATH's."""
    if "/" in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return module.get_bin_path(name)


def darwin_facts(module: Any, run) -> dict:
    p = module.params
    tools = {}
    for key in ("rdma_ctl", "ibv_devices", "ibv_devinfo"):
        tools[key] = tool(module, p[key])
        if not tools[key]:
            return rdma.host_facts("Darwin", [], p["ports"], tool_missing=p[key], generations=p["generations"])
    rc, out, err = run([tools["rdma_ctl"], "status"])
    enabled = rdma.parse_rdma_ctl(out + err)
    rc, out, _err = run([tools["ibv_devices"]])
    devices = rdma.parse_ibv_devices(out) if rc == 0 else []
    ports = []
    if devices:
        rc, out, err = run([tools["ibv_devinfo"], "-v"])
        if rc != 0:
            module.fail_json(msg=f"{tools['ibv_devinfo']} -v failed (rc={rc}): {err.strip()}")
        ports = rdma.parse_ibv_devinfo(out)
    notes = []
    links = None
    profiler, networksetup = tool(module, p["system_profiler"]), tool(module, p["networksetup"])
    if profiler and networksetup:
        named = {"system_profiler": profiler, "networksetup": networksetup}

        def through(argv: list[str]) -> tuple[int, str, str]:
            return run([named.get(argv[0], argv[0]), *argv[1:]])

        try:
            links = macos.read_thunderbolt_links(through)
        except (macos.MacError, ValueError) as exc:
            notes.append(f"link speeds not read ({exc}); a Thunderbolt 4 link is only told by discovery's generation")
    else:
        notes.append("system_profiler or networksetup not found: link speeds not read")
    bridges = None
    ifconfig = tool(module, p["ifconfig"])
    if ifconfig:
        rc, out, err = run([ifconfig, "-a"])
        if rc == 0:
            bridges = macos.parse_ifconfig_bridges(out)
        else:
            notes.append(f"{ifconfig} -a failed (rc={rc}): {err.strip()}; bridge members not checked")
    else:
        notes.append("ifconfig not found: bridge members not checked")
    return rdma.host_facts(
        "Darwin",
        ports,
        p["ports"],
        enabled,
        devices,
        generations=p["generations"],
        links=links,
        bridges=bridges,
        notes=notes,
    )


def rdma_facts(module: Any) -> dict[str, Any]:
    """RDMA devices, port state, IPv4 GID, link speed and bridge members (module rdma_facts); fails
    only where ``require`` is set and this host cannot carry RDMA on every cable."""
    p = module.params
    system = platform.system() if p["system"] == "auto" else p["system"]
    if system == "Darwin":
        facts = darwin_facts(module, runner(module))
    else:
        facts = rdma.host_facts("Linux", rdma.read_sysfs(p["sysfs_root"]), p["ports"])
    result = {"changed": False, "rdma": facts, "ansible_facts": {"meshkit_rdma": facts}}
    if p["require"] and not facts["usable"]:
        what = f"backend {p['backend']}" if p["backend"] else "this run"
        reasons = "; ".join(facts["problems"]) or facts["message"] or "no cabled port"
        module.fail_json(
            msg=f"{what} needs RDMA on every cable, and this host cannot: {reasons}. "
            f"Fix: see {' and '.join(facts['runbooks']) or facts['runbook']}",
            **result,
        )
    return result


# ---- peer_link -----------------------------------------------------------------------------------

LINK_ARGS: dict[str, dict[str, Any]] = {
    "ports": {"type": "list", "elements": "dict"},
    "pool": {"type": "str", "required": True},
    "peer_ports": {"type": "list", "elements": "str", "default": []},
    "mtu": {"type": "int"},
    "bridge": {"type": "str"},
    **MANAGEMENT_ARGS,
    **linux_persist.PERSIST_ARGS,
    **UNDO_ARGS,
}


def peer_link(module: Any) -> dict[str, Any]:
    """Give every cable end its address, host route and MTU (module peer_link); with state absent, take
    them off again (links_undo)."""
    p = module.params
    if p["state"] == "absent":
        return links_undo(module)
    if p["ports"] is None:
        module.fail_json(msg="ports is required with state present: this host's entries of the plan (per_host)")
    run = runner(module)
    notes: list[str] = []
    files = linux_persist.FileSet()
    kept: dict[str, Any] = {"changed": False}
    persistence = "network services set with networksetup persist across reboots"
    try:
        if platform.system() == "Darwin":
            mgmt = find_management_interface(module, run, darwin=True)
            plan = macos.plan_peer_links(run, p["ports"], p["mtu"], mgmt)
            if plan["refused"]:
                module.fail_json(msg=plan["refused"], changed=False, commands=[])
            kept = keep_record_darwin(module, run, p["bridge"] or "bridge0", BRIDGE_ARGS["service"]["default"], mgmt)
            commands, notes, persistence = plan["commands"], plan["notes"], plan["persistence"]
        else:
            all_links = linux_net.links(run)
            addrs = linux_net.addresses(run)
            mgmt = find_management_interface(module, run, darwin=False)
            manager = linux_persist.module_manager(module, run)
            planned = [x["port"] for x in p["ports"] if x.get("port")]
            kept = keep_record(module, run, manager, p["bridge"], [*p["peer_ports"], *planned], mgmt)
            commands, notes = linux_net.plan_peer_links(
                all_links,
                addrs,
                p["ports"],
                p["pool"],
                p["peer_ports"],
                p["mtu"],
                mgmt,
                linux_net.routes_by_device(run),
            )
            persistence = linux_persist.describe(manager)
            if manager == "networkd":
                for port in p["ports"]:
                    path, content = linux_persist.networkd_address(p["networkd_dir"], port, p["mtu"])
                    files.wanted[path] = content
                for stale in linux_persist.networkd_stale_dropins(p["networkd_dir"], {x["port"] for x in p["ports"]}):
                    files.wanted[stale] = None
            elif manager == "networkmanager":
                commands += linux_persist.nm_address_commands(run, p["ports"], p["mtu"])
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    result = {
        "changed": bool(commands or file_changes or kept["changed"]),
        "record": kept.get("path"),
        "commands": commands,
        "notes": notes,
        "persistence": persistence,
        "files": [c["path"] for c in file_changes],
    }
    if result["changed"]:
        before, after = record_diff(kept)
        files_before, files_after = file_diff(file_changes)
        after += "".join(" ".join(c) + "\n" for c in commands)
        result["diff"] = {"before": before + files_before, "after": after + files_after}
    apply(module, run, commands)
    linux_persist.module_write(module, run, files, file_changes)
    return result


def links_undo(module: Any) -> dict[str, Any]:
    """Take the cables' addresses (the pool's) and host routes off the peer ports, give each port back
    the MTU and up/down state the host's record holds, remove meshkit's address drop-ins (networkd) or
    profile addresses (NetworkManager) (module peer_link, state absent). The record stays: the bridge's
    undo (bridge_detach, state absent) reads it and removes it last."""
    p = module.params
    run = runner(module)
    record = load_record(module)
    files = linux_persist.FileSet()
    commands: list[list[str]] = []
    try:
        if platform.system() == "Darwin":
            mgmt = find_management_interface(module, run, darwin=True)
            refuse_without_record(module, record, macos.meshkit_present(run, p["pool"]), "peer_network undo")
            plan = macos.plan_links_undo(run, record if host_record.trusted(record) else None, p["pool"], mgmt)
            if plan["refused"]:
                module.fail_json(msg=plan["refused"], changed=False)
            result = {"changed": bool(plan["commands"]), "commands": plan["commands"], "notes": plan["notes"]}
            if plan["commands"]:
                result["diff"] = {"before": "", "after": "".join(" ".join(c) + "\n" for c in plan["commands"])}
            apply(module, run, plan["commands"])
            return result
        all_links = linux_net.links(run)
        addrs = linux_net.addresses(run)
        mgmt = find_management_interface(module, run, darwin=False)
        owned = host_record.pool_addresses(all_links, addrs, p["pool"], mgmt)
        dropins = [f for f in host_record.networkd_own_files(p["networkd_dir"]) if f.endswith(".conf")]
        nm_own = host_record.nm_own_profiles(run) if module.get_bin_path("nmcli") else []
        what = [f"{port}: {', '.join(a)}" for port, a in sorted(owned.items())] + dropins
        refuse_without_record(module, record, what, "peer_network undo")
        plan = host_record.plan_links_undo(all_links, addrs, linux_net.routes_by_device(run), record, p["pool"], mgmt)
        if plan["refused"]:
            module.fail_json(msg=plan["refused"], changed=False)
        commands = plan["commands"]
        for path in dropins:
            files.wanted[path] = None
        for name in nm_own:
            have = linux_persist.nm_settings(run, name, ["ipv4.method"])
            if have.get("ipv4.method") not in (None, "", "disabled"):
                unset = ["ipv4.method", "disabled", "ipv4.addresses", "", "ipv4.routes", ""]
                commands.append(["nmcli", "connection", "modify", name, *unset])
    except (linux_net.NetError, macos.MacError, RuntimeError) as exc:
        module.fail_json(msg=str(exc))
    file_changes = files.changes()
    result: dict[str, Any] = {
        "changed": bool(commands or file_changes),
        "commands": commands,
        "notes": plan["notes"],
        "files": [c["path"] for c in file_changes],
        "removed_addresses": owned,
    }
    if result["changed"]:
        before, after = file_diff(file_changes)
        after = "".join(" ".join(c) + "\n" for c in commands) + after
        result["diff"] = {"before": before, "after": after}
    apply(module, run, commands)
    linux_persist.module_write(module, run, files, file_changes)
    return result


# ---- cable_check ---------------------------------------------------------------------------------

PING_ARGS: dict[str, dict[str, Any]] = {
    "ports": {"type": "list", "elements": "dict", "required": True},
    "count": {"type": "int", "default": 3},
    "fail": {"type": "bool", "default": True},
    "host": {"type": "str", "default": "this host"},
}


def ping_argv(system: str, port: str, peer: str, count: int) -> list[str]:
    if system == "Darwin":
        return ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-t", "3", "-b", port, peer]
    return ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-w", "3", "-I", port, peer]


def cable_check(module: Any) -> dict[str, Any]:
    """Ping across every cable from this end, bound to its port (module cable_check)."""
    p = module.params
    system = platform.system()
    # Every cable's ping at once: a dead cable costs its deadline (3 s), not one per cable.
    runs = run_parallel(
        module,
        {i: ping_argv(system, port["port"], port["peer_address"], p["count"]) for i, port in enumerate(p["ports"])},
        timeout=30,
    )
    cables, dead, dead_ends = [], [], []
    for i, port in enumerate(p["ports"]):
        alive = runs[i][0] == 0
        cables.append(
            {
                "port": port["port"],
                "peer": f"{port['peer_host']}:{port['peer_port']}",
                "peer_address": port["peer_address"],
                "alive": alive,
            }
        )
        if not alive:
            dead_ends.append(f"{p['host']}:{port['port']}")
            dead.append(
                f"{p['host']}:{port['port']} -> {port['peer_host']}:{port['peer_port']} "
                f"({port['peer_address']}): no reply"
            )
    if dead and p["fail"] and not module.check_mode:
        module.fail_json(msg="dead cable(s): " + "; ".join(dead), cables=cables, dead=dead, dead_ends=dead_ends)
    return {"changed": False, "cables": cables, "dead": dead, "dead_ends": dead_ends}


# ---- hostfiles -----------------------------------------------------------------------------------

HOSTFILES_ARGS: dict[str, dict[str, Any]] = {
    "plan": {"type": "dict", "required": True},
    "dest": {"type": "path", "required": True},
    "host": {"type": "str"},
    "ssh": {"type": "dict", "default": {}},
    "nccl": {"type": "dict", "default": {}},
    "gloo": {"type": "dict", "default": {}},
    "cluster": {"type": "str", "required": True},
    "ranks_per_host": {"type": "int", "default": 1},
    "master_port": {"type": "int", "required": True},
    "meshccl_port": {"type": "int", "required": True},
    "mlx_starting_port": {"type": "int", "default": MLX_STARTING_PORT},
    "envs": {"type": "list", "elements": "str", "default": []},
    "state": {"type": "str", "default": "present", "choices": ["present", "verify"]},
}


def read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def write_hostfiles(module: Any) -> dict[str, Any]:
    """Write (or verify) every hostfile format from the plan (module hostfiles)."""
    p = module.params
    if p["ranks_per_host"] < 1:
        module.fail_json(msg=f"ranks_per_host must be 1 or more, not {p['ranks_per_host']}")
    if p["host"] and p["host"] not in p["plan"].get("hosts", []):
        module.fail_json(msg=f"host {p['host']} is not in the plan (hosts: {', '.join(p['plan'].get('hosts', []))})")
    files, skipped = hostfiles.render(
        p["plan"],
        {k: str(v) for k, v in p["ssh"].items()},
        p["nccl"],
        p["cluster"],
        p["ranks_per_host"],
        p["master_port"],
        p["meshccl_port"],
        p["mlx_starting_port"],
        p["envs"],
        p["host"],
        {k: str(v) for k, v in p["gloo"].items() if v},
    )
    fp = hostfiles.fingerprint(p["plan"])
    dest = p["dest"]
    on_disk = {name: read(os.path.join(dest, name)) for name in files}
    existing = {name: text for name, text in on_disk.items() if text is not None}
    stale = hostfiles.staleness(on_disk.get("manifest.json"), existing, fp) or ""
    out = []
    diffs = []
    for name, text in files.items():
        path = os.path.join(dest, name)
        changed = on_disk[name] != text
        out.append({"name": name, "path": path, "changed": changed})
        if changed:
            diffs.append({"before": on_disk[name] or "", "after": text, "before_header": path, "after_header": path})
    # Files an older set had and this one has not (e.g. MLX files once the ring is gone).
    try:
        listed = json.loads(on_disk.get("manifest.json") or "{}").get("files") or {}
    except ValueError:
        listed = {}
    leftovers = sorted(n for n in listed if n not in files and os.path.exists(os.path.join(dest, n)))
    for name in leftovers:
        out.append({"name": name, "path": os.path.join(dest, name), "changed": True, "removed": True})
    changed_names = [f["name"] for f in out if f["changed"]]
    result = {"fingerprint": fp, "files": out, "skipped": skipped, "stale": stale, "dest": dest}
    if p["state"] == "verify":
        if stale or changed_names:
            why = stale or ("missing or different: " + ", ".join(changed_names))
            module.fail_json(
                msg=f"hostfiles in {dest} are not current: {why}. Run setup.yml to rewrite them",
                changed=False,
                **result,
            )
        return {"changed": False, **result}
    if changed_names and not module.check_mode:
        # manifest.json last: a set interrupted half-way reads as stale, never as current.
        for name in leftovers:
            os.remove(os.path.join(dest, name))
        for name in sorted(set(changed_names) - set(leftovers), key=lambda n: n == "manifest.json"):
            path = os.path.join(dest, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as handle:
                handle.write(files[name])
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    return {"changed": bool(changed_names), "diff": diffs, **result}


# ---- a directory ---------------------------------------------------------------------------------

DIRECTORY_ARGS: dict[str, dict[str, Any]] = {
    "path": {"type": "path", "required": True},
    "mode": {"type": "raw"},
    "owner": {"type": "str", "default": "root"},
    "state": {"type": "str", "default": "directory", "choices": ["directory", "absent"]},
}


def directory(module: Any) -> dict[str, Any]:
    """A directory at ``path`` with ``mode`` (octal string or int) owned by ``owner`` (as
    ansible.builtin.file state=directory does it, parents made 0755); state absent: no such directory
    (removed with everything in it)."""
    import pwd
    import shutil

    p = module.params
    path = p["path"]
    if p["state"] == "absent":
        exists = os.path.lexists(path)
        if exists and not module.check_mode:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        result = {"changed": exists, "path": path, "state": "absent"}
        if exists:
            result["diff"] = {"before": f"{path}: present\n", "after": f"{path}: absent\n"}
        return result
    if p["mode"] is None:
        module.fail_json(msg=f"{path}: mode is required with state directory")
    mode = int(p["mode"], 8) if isinstance(p["mode"], str) else int(p["mode"])
    try:
        uid = pwd.getpwnam(p["owner"]).pw_uid
    except KeyError:
        module.fail_json(msg=f"{path}: owner {p['owner']} is not a user of this host")
    try:
        st = os.stat(path)
        before = {"path": path, "state": "directory", "mode": f"{st.st_mode & 0o7777:04o}", "owner_uid": st.st_uid}
    except FileNotFoundError:
        before = {"path": path, "state": "absent"}
    else:
        if not os.path.isdir(path):
            module.fail_json(msg=f"{path} exists and is not a directory")
    after = {"path": path, "state": "directory", "mode": f"{mode:04o}", "owner_uid": uid}
    changed = before != after
    if changed and not module.check_mode:
        os.makedirs(path, mode=0o755, exist_ok=True)
        os.chown(path, uid, -1)
        os.chmod(path, mode)
    result: dict[str, Any] = {"changed": changed, "path": path, "mode": after["mode"]}
    if changed:
        result["diff"] = {
            "before": json.dumps(before, sort_keys=True) + "\n",
            "after": json.dumps(after, sort_keys=True) + "\n",
            "before_header": path,
            "after_header": path,
        }
    return result
