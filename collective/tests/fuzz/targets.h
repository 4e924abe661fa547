#pragma once

// meshccl's fuzz targets: every byte a stranger can send before authentication.
//
//   acceptor:  what reaches a rank's listener (HELLO, then PROOF) — the acceptor's state machine
//   connector: what a process on a rank's planned port answers (CHALLENGE, then VERDICT)
//
// Input layout, both targets: byte 0 holds flags, the rest is the byte stream from the other
// side, cut into chunks of pseudo-random sizes (seeded from byte 0) as a network would.
//   bit 0  the harness plays the honest peer where a proof is due (the fuzzer cannot make an
//          HMAC): the acceptor is given the right PROOF, the connector the right VERDICT mac,
//          in place of the next 32 input bytes; so the states after the proof are explored too
//   bit 1  acceptor: a proven connection finds its slot taken (refuseDuplicate) instead of free
//   bits 2-7  chunking seed
//
// Invariants (a violation aborts, which libFuzzer and the corpus replay report as a crash):
// no input reaches "proven" without the harness's honest proof, the token never appears in
// anything sent, every message sent has its exact size and order, a machine never consumes
// more than it was given nor anything once finished.
//
// Built three ways: with libFuzzer (clang, make meshccl-fuzz: LLVMFuzzerTestOneInput), into the
// gtest suite, which replays the regression corpus (tests/fuzz/corpus/<target>/) with gcc in
// make meshccl-cpp and under ASan + UBSan in make meshccl-sanitize, and as meshccl_fuzz_replay
// (replay_main.cc) to rerun a crash file without clang.

#include <cstddef>
#include <cstdint>

namespace meshccl::fuzz {

int acceptorTarget(const uint8_t* data, size_t size);
int connectorTarget(const uint8_t* data, size_t size);

}  // namespace meshccl::fuzz
