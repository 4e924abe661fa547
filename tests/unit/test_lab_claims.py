"""meshkit/lab_claims.py: processes that claim lab subnets at once never get the same one."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from pathlib import Path

from meshkit import lab_claims

CLAIMERS = 6
OCTETS = range(1, 4)  # fewer subnets than claimers: some must come away empty


def _claimer(claims: str, start: object, done: object, out: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    got = lab_claims.first_free(OCTETS, Path(claims), routes=lambda subnet: [])
    out.put((os.getpid(), got))  # type: ignore[attr-defined]
    with contextlib.suppress(threading.BrokenBarrierError):  # a failed round aborts the barrier
        done.wait()  # type: ignore[attr-defined]  # hold the claim (stay alive) until every claimer has one


def test_claimers_starting_together_never_share_a_subnet(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for rnd in range(25):
        claims = tmp_path / f"round{rnd}"
        start, done, out = ctx.Barrier(CLAIMERS), ctx.Barrier(CLAIMERS + 1), ctx.Queue()
        procs = [
            ctx.Process(target=_claimer, args=(str(claims), start, done, out), daemon=True) for _ in range(CLAIMERS)
        ]
        for p in procs:
            p.start()
        try:
            results = [out.get(timeout=60) for _ in procs]
            taken = [(pid, subnet) for pid, subnet in results if subnet is not None]
            subnets = [subnet for _, subnet in taken]
            assert len(subnets) == len(set(subnets)), f"round {rnd}: one subnet claimed twice: {results}"
            assert sorted(subnets) == [f"198.19.{o}.0/24" for o in OCTETS], f"round {rnd}: {results}"
            for pid, subnet in taken:  # each claim names its owner
                assert (claims / subnet.split(".")[2]).read_text() == str(pid)
            done.wait(timeout=60)
        finally:
            done.abort()  # a failed round lets its claimers go too
            for p in procs:
                p.join(timeout=60)
        assert all(p.exitcode == 0 for p in procs)


def test_a_dead_owners_claim_is_taken_over_and_a_live_ones_is_not(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    gone = ctx.Process(target=os.getpid)
    gone.start()
    gone.join()
    (tmp_path / "1").write_text(str(gone.pid))  # a run that died without releasing
    (tmp_path / "2").write_text("1")  # pid 1 lives
    assert lab_claims.first_free(range(1, 3), tmp_path, routes=lambda subnet: []) == "198.19.1.0/24"
    assert (tmp_path / "1").read_text() == str(os.getpid())
    assert lab_claims.first_free(range(2, 3), tmp_path, routes=lambda subnet: []) is None
    lab_claims.release("198.19.1.0/24", tmp_path)
    assert not (tmp_path / "1").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["2"], "no temporary files are left"
