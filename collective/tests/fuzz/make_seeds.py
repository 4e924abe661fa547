"""Writes the seed inputs of meshccl's fuzz targets (corpus/acceptor, corpus/connector).

The seeds are committed; this script documents how they were made and remakes them:
    python3 collective/tests/fuzz/make_seeds.py
Layout of an input (targets.h): one flags byte, then the bytes the other side sends.
"""

from __future__ import annotations

import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAGIC = 0x4D43434C  # "MCCL"
VERSION = 2
HONEST = 1  # flags bit 0: the harness plays the honest peer where a proof is due
TAKEN = 2  # flags bit 1: the proven connection's slot is taken


def hello(rank: int, size: int, index: int, count: int, version: int = VERSION, flags: int = 0) -> bytes:
    return struct.pack("<IHHIIII", MAGIC, version, flags, rank, size, index, count) + bytes(range(32))


def challenge(status: int = 0, rank: int = 1, magic: int = MAGIC, version: int = VERSION) -> bytes:
    return struct.pack("<IIHHI", status, magic, version, 0, rank) + bytes(range(100, 132))


def verdict(status: int = 0, mac: bytes = b"\x42" * 32) -> bytes:
    return struct.pack("<I", status) + mac


PROOF_PLACEHOLDER = b"\x00" * 32  # replaced by the honest proof when the HONEST flag is set
HTTP = b"GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n"
V1_HELLO = struct.pack("<IHHIIII", MAGIC, 1, 6, 2, 4, 0, 2) + b"secret"

ACCEPTOR = {
    "valid-honest": bytes([HONEST]) + hello(2, 4, 1, 2) + PROOF_PLACEHOLDER + b"job data follows",
    "valid-honest-rank3": bytes([HONEST | 0x40]) + hello(3, 4, 0, 1) + PROOF_PLACEHOLDER,
    "valid-duplicate": bytes([HONEST | TAKEN | 0x10]) + hello(2, 4, 0, 2) + PROOF_PLACEHOLDER,
    "wrong-proof": bytes([0x20]) + hello(2, 4, 0, 2) + b"\x13" * 32,
    "truncated-hello": bytes([0x04]) + hello(2, 4, 0, 2)[:30],
    "truncated-proof": bytes([HONEST]) + hello(2, 4, 0, 2) + b"\x01" * 10,
    "bad-rank": bytes([0]) + hello(9, 4, 0, 2),
    "self-rank": bytes([0]) + hello(1, 4, 0, 1),
    "bad-size": bytes([0]) + hello(2, 5, 0, 2),
    "bad-index": bytes([0]) + hello(2, 4, 2, 2),
    "bad-count": bytes([0]) + hello(2, 4, 0, 0xFFFFFFFF),
    "bad-flags": bytes([0]) + hello(2, 4, 0, 2, flags=1),
    "version-1-hello": bytes([0]) + V1_HELLO,
    "version-3-hello": bytes([0]) + hello(2, 4, 0, 2, version=3),
    "http-garbage": bytes([0x08]) + HTTP,
    "zeros": bytes([0]) + b"\x00" * 100,
}

CONNECTOR = {
    "valid-honest": bytes([HONEST]) + challenge() + verdict(mac=PROOF_PLACEHOLDER) + b"job data follows",
    "forged-mac": bytes([0x14]) + challenge() + verdict(),
    "bad-token-verdict": bytes([0]) + challenge() + verdict(status=1, mac=b"\x00" * 32),
    "duplicate-verdict": bytes([0x30]) + challenge() + verdict(status=3, mac=b"\x00" * 32),
    "refused-bad-rank": bytes([0]) + challenge(status=2, rank=1),
    "version-1-answer": bytes([0]) + struct.pack("<I", 4),
    "version-1-ok": bytes([0]) + struct.pack("<I", 0),
    "wrong-rank": bytes([0]) + challenge(rank=3),
    "not-meshccl": bytes([0]) + challenge(magic=0x50545448),
    "version-3": bytes([0]) + challenge(version=3),
    "truncated-challenge": bytes([0x0C]) + challenge()[:20],
    "truncated-verdict": bytes([HONEST]) + challenge() + verdict()[:7],
    "http-garbage": bytes([0]) + b"HTTP/1.1 400 Bad Request\r\n\r\n",
    "ones": bytes([0xFC]) + b"\xff" * 120,
}


def main() -> None:
    for target, seeds in (("acceptor", ACCEPTOR), ("connector", CONNECTOR)):
        out = HERE / "corpus" / target
        out.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            # .bin: the collection ships collective/, and ansible-test's sanity checks judge any
            # other file by its bytes (line endings, UTF-8) as if it were text.
            (out / f"seed-{name}.bin").write_bytes(data)


if __name__ == "__main__":
    main()
