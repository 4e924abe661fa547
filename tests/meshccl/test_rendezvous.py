"""The torchrun rendezvous as a stranger would try it: real processes and sockets on
127.0.0.1. Nobody without the token joins, the token never leaves a rank, idle connections
and garbage do not stop a job, a job without a token is refused, timeouts name who is missing;
and every byte a stranger can send before authentication is fuzzed."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import meshccl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from meshccl import bootstrap as b

from . import helpers as h

CORPUS = Path(__file__).with_name("fuzz_corpus")
set_hypothesis_home_dir(Path(__file__).resolve().parents[2] / ".cache" / "hypothesis")  # not .hypothesis/ here
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def assert_all_ok(results):
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and "OK" in out, f"rank {r} exit {code}\nstdout: {out}\nstderr: {err}"


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def claim(port: int, rank: int, size: int, token: str, job_id: str = "") -> tuple[dict, socket.socket]:
    """Connects to the rendezvous, sends a well-formed claim proved with `token`; returns rank
    0's answer (parsed; {} if it closed without one) and the open socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = b.parse_hello(h.read_line(s, time.monotonic() + 5).rstrip(b"\n"))
    assert isinstance(hello, b.Hello), hello
    own = s.getsockname()[0]
    s.sendall(b.claim_line(token, job_id, hello.nonce, secrets.token_hex(32), rank, size, own, 40000 + rank, "x/y/z"))
    return hello, s


def everything(s: socket.socket, timeout: float) -> list[dict]:
    """Every line rank 0 sent on s until it closed (or `timeout`)."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def answer(s: socket.socket, timeout: float = 10.0) -> dict:
    """Rank 0's one-line answer on s ({} when it closed or reset without one)."""
    try:
        line = h.read_line(s, time.monotonic() + timeout)
    except ConnectionResetError:
        return {}
    return json.loads(line) if line else {}


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Whether the other end closed s within `timeout` (reading and discarding what it sent)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


# --- live jobs -------------------------------------------------------------------------------------


def test_a_stranger_without_the_token_cannot_join_and_the_real_job_completes():
    port = h.free_port_block(2)
    env = h.torchrun_env(3, port, MESHCCL_CONNECT_TIMEOUT="60")
    rank0 = h.spawn(3, "allreduce", env, ranks=[0])
    others = []
    try:
        h.greeting(port + 1)
        # A stranger who knows the port: a well-formed claim for rank 2 proved with a guess,
        # then one for rank 1 before the real rank 1 is even started.
        _, s2 = claim(port + 1, 2, 3, "a-guess")
        _, s1 = claim(port + 1, 1, 3, "another-guess")
        with s1, s2:
            for s in (s2, s1):
                reply = answer(s)
                assert "bad proof" in reply.get("error", ""), reply
                assert closed_by_peer(s, 5)
        idle = socket.create_connection(("127.0.0.1", port + 1))  # and one that says nothing
        with idle:
            others = h.spawn(3, "allreduce", env, ranks=[1, 2])
            results = h.finish(rank0 + others, timeout=90)
    finally:
        kill_all(rank0 + others)
    assert_all_ok(results)
    err0 = results[0][2]
    assert re.search(r"meshccl\[rank 0\]: rendezvous: refused 127\.0\.0\.1:\d+: bad proof", err0), err0
    for _code, out, err in results:
        assert h.TOKEN not in out + err


class Squatter(threading.Thread):
    """A listener on a planned port: answers like a rendezvous (greeting, then a made-up
    table) unless silent, and records every byte it receives."""

    def __init__(self, port: int, silent: bool) -> None:
        super().__init__(daemon=True)
        self.silent = silent
        self.received = bytearray()
        self.connections = 0
        self.srv = socket.create_server(("127.0.0.1", port))
        self.srv.settimeout(0.2)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                if not self.silent:
                    conn.sendall(b.hello_line(secrets.token_hex(32)))
                conn.settimeout(0.2)
                answered = False
                while not self.stop.is_set():
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        continue
                    except OSError:
                        break
                    if not chunk:
                        break
                    self.received += chunk
                    if not self.silent and not answered and b"\n" in self.received:
                        table = {"0": ["127.0.0.1", 1, "a"], "1": ["127.0.0.1", 2, "b"]}
                        conn.sendall(json.dumps({"table": table, "proof": "ab" * 32}).encode() + b"\n")
                        answered = True
        self.srv.close()


@pytest.mark.parametrize("silent", [False, True], ids=["answers", "silent"])
def test_a_squatter_on_the_rendezvous_port_never_receives_the_token(silent):
    port = h.free_port_block(2)
    token = secrets.token_hex(32)
    squatter = Squatter(port + 1, silent)  # bound before rank 0, which never comes
    squatter.start()
    try:
        env = h.torchrun_env(2, port, MESHCCL_TOKEN=token, MESHCCL_CONNECT_TIMEOUT="3")
        ((code, out, err),) = h.finish(h.spawn(2, "allreduce", env, ranks=[1]), timeout=60)
    finally:
        squatter.stop.set()
        squatter.join(10)
    got = bytes(squatter.received)
    assert squatter.connections >= 1
    for secret in (token.encode(), token.encode().hex().encode(), token.upper().encode()):
        assert secret not in got
    assert token not in out + err
    assert code == 3, out + err
    if silent:  # waits for a greeting that never comes: nothing sent at all
        assert got == b""
        assert "ERROR TimeoutError" in out and f"127.0.0.1:{port + 1}" in out and "never reached" in out, out
    else:  # it sent its claim (proved, not the token) and refused the made-up table
        assert b'"proof"' in got and got.count(b"\n") == 1, got
        assert "ERROR AuthError" in out and "could not prove the job token" in out, out
        assert "not this job's rank 0" in out and f"127.0.0.1:{port + 1}" in out, out


def test_idle_connections_and_garbage_do_not_stop_the_rendezvous():
    port = h.free_port_block(2)
    env = h.torchrun_env(3, port, MESHCCL_CONNECT_TIMEOUT="60")
    started = time.monotonic()
    rank0 = h.spawn(3, "allreduce", env, ranks=[0])
    others: list = []
    idle: list[socket.socket] = []
    try:
        h.greeting(port + 1)
        idle = [socket.create_connection(("127.0.0.1", port + 1), timeout=10) for _ in range(200)]
        garbage = {
            b"garbage, not json\n": "not JSON",
            b"[]\n": "a JSON list, not an object",
            b"{}\n": "fields missing",
            b"x" * 5000 + b"\n": "line longer than 4096 bytes",
        }
        replies = {}
        for line, why in garbage.items():
            with socket.create_connection(("127.0.0.1", port + 1), timeout=10) as s:
                assert h.read_line(s, time.monotonic() + 10).startswith(b'{"meshccl":"rendezvous"')
                s.sendall(line)
                replies[why] = answer(s)
                assert closed_by_peer(s, 3), why
        others = h.spawn(3, "allreduce", env, ranks=[1, 2])
        results = h.finish(rank0 + others, timeout=90)
        # The first 136 idle connections were pushed out by newer ones (64 pending at most).
        dropped = sum(1 for s in idle if any("handshakes pending" in m.get("error", "") for m in everything(s, 2)))
    finally:
        for s in idle:
            s.close()
        kill_all(rank0 + others)
    elapsed = time.monotonic() - started
    assert_all_ok(results)
    for why, reply in replies.items():  # the oversized line may be cut off by a reset
        assert why in reply.get("error", why), (why, reply)
    assert dropped >= 136, dropped
    err0 = results[0][2]
    shown = err0.count("rendezvous: refused")
    assert 0 < shown <= 10 * (int(elapsed // 10) + 1), err0  # rate-limited
    assert "more like these" in err0, err0


def test_out_of_file_descriptors_rank_0_sheds_idle_handshakes_and_the_job_forms():
    port = h.free_port_block(2)
    env = h.torchrun_env(2, port, MESHCCL_CONNECT_TIMEOUT="60")
    # Rank 0 may hold 40 descriptors (about 8 in use at start): 100 idle connections exhaust them.
    rank0 = h.spawn(2, "allreduce", env, ranks=[0], wrap=lambda r: ["prlimit", "--nofile=40", "--"])
    others: list = []
    idle: list[socket.socket] = []
    try:
        h.greeting(port + 1)
        idle = [socket.create_connection(("127.0.0.1", port + 1), timeout=10) for _ in range(100)]
        others = h.spawn(2, "allreduce", env, ranks=[1])
        results = h.finish(rank0 + others, timeout=90)
    finally:
        for s in idle:
            s.close()
        kill_all(rank0 + others)
    assert_all_ok(results)
    assert "accept failed (Too many open files); not accepting for 0.05 s" in results[0][2], results[0][2]


class OutOfFiles(socket.socket):
    """A listener whose accept() always fails as a process out of descriptors does."""

    def accept(self):
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_accept_out_of_file_descriptors_backs_off_instead_of_spinning():
    srv = OutOfFiles(socket.AF_INET, socket.SOCK_STREAM)
    srv.accepts = 0
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    log: list[str] = []
    machine = b.RendezvousServer(2, TOKEN, "", ("127.0.0.1", 1, "h"), log.append)
    # A connection left in the backlog keeps the listener readable the whole time.
    never = pytest.raises(meshccl.TimeoutError, match=r"rank\(s\) \[1\] never arrived")
    with srv, socket.create_connection(srv.getsockname()), never:
        b._serve(srv, machine, time.monotonic() + 2.0, 2.0, "here")
    # Not watched for 0.05, 0.1, 0.2, 0.4, 0.8 s ... after each failure: a handful of tries.
    assert 3 <= srv.accepts <= 8, srv.accepts
    assert log[0] == "accept failed (Too many open files); not accepting for 0.05 s", log


def test_a_rank_that_leaves_before_the_table_loses_its_claim():
    port = h.free_port_block(2)
    env = h.torchrun_env(3, port, MESHCCL_CONNECT_TIMEOUT="60")
    rank0 = h.spawn(3, "allreduce", env, ranks=[0])
    others: list = []
    try:
        h.greeting(port + 1)
        # A real rank 1 (it holds the token) claims, then dies before the job forms ...
        _, s = claim(port + 1, 1, 3, h.TOKEN)
        with s:
            # ... and a second claim of rank 1 while it is held is refused.
            _, dup = claim(port + 1, 1, 3, h.TOKEN)
            with dup:
                assert "rank 1 is already claimed" in answer(dup).get("error", "")
        # The restarted rank 1 claims again; the job forms without the dead claim.
        others = h.spawn(3, "allreduce", env, ranks=[1, 2])
        results = h.finish(rank0 + others, timeout=90)
    finally:
        kill_all(rank0 + others)
    assert_all_ok(results)
    assert "rank 1 (127.0.0.1:" in results[0][2] and "its claim is released" in results[0][2], results[0][2]


def test_a_job_without_a_token_is_refused_and_the_opt_out_runs_and_says_so(tmp_path):
    port = h.free_port_block(2)
    # Rank 0 and rank 2 of a torchrun job alone: refused at once (a rendezvous would wait 60 s).
    env = h.torchrun_env(3, port, MESHCCL_TOKEN="", MESHCCL_CONNECT_TIMEOUT="60")
    started = time.monotonic()
    results = h.finish(h.spawn(3, "allreduce", env, ranks=[0, 2]), timeout=60)
    assert time.monotonic() - started < 30
    path = h.loopback_hostfile(tmp_path, 2)  # and a meshkit hostfile job
    results += h.finish(h.spawn(2, "allreduce", lambda r: {**h.hostfile_env(path)(r), "MESHCCL_TOKEN": ""}))
    for code, out, err in results:
        assert code == 3 and "ERROR AuthError" in out, out + err
        for words in ("no job token", "MESHCCL_TOKEN", "torchrun", "secrets.token_hex(32)", "MESHCCL_ALLOW_NO_TOKEN=1"):
            assert words in out, (words, out)
    # The explicit opt-out runs, and every rank says so once at start.
    env = h.torchrun_env(2, h.free_port_block(2), MESHCCL_TOKEN="", MESHCCL_ALLOW_NO_TOKEN="1")
    results = h.finish(h.spawn(2, "allreduce", env), timeout=90)
    assert_all_ok(results)
    for r, (_code, _out, err) in enumerate(results):
        assert err.count(f"meshccl[rank {r}]: WARNING: running without a job token") == 1, err
    # Anything but a yes or a no is an error, not a silent opt-out.
    env = h.torchrun_env(2, port, MESHCCL_TOKEN="", MESHCCL_ALLOW_NO_TOKEN="maybe")
    ((code, out, err),) = h.finish(h.spawn(2, "allreduce", env, ranks=[0]), timeout=60)
    assert code == 3 and "ERROR BootstrapError" in out and "MESHCCL_ALLOW_NO_TOKEN='maybe'" in out, out + err


def torchrun(n: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real torchrun (PyTorch is in the test environment) running n workers on this host."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHCCL_")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    # --standalone takes an ephemeral MASTER_PORT; meshccl's default, MASTER_PORT + 1, is then just
    # another ephemeral port that any connection on the machine may hold: name a free one.
    port = {"MESHCCL_MASTER_PORT": str(h.free_port_block(1))}
    return subprocess.run(
        [*argv, str(h.WORKER), "allreduce"],
        env={**base, "MESHCCL_LOG_LEVEL": "1", **port, **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_under_torchrun_the_token_in_its_environment_reaches_every_worker_and_none_is_refused():
    done = torchrun(3, {"MESHCCL_TOKEN": secrets.token_hex(32)})
    assert done.returncode == 0 and done.stdout.count("OK") == 3, done.stdout + done.stderr
    done = torchrun(2, {})
    assert done.returncode != 0 and "OK" not in done.stdout.splitlines(), done.stdout + done.stderr
    # torchrun stops the other workers (SIGTERM) as soon as one fails, so on a busy machine a rank
    # can be stopped before it reports: every rank either refused for the token or was stopped.
    refused = set(re.findall(r"ERROR AuthError: rank (\d) of 2: no job token", done.stdout))
    stopped = set(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: -15", done.stdout + done.stderr))
    assert refused and refused | stopped == {"0", "1"}, done.stdout + done.stderr
    assert "export MESHCCL_TOKEN=" in done.stdout and "torchrun passes its environment" in done.stdout, done.stdout


def test_a_rendezvous_timeout_names_the_ranks_that_never_arrived():
    port = h.free_port_block(2)
    # Ranks 0 and 2 of 4. Rank 2 starts first and waits longer, so it is there all along.
    rank2 = h.spawn(4, "allreduce", h.torchrun_env(4, port, MESHCCL_CONNECT_TIMEOUT="7"), ranks=[2])
    rank0 = h.spawn(4, "allreduce", h.torchrun_env(4, port, MESHCCL_CONNECT_TIMEOUT="5"), ranks=[0])
    (c0, o0, e0), (c2, o2, e2) = h.finish(rank0 + rank2, timeout=60)
    assert c0 == 3 and "ERROR TimeoutError" in o0, o0 + e0  # meshccl's: the worker catches meshccl.Error only
    assert "rank(s) [1, 3] never arrived" in o0 and f"127.0.0.1:{port + 1}" in o0, o0
    assert c2 == 3 and "ERROR TimeoutError" in o2 and "did not complete within 7 s" in o2, o2 + e2
    # Nobody at the address: the rank names it.
    with pytest.raises(
        meshccl.TimeoutError, match=rf"rank 1: the rendezvous at 127\.0\.0\.1:{port + 1} .*never reached"
    ):
        b.plan_from_torchrun(1, 2, "127.0.0.1", port + 1, "tok", 0.5)


def test_ranks_of_another_job_id_with_the_same_token_do_not_meet():
    port = h.free_port_block(1)
    errors: dict[int, BaseException] = {}

    def rank(r: int, job: str, timeout: float) -> None:
        try:
            b.plan_from_torchrun(r, 2, "127.0.0.1", port, h.TOKEN, timeout, job_id=job)
        except BaseException as e:  # collected for the asserts below
            errors[r] = e

    threads = [
        threading.Thread(target=rank, args=(0, "job-a", 3.0)),
        threading.Thread(target=rank, args=(1, "job-b", 2.0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(errors[0], meshccl.TimeoutError) and "rank(s) [1] never arrived" in str(errors[0]), errors
    assert isinstance(errors[1], meshccl.TimeoutError), errors
    assert "rank 0 refused the claim: bad proof" in str(errors[1]), errors  # rank 1 gives up first


def test_the_regression_corpus_is_refused_by_a_live_rank_0():
    files = sorted(CORPUS.glob("*.txt"))
    assert len(files) >= 20
    port = h.free_port_block(2)
    env = h.torchrun_env(2, port, MESHCCL_CONNECT_TIMEOUT="120")
    rank0 = h.spawn(2, "allreduce", env, ranks=[0])
    others: list = []
    try:
        h.greeting(port + 1)
        for f in files:
            data = f.read_bytes()
            with socket.create_connection(("127.0.0.1", port + 1), timeout=10) as s:
                h.read_line(s, time.monotonic() + 10)
                s.sendall(data if data.endswith(b"\n") else data + b"\n")
                reply = answer(s, 3)  # judged at once, not left to the 5 s handshake deadline
                assert reply == {} or "error" in reply, (f.name, reply)
                assert closed_by_peer(s, 3), f.name
            assert rank0[0].poll() is None, f"rank 0 died on {f.name}: {rank0[0].communicate()}"
        others = h.spawn(2, "allreduce", env, ranks=[1])
        results = h.finish(rank0 + others, timeout=90)
    finally:
        kill_all(rank0 + others)
    assert_all_ok(results)
    assert "Traceback" not in results[0][2]


# --- fuzzing (pure functions and rank 0's state machine) ----------------------------------------

TOKEN = "fuzz-token-" + "k" * 30  # longer than any text the strategies make, so never echoed by chance
SERVER_NONCE = "5e" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
claim_like = st.fixed_dictionaries({k: json_values for k in b._CLAIM_FIELDS})


def valid_claim(rank: int = 1, size: int = 3) -> dict:
    line = b.claim_line(TOKEN, "job", SERVER_NONCE, "c1" * 32, rank, size, "127.0.0.1", 5000, "host/boot/1")
    return json.loads(line)


def judged(line: bytes) -> b.Claim | str:
    got = b.parse_claim(line, size=3, token=TOKEN, job_id="job", server_nonce=SERVER_NONCE)
    assert isinstance(got, b.Claim | str)
    if isinstance(got, str):
        assert got and TOKEN not in got
    return got


def test_a_valid_claim_is_accepted_and_the_proof_binds_every_field():
    line = json.dumps(valid_claim()).encode()
    assert judged(line) == b.Claim(1, 3, "c1" * 32, "127.0.0.1", 5000, "host/boot/1")
    base = {"size": 3, "token": TOKEN, "job_id": "job", "server_nonce": SERVER_NONCE}
    for change in ({"job_id": "another-job"}, {"token": "another-token"}, {"server_nonce": "00" * 32}):
        assert "bad proof" in b.parse_claim(line, **{**base, **change})


@FUZZ
@given(st.binary(max_size=6000))
def test_fuzz_parse_claim_bytes(data):
    assert isinstance(judged(data), str)


@FUZZ
@given(json_values | claim_like)
def test_fuzz_parse_claim_json_values(value):
    assert isinstance(judged(json.dumps(value).encode()), str)


@FUZZ
@given(st.sampled_from(b._CLAIM_FIELDS), json_values)
def test_fuzz_one_field_changed_is_refused(name, value):
    msg = valid_claim()
    if msg[name] == value and type(msg[name]) is type(value):
        return
    msg[name] = value
    assert isinstance(judged(json.dumps(msg).encode()), str)


@FUZZ
@given(st.binary(max_size=3000) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_parse_hello_and_parse_table(data):
    assert isinstance(b.parse_hello(data), b.Hello | str)
    got = b.parse_table(
        data,
        token=TOKEN,
        job_id="job",
        server_nonce=SERVER_NONCE,
        client_nonce="c1" * 32,
        rank=1,
        size=2,
        mine=("127.0.0.1", 5000, "h"),
    )
    assert isinstance(got, b.Refusal | str)


@FUZZ
@given(st.lists(st.binary(max_size=3000) | json_values.map(lambda v: json.dumps(v).encode()), max_size=5))
def test_fuzz_rank_0_state_machine_fed_arbitrary_bytes(chunks):
    log: list[str] = []
    server = b.RendezvousServer(3, TOKEN, "job", ("127.0.0.1", 1, "h0"), log.append)
    server.opened(1, "stranger", 0.0)
    for chunk in chunks:
        server.received(1, chunk, 0.0)
    server.received(1, b"\n", 0.0)
    # Always judged once a line ends, always refused with one logged reason, never claimed.
    assert not server.claims and server.entries.keys() == {0}
    assert 1 not in server.conns and server.refused == 1 and len(log) == 1
    assert server.actions[-1][0] == 1 and server.actions[-1][2] is True
    assert all(line.isprintable() for line in log)


def test_rank_0_state_machine_caps_pending_handshakes_and_releases_claims():
    log: list[str] = []
    server = b.RendezvousServer(3, TOKEN, "job", ("127.0.0.1", 1, "h0"), log.append, max_pending=4)
    for cid in range(1, 11):
        server.opened(cid, f"idle{cid}", float(cid))
    assert list(server.conns) == [7, 8, 9, 10]  # the oldest went first
    nonce = server.conns[10].nonce
    line = b.claim_line(TOKEN, "job", nonce, "c1" * 32, 2, 3, "127.0.0.1", 5000, "h2")
    server.received(10, line, 10.0)
    assert server.claims == {2: 10} and server.missing() == [1]
    server.opened(11, "idle11", 11.0)  # claimed connections do not count as pending
    assert list(server.conns) == [7, 8, 9, 10, 11]
    server.closed(10)
    assert server.missing() == [1, 2] and "rank 2 (idle10) left before the table was sent" in log[-1]
    server.expire(7.0 + b.RDV_HANDSHAKE_S)
    assert 7 not in server.conns and "no valid claim within 5 s" in log[-1]


def test_rate_limited_log_counts_what_it_does_not_show():
    now = [0.0]
    lines: list[str] = []
    log = b.RateLimitedLog("p: ", limit=10, window=10.0, clock=lambda: now[0], write=lines.append)
    for i in range(25):
        log(f"m{i}")
    assert lines == [f"p: m{i}" for i in range(10)]
    now[0] = 10.5
    log("later")
    assert lines[10:] == ["p: ... and 15 more like these (at most 10 lines per 10 s)", "p: later"]


def test_the_regression_corpus_is_refused_by_parse_claim():
    for f in sorted(CORPUS.glob("*.txt")):
        got = b.parse_claim(f.read_bytes().split(b"\n")[0], size=2, token=h.TOKEN, job_id="", server_nonce=SERVER_NONCE)
        assert isinstance(got, str), f.name
