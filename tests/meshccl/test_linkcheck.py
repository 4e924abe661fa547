"""meshccl.linkcheck (the worker of `meshkit check`) as real jobs on this machine.

Every "host" is a process; cables are loopback addresses (127.64.0.0/24, as in test_jobs.py), so
each cable's pair communicator and its UDP loss probes really run between that cable's two
addresses and nowhere else. The tests check what the controller relies on (the records and their
shapes, one per cable, figures present and sane); they never judge speed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from . import helpers as h

PREFIX = "MESHKIT-CHECK "
MESH4 = [(a, b) for a in range(1, 5) for b in range(a + 1, 5)]
RING4 = [(1, 3), (3, 2), (2, 4), (4, 1)]
RING3_DOUBLED = [(1, 2), (2, 3), (3, 1), (1, 2)]
FAST = ("--seconds", "0.05")
FULL_PHASES = ["connect", "latency", "alone", "load", "loss", "allreduce"]
MIB = 1 << 20


def hostfile(tmp: Path, pairs: list[tuple[int, int]], hosts: int, edit: Callable[[dict], None] | None = None) -> Path:
    """meshkit's meshccl.json for one rank per host; every rank's port (the world's) and the port
    above it (the cables' pair communicators) checked free on loopback."""
    path = h.meshccl_hostfile(tmp, pairs, hosts)
    data = json.loads(path.read_text())
    base = h.free_port_block(2)
    for rank in data["ranks"]:
        rank["port"] = base
    if edit is not None:
        edit(data)
    path.write_text(json.dumps(data))
    return path


class Rank:
    """One rank's run: exit status, its MESHKIT-CHECK records in order, its stderr."""

    def __init__(self, rank: int, code: int, out: str, err: str) -> None:
        self.rank, self.code, self.err = rank, code, err
        self.records = [json.loads(line[len(PREFIX) :]) for line in out.splitlines() if line.startswith(PREFIX)]
        self.out = out

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["t"] == kind]

    def __repr__(self) -> str:
        return f"rank {self.rank}: exit {self.code}\nstdout:\n{self.out[-4000:]}\nstderr:\n{self.err[-4000:]}"


def spawn(path: Path, n: int, *args: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """python -m meshccl.linkcheck as ranks 0..n-1 of one job, as meshkit check starts it."""
    base = {k: v for k, v in os.environ.items() if k not in ("MESHCCL_ALLOW_NO_TOKEN", "MESHCCL_JOB_ID")}
    job = f"lc-{secrets.token_hex(4)}"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "meshccl.linkcheck", *args],
            env={
                **base,
                "MESHCCL_HOSTFILE": str(path),
                "MESHCCL_RANK": str(r),
                "MESHCCL_TOKEN": h.TOKEN,
                "MESHCCL_JOB_ID": job,
                "MESHCCL_LOG_LEVEL": "1",
                **(env or {}),
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]


def run(path: Path, n: int, *args: str, env: dict[str, str] | None = None) -> list[Rank]:
    return [Rank(r, *result) for r, result in enumerate(h.finish(spawn(path, n, *args, env=env), timeout=120))]


def cables(path: Path) -> dict[str, dict[str, Any]]:
    """cable name -> {"a": host, "b": host, "a_rank", "b_rank"} from the hostfile."""
    data = json.loads(path.read_text())
    rank_of = {r["host"]: r["rank"] for r in data["ranks"]}
    out = {}
    for r in data["ranks"]:
        for link in r["links"]:
            left, right = link["cable"].split(" <-> ")
            a, b = left.rpartition(":")[0], right.rpartition(":")[0]
            out[link["cable"]] = {"a": a, "b": b, "a_rank": rank_of[a], "b_rank": rank_of[b]}
    return out


def succeeded(ranks: list[Rank]) -> None:
    """Every rank exited 0, printed no error record, and ended with its "done"."""
    for r in ranks:
        assert r.code == 0, r
        assert not r.of("error"), r
        assert r.records and r.records[-1] == {"t": "done", "rank": r.rank}, r


def cable_records(ranks: list[Rank], path: Path) -> dict[str, dict[str, Any]]:
    """Exactly one "cable" record per cable of the hostfile, printed by the rank of its end a."""
    expected = cables(path)
    seen: dict[str, dict[str, Any]] = {}
    for r in ranks:
        for rec in r.of("cable"):
            key = rec["cable"]
            assert key in expected, f"a record for {key!r}, which is no cable of the hostfile: {r}"
            assert key not in seen, f"two records for {key}"
            assert r.rank == expected[key]["a_rank"], f"{key} printed by rank {r.rank}, not by end a's rank"
            left, right = key.split(" <-> ")
            assert (rec["a"], rec["b"]) == (left, right)
            assert set(rec) == {"t", "cable", "a", "b", "rtt_us", "rtt_p99_us", "alone", "load", "loss", "error"}
            seen[key] = rec
    assert sorted(seen) == sorted(expected)
    return seen


def assert_measured(rec: dict[str, Any], *, bulk: bool) -> None:
    assert rec["error"] is None, rec
    assert rec["rtt_us"] > 0 and rec["rtt_p99_us"] >= rec["rtt_us"], rec
    assert rec["loss"] == {"ab": 0.0, "ba": 0.0, "probes": 400}, rec
    if bulk:
        for mode in ("alone", "load"):
            assert set(rec[mode]) == {"ab", "ba"}, rec
            assert rec[mode]["ab"] > 0 and rec[mode]["ba"] > 0, rec
    else:
        assert rec["alone"] is None and rec["load"] is None, rec


def progress(ranks: list[Rank]) -> list[tuple[str, int, int, str]]:
    """Rank 0's progress records (no other rank prints any)."""
    for r in ranks[1:]:
        assert not r.of("progress"), r
    return [(p["phase"], p["step"], p["steps"], p["what"]) for p in ranks[0].of("progress")]


def phases(steps: list[tuple[str, int, int, str]]) -> list[str]:
    out: list[str] = []
    for phase, *_ in steps:
        if not out or out[-1] != phase:
            out.append(phase)
    return out


def assert_allreduce(ranks: list[Rank], world: int) -> None:
    assert all(not r.of("allreduce") for r in ranks[1:])
    (rec,) = ranks[0].of("allreduce")
    assert rec["world_size"] == world
    assert [row["bytes"] for row in rec["rows"]] == [MIB, 4 * MIB, 16 * MIB]
    for row in rec["rows"]:
        assert row["count"] == row["bytes"] // 4 and row["dtype"] == "float32", row
        assert row["correct"] is True, row
        assert row["time_us"] > 0 and row["algbw"] > 0 and row["busbw"] > 0, row
        assert abs(row["busbw"] - row["algbw"] * 2 * (world - 1) / world) <= 1e-6 * row["busbw"], row


def test_full_mesh_of_four_every_cable_measured_alone_under_load_and_the_allreduce(tmp_path):
    path = hostfile(tmp_path, MESH4, 4)
    ranks = run(path, 4, *FAST)
    succeeded(ranks)
    records = cable_records(ranks, path)
    assert len(records) == 6
    for rec in records.values():
        assert_measured(rec, bulk=True)
    assert_allreduce(ranks, 4)
    steps = progress(ranks)
    assert phases(steps) == FULL_PHASES
    names = sorted(records)
    for phase in ("latency", "alone"):  # one step per cable, in cable-name order
        assert [s for s in steps if s[0] == phase] == [(phase, i, 6, n) for i, n in enumerate(names, 1)]
    for phase in ("connect", "load", "loss"):
        assert [s[1:3] for s in steps if s[0] == phase] == [(1, 1)]
    assert [s[3] for s in steps if s[0] == "allreduce"] == ["1 MiB", "4 MiB", "16 MiB"]


def test_quick_measures_latency_and_loss_only(tmp_path):
    path = hostfile(tmp_path, RING4, 4)
    ranks = run(path, 4, "--quick", *FAST)
    succeeded(ranks)
    for rec in cable_records(ranks, path).values():
        assert_measured(rec, bulk=False)
    assert not any(r.of("allreduce") for r in ranks)
    assert phases(progress(ranks)) == ["connect", "latency", "loss"]


def test_ring_of_three_with_a_doubled_cable_measures_both_cables_between_the_same_hosts(tmp_path):
    path = hostfile(tmp_path, RING3_DOUBLED, 3)
    ranks = run(path, 3, *FAST)
    succeeded(ranks)
    records = cable_records(ranks, path)
    between = [k for k, c in cables(path).items() if {c["a"], c["b"]} == {"node1", "node2"}]
    assert len(between) == 2 and len(records) == 4, records
    for rec in records.values():
        assert_measured(rec, bulk=True)
    assert_allreduce(ranks, 3)


NOWHERE = "127.64.0.250"  # on loopback, in no plan: nothing listens there


def test_a_cable_that_cannot_connect_is_reported_and_the_others_are_still_measured(tmp_path):
    # End b of one cable is told that end a is at an address nobody listens on, so b cannot
    # reach a on that cable. The job's own communicator must still start: between two ranks the
    # higher one connects, over its own entry of the cable. So the broken entry is that of the
    # lower rank: in this ring (rank order node1, node3, node2, node4) end b of node2 <-> node3.
    broken: dict[str, str] = {}

    def edit(data: dict) -> None:
        addresses = {link[k] for r in data["ranks"] for link in r["links"] for k in ("address", "peer_address")}
        assert NOWHERE not in addresses
        rank_of = {r["host"]: r["rank"] for r in data["ranks"]}
        for r in data["ranks"]:
            for link in r["links"]:
                left, right = link["cable"].split(" <-> ")
                a, b = left.rpartition(":")[0], right.rpartition(":")[0]
                if not broken and r["host"] == b and rank_of[a] > rank_of[b]:
                    link["peer_address"] = NOWHERE
                    broken.update(cable=link["cable"], b=b, a=a)

    path = hostfile(tmp_path, RING4, 4, edit)
    assert broken, "the ring has a cable whose end b is the lower rank"
    ranks = run(path, 4, "--connect-timeout", "3", *FAST)
    succeeded(ranks)
    records = cable_records(ranks, path)
    bad = records.pop(broken["cable"])
    assert bad["error"], bad
    assert f"{broken['b']} could not reach {broken['a']} at {NOWHERE}:" in bad["error"], bad
    assert "after 3 s" in bad["error"], bad  # the --connect-timeout given, not the default
    assert all(bad[k] is None for k in ("rtt_us", "rtt_p99_us", "alone", "load", "loss")), bad
    assert len(records) == 3
    for rec in records.values():
        assert_measured(rec, bulk=True)
    assert_allreduce(ranks, 4)
    steps = progress(ranks)
    assert phases(steps) == FULL_PHASES
    # the unreachable cable is left out of the later phases
    assert [s[3] for s in steps if s[0] == "latency"] == sorted(records)


def test_a_cable_the_jobs_own_communicator_needs_ends_the_run_on_every_rank_with_an_error(tmp_path):
    # The same broken entry on the higher rank's end: the job itself cannot connect (its ranks
    # connect over every cable), so no cable can be measured; every rank must still end, non-zero,
    # with an error record, the ends of that cable naming its address.
    def edit(data: dict) -> None:
        for r in data["ranks"]:
            for link in r["links"]:
                if r["host"] == "node2" and link["cable"] == "node1:tb0 <-> node2:tb0":
                    link["peer_address"] = NOWHERE

    path = hostfile(tmp_path, MESH4, 4, edit)
    ranks = run(path, 4, "--connect-timeout", "3", *FAST, env={"MESHCCL_CONNECT_TIMEOUT": "3"})
    for r in ranks:
        assert r.code == 1, r
        assert [x["t"] for x in r.records] == ["error"], r
    assert f"could not reach rank 0 at {NOWHERE}:" in ranks[1].records[0]["msg"], ranks[1]
    assert "rank 1 did not connect to rank 0" in ranks[0].records[0]["msg"], ranks[0]


def test_two_ranks_per_host_are_refused(tmp_path):
    path = h.meshccl_hostfile(tmp_path, [(1, 2)], 2, ranks_per_host=2)
    ranks = run(path, 4, *FAST)
    for r in ranks:
        assert r.code == 2, r
        (err,) = r.records
        assert err["t"] == "error", r
        assert "one rank per host" in err["msg"] and "node1 has ranks [0, 1]" in err["msg"], err


def test_a_rank_that_dies_mid_run_ends_the_run_on_every_rank_with_an_error(tmp_path):
    # Rank 3 is killed while the cables are measured one at a time: every other rank must end
    # (its next world call fails), exit non-zero and say why in an error record; none hangs.
    path = hostfile(tmp_path, MESH4, 4)
    procs = spawn(path, 4, "--seconds", "0.25")
    outs: list[list[str]] = [[] for _ in procs]
    errs: list[list[str]] = [[] for _ in procs]
    measuring = threading.Event()

    def read(i: int, stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            if i == 0 and line.startswith(PREFIX) and '"phase":"alone"' in line:
                measuring.set()

    readers = [
        threading.Thread(target=read, args=(i, stream, into), daemon=True)
        for i, p in enumerate(procs)
        for stream, into in ((p.stdout, outs[i]), (p.stderr, errs[i]))
    ]
    for t in readers:
        t.start()
    try:
        assert measuring.wait(90), f"rank 0 never reached the alone phase: {''.join(outs[0])}{''.join(errs[0])}"
        procs[3].kill()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for t in readers:
        t.join(10)
    ranks = [Rank(i, codes[i], "".join(outs[i]), "".join(errs[i])) for i in range(3)]
    for r in ranks:
        assert r.code == 1, r
        assert r.of("error") and not r.of("done"), r
        assert f"rank {r.rank} (node{r.rank + 1})" in r.of("error")[0]["msg"], r


def test_steady_rate_leaves_out_a_stall_but_never_a_cable_slow_throughout() -> None:
    from meshccl.linkcheck import steady_rate

    def stamps(took: list[float]) -> list[float]:
        out = [0.0]
        for t in took:
            out.append(out[-1] + t)
        return out

    piece = 1_000_000
    assert steady_rate(piece, stamps([0.01] * 16)) == pytest.approx(100e6)
    # One retransmit timeout (0.2 s) in 16 pieces of 10 ms: left out.
    assert steady_rate(piece, stamps([0.01] * 15 + [0.2])) == pytest.approx(100e6)
    # A cable at half rate is slow in every piece: half rate.
    assert steady_rate(piece, stamps([0.02] * 16)) == pytest.approx(50e6)
    # Stalls everywhere (a lossy cable): at most two are left out, the rest count.
    assert steady_rate(piece, stamps([0.01] * 12 + [0.2] * 4)) == pytest.approx(14 * piece / (0.12 + 0.4))
    # A late receiver moves time between neighbouring pieces; the sum is what counts.
    assert steady_rate(piece, stamps([0.005, 0.015] * 8)) == pytest.approx(100e6)


def test_steady_rate_leaves_out_what_arrived_during_a_stall_with_it() -> None:
    """A receiver that does not run for 60 ms (a busy machine) reads the 6 pieces that came meanwhile at once from
    its socket's buffer: left out with the stall, the cable reads its rate, not 2.5 times it (as before)."""
    from meshccl.linkcheck import steady_rate

    took = [0.01] * 8 + [0.07] + [0.0001] * 6 + [0.01]
    stamps = [0.0]
    for t in took:
        stamps.append(stamps[-1] + t)
    assert steady_rate(1_000_000, stamps) == pytest.approx(100e6)
