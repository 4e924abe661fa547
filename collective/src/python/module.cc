// Python binding: a thin layer over the C++ Context and collectives. Arrays come in through
// nanobind's ndarray (buffer protocol and DLPack: NumPy arrays, PyTorch CPU tensors, ...)
// without copies; outputs are never converted (a converted output would be a silent copy).
// The GIL is released for the duration of every network call.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <string>
#include <utility>
#include <vector>

#include "meshccl/collectives.h"
#include "meshccl/crypto.h"
#include "meshccl/engine.h"
#include "meshccl/meshccl.h"
#include "meshccl/platform.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;
using OutArray = nb::ndarray<nb::device::cpu, nb::c_contig>;

// Python exception types, one per error family; created at import.
PyObject* gErrorTypes[9] = {nullptr};  // by ErrorKind (0: the base)

meshccl::DataType dtypeOf(const nb::dlpack::dtype& d, const char* what) {
  using nb::dlpack::dtype_code;
  const auto code = static_cast<dtype_code>(d.code);
  if (d.lanes == 1) {
    if (code == dtype_code::Float && d.bits == 32) return meshccl::DataType::kFloat32;
    if (code == dtype_code::Float && d.bits == 64) return meshccl::DataType::kFloat64;
    if (code == dtype_code::Float && d.bits == 16) return meshccl::DataType::kFloat16;
    if (code == dtype_code::Bfloat && d.bits == 16) return meshccl::DataType::kBFloat16;
    if (code == dtype_code::Int && d.bits == 8) return meshccl::DataType::kInt8;
    if (code == dtype_code::Int && d.bits == 32) return meshccl::DataType::kInt32;
    if (code == dtype_code::Int && d.bits == 64) return meshccl::DataType::kInt64;
    if (code == dtype_code::UInt && d.bits == 8) return meshccl::DataType::kUInt8;
  }
  throw nb::type_error((std::string(what) + ": unsupported element type (code " + std::to_string(d.code) + ", " +
                        std::to_string(d.bits) + " bits); meshccl supports float32, float64, float16, bfloat16, "
                        "int8, int32, int64, uint8")
                           .c_str());
}

// The dtype of the call: the array's own, or `override` (a meshccl dtype number) when the
// caller reinterprets raw storage (e.g. bfloat16 held in a uint16 NumPy array).
meshccl::DataType resolve(const nb::dlpack::dtype& d, int override, size_t bytes, const char* what, size_t* count) {
  meshccl::DataType t;
  if (override >= 0) {
    if (!meshccl::validDataType(override)) throw nb::value_error("unknown meshccl dtype number");
    t = static_cast<meshccl::DataType>(override);
  } else {
    t = dtypeOf(d, what);
  }
  const size_t es = meshccl::elementSize(t);
  if (bytes % es != 0) {
    throw nb::value_error((std::string(what) + ": its size in bytes is not a multiple of the element size").c_str());
  }
  *count = bytes / es;
  return t;
}

size_t bytesOf(const nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>& a) { return a.nbytes(); }

// Ctrl-C during a call. Python runs signal handlers on the main thread only, so only a call
// made there checks: about every 50 ms while it waits on the network, it takes the GIL and
// runs the pending handlers; one that raises (KeyboardInterrupt) aborts the call on every rank
// and the handler's exception is what the caller sees.
std::thread::id gMainThread;

struct SignalCheck {
  bool raised = false;
  std::function<bool()> fn() {
    if (std::this_thread::get_id() != gMainThread) return {};
    return [this] {
      nb::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      raised = true;  // the handler's exception stays set on this thread until the call returns
      return true;
    };
  }
};

// An operation queued on a communicator's engine (async_op=True).
class PyWork {
 public:
  PyWork(std::shared_ptr<meshccl::Engine> engine, std::shared_ptr<meshccl::Work> work)
      : engine_(std::move(engine)), work_(std::move(work)) {}

  // Waits (timeout < 0 or None: without limit); true once done, false on timeout. Raises the
  // operation's error. Ctrl-C while waiting (main thread) aborts the job and raises.
  bool wait(std::optional<double> timeout) {
    using clock = std::chrono::steady_clock;
    const bool forever = !timeout || *timeout < 0;
    const auto until = clock::now() + std::chrono::duration_cast<clock::duration>(
                                          std::chrono::duration<double>(forever ? 0.0 : *timeout));
    const bool main = std::this_thread::get_id() == gMainThread;
    for (;;) {
      double slice = main ? 0.05 : -1.0;
      if (!forever) {
        const double left = std::chrono::duration<double>(until - clock::now()).count();
        slice = slice < 0 ? std::max(left, 0.0) : std::min(slice, std::max(left, 0.0));
      }
      bool done = false;
      {
        nb::gil_scoped_release release;
        done = work_->waitFor(slice);
      }
      if (done) break;
      if (main && PyErr_CheckSignals() != 0) {
        engine_->abort("interrupted (Ctrl-C) while waiting for an operation");
        {
          nb::gil_scoped_release release;
          work_->waitFor(-1);
        }
        throw nb::python_error();
      }
      if (!forever && clock::now() >= until) return false;
    }
    if (auto e = work_->error()) std::rethrow_exception(e);
    return true;
  }
  bool isCompleted() const { return work_->done(); }
  // The operation's error message, or None (done without error, or not done yet).
  std::optional<std::string> errorText() const {
    if (auto e = work_->error()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        return std::string(x.what());
      }
    }
    return std::nullopt;
  }

 private:
  std::shared_ptr<meshccl::Engine> engine_;
  std::shared_ptr<meshccl::Work> work_;
};

class Communicator {
 public:
  explicit Communicator(meshccl::Config config) {
    nb::gil_scoped_release release;
    engine_ = std::make_shared<meshccl::Engine>(std::move(config));
  }

  int rank() const { return ctx().rank(); }
  int size() const { return ctx().size(); }
  double timeout() const { return ctx().timeout(); }
  void setTimeout(double s) { engine_->setTimeout(s); }
  int connections(int peer) const { return ctx().connCount(peer); }
  bool linked(int peer) const { return ctx().connected(peer); }
  std::string transport(int peer) const { return ctx().transport(peer); }
  std::string transportSummary() const { return ctx().transportSummary(); }
  bool singleCopy() const { return ctx().canReadPeers(); }
  size_t pending() const { return engine_->pending(); }
  bool closed() const { return engine_->closed(); }
  // What the connect phase saw (strangers rejected, handshakes dropped, accept back-offs).
  nb::dict connectStats() const {
    const meshccl::ConnectStats& s = ctx().connectStats();
    nb::dict d;
    d["poll_rounds"] = s.pollRounds;
    d["accepted"] = s.accepted;
    d["rejected"] = s.rejected;
    d["closed_early"] = s.closedEarly;
    d["timed_out"] = s.timedOut;
    d["evicted"] = s.evicted;
    d["accept_backoffs"] = s.acceptBackoffs;
    d["logs_suppressed"] = s.logsSuppressed;
    return d;
  }

  nb::object allReduce(const InArray& in, const OutArray& out, int op, int dtype, bool async) {
    size_t n = 0, m = 0;
    const auto t = resolve(in.dtype(), dtype, bytesOf(in), "input", &n);
    resolve(out.dtype(), dtype, out.nbytes(), "output", &m);
    if (n != m) throw nb::value_error("all_reduce: input and output differ in element count");
    checkSameType(in, out, dtype);
    const auto r = redop(op);
    const void* src = in.data();
    void* dst = out.data();
    return go(async, [=](meshccl::Context& c) { meshccl::allReduce(c, src, dst, n, t, r); });
  }

  nb::object allGather(const InArray& in, const OutArray& out, int dtype, bool async) {
    size_t n = 0, m = 0;
    const auto t = resolve(in.dtype(), dtype, bytesOf(in), "input", &n);
    resolve(out.dtype(), dtype, out.nbytes(), "output", &m);
    if (m != n * static_cast<size_t>(size())) {
      throw nb::value_error(("all_gather: the output must hold world size x input = " +
                             std::to_string(n * static_cast<size_t>(size())) + " elements, it holds " +
                             std::to_string(m))
                                .c_str());
    }
    checkSameType(in, out, dtype);
    const void* src = in.data();
    void* dst = out.data();
    return go(async, [=](meshccl::Context& c) { meshccl::allGather(c, src, dst, n, t); });
  }

  nb::object reduceScatter(const InArray& in, const OutArray& out, int op, int dtype, bool async) {
    size_t n = 0, m = 0;
    const auto t = resolve(in.dtype(), dtype, bytesOf(in), "input", &n);
    resolve(out.dtype(), dtype, out.nbytes(), "output", &m);
    if (n != m * static_cast<size_t>(size())) {
      throw nb::value_error(("reduce_scatter: the input must hold world size x output = " +
                             std::to_string(m * static_cast<size_t>(size())) + " elements, it holds " +
                             std::to_string(n))
                                .c_str());
    }
    checkSameType(in, out, dtype);
    const auto r = redop(op);
    const void* src = in.data();
    void* dst = out.data();
    return go(async, [=](meshccl::Context& c) { meshccl::reduceScatter(c, src, dst, m, t, r); });
  }

  nb::object broadcast(const OutArray& buf, int root, int dtype, bool async) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, buf.nbytes(), "buffer", &n);
    void* p = buf.data();
    return go(async, [=](meshccl::Context& c) { meshccl::broadcast(c, p, n, t, root); });
  }

  nb::object send(const InArray& buf, int dst, int dtype, bool async) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, bytesOf(buf), "buffer", &n);
    const void* p = buf.data();
    return go(async, [=](meshccl::Context& c) { meshccl::send(c, p, n, t, dst); });
  }

  nb::object recv(const OutArray& buf, int src, int dtype, bool async) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, buf.nbytes(), "buffer", &n);
    void* p = buf.data();
    return go(async, [=](meshccl::Context& c) { meshccl::recv(c, p, n, t, src); });
  }

  // A batch of sends and receives posted together (meshccl::exchange): raw bytes.
  // Receive buffers are taken as they are (never converted: a converted one would be a copy
  // the data lands in and nobody reads).
  nb::object exchange(const std::vector<std::pair<InArray, int>>& sends,
                      const std::vector<std::pair<nb::object, int>>& recvs, bool async) {
    std::vector<meshccl::P2POp> ops;
    for (const auto& [a, peer] : sends) ops.push_back({true, const_cast<void*>(a.data()), a.nbytes(), peer});
    for (const auto& [o, peer] : recvs) {
      OutArray a;
      if (!nb::try_cast<OutArray>(o, a, false)) {
        throw nb::type_error("exchange: a receive buffer must be a writable C-contiguous CPU array");
      }
      ops.push_back({false, a.data(), a.nbytes(), peer});
    }
    return go(async, [ops = std::move(ops)](meshccl::Context& c) { meshccl::exchange(c, ops); });
  }

  // Tagged messages (meshccl::messages): sends and receives [(array, peer, tag)], raw bytes; a
  // receive's peer -1 takes the first message with its tag from any linked rank. `sources`, if
  // given, is a writable int32 array with one slot per receive: the rank each came from.
  nb::object messages(const std::vector<std::tuple<InArray, int, int64_t>>& sends,
                      const std::vector<std::tuple<nb::object, int, int64_t>>& recvs, nb::object sources,
                      bool async) {
    auto ops = std::make_shared<std::vector<meshccl::MessageOp>>();
    auto tagOf = [](int64_t tag) {
      if (tag < 0 || tag > 0xffffffffLL) throw nb::value_error("messages: a tag is 0 to 2**32 - 1");
      return static_cast<uint32_t>(tag);
    };
    for (const auto& [a, peer, tag] : sends) {
      ops->push_back({true, const_cast<void*>(a.data()), a.nbytes(), peer, tagOf(tag)});
    }
    for (const auto& [o, peer, tag] : recvs) {
      OutArray a;
      if (!nb::try_cast<OutArray>(o, a, false)) {
        throw nb::type_error("messages: a receive buffer must be a writable C-contiguous CPU array");
      }
      ops->push_back({false, a.data(), a.nbytes(), peer, tagOf(tag)});
    }
    int32_t* out = nullptr;
    if (!sources.is_none()) {
      OutArray s;
      if (!nb::try_cast<OutArray>(sources, s, false) || s.dtype() != nb::dtype<int32_t>() ||
          s.size() != recvs.size()) {
        throw nb::type_error("messages: sources must be a writable int32 array with one slot per receive");
      }
      out = static_cast<int32_t*>(s.data());
    }
    const size_t first = sends.size();
    return go(async, [ops, out, first](meshccl::Context& c) {
      meshccl::messages(c, *ops);
      if (out != nullptr) {
        for (size_t i = first; i < ops->size(); ++i) out[i - first] = (*ops)[i].source;
      }
    });
  }

  nb::object barrier(bool async) {
    return go(async, [](meshccl::Context& c) { meshccl::barrier(c); });
  }

  void abort(const std::string& reason) {
    nb::gil_scoped_release release;
    engine_->abort(reason);
  }

  void close() {
    nb::gil_scoped_release release;
    engine_->close();
  }

 private:
  const meshccl::Context& ctx() const { return engine_->context(); }

  // Runs the operation now (blocking, GIL released) or queues it and returns its Work.
  nb::object go(bool async, meshccl::Engine::Op op) {
    if (async) return nb::cast(PyWork(engine_, engine_->submit(std::move(op))));
    SignalCheck check;
    std::exception_ptr error;
    {
      nb::gil_scoped_release release;
      try {
        engine_->run(std::move(op), check.fn());
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (check.raised && PyErr_Occurred() != nullptr) throw nb::python_error();  // KeyboardInterrupt
    if (error) std::rethrow_exception(error);
    return nb::none();
  }
  static meshccl::RedOp redop(int op) {
    if (!meshccl::validRedOp(op)) throw nb::value_error("unknown reduction op number");
    return static_cast<meshccl::RedOp>(op);
  }
  template <typename A, typename B>
  static void checkSameType(const A& a, const B& b, int override) {
    if (override >= 0) return;
    if (a.dtype() != b.dtype()) throw nb::type_error("input and output have different element types");
  }

  std::shared_ptr<meshccl::Engine> engine_;
};

// What this build selected (platform.h), for meshccl.build_info().
nb::dict buildInfo() {
  const meshccl::platform::BuildInfo& b = meshccl::platform::buildInfo();
  nb::dict d;
  d["system"] = b.system;
  d["portable"] = b.portable;
  d["single_copy"] = b.singleCopy;
  d["sockets"] = b.sockets;
  d["sigpipe"] = b.sigpipe;
  d["shm_reserve"] = b.shmReserve;
  d["shm_name_max"] = b.shmNameMax;
  d["crypto"] = meshccl::crypto::providerName();
  d["protocol_version"] = meshccl::kProtocolVersion;
  d["abi_version"] = MESHCCL_ABI_VERSION;
  return d;
}

meshccl::Config makeConfig(int rank, int size, const std::string& token,
                           const std::vector<std::pair<std::string, int>>& listen,
                           const std::vector<std::tuple<int, std::vector<std::pair<std::string, int>>, int, bool>>& peers,
                           int connsPerLink, double timeout, double connectTimeout, bool complete, bool ring,
                           int ringConns, size_t segmentBytes, size_t smallBytes, int pipelineDepth,
                           const std::string& algorithm, int socketBuffer, int logLevel,
                           const std::string& transport, size_t shmRingBytes, size_t shmSegmentBytes,
                           size_t singleCopyBytes, const std::string& jobId, bool allowNoToken,
                           double handshakeTimeout) {
  meshccl::Config c;
  c.rank = rank;
  c.size = size;
  c.token = token;
  for (const auto& [a, p] : listen) c.listen.push_back({a, p});
  for (const auto& [r, links, initiate, sameHost] : peers) {
    meshccl::PeerSpec spec;
    spec.rank = r;
    spec.initiate = initiate;
    spec.sameHost = sameHost;
    for (const auto& [a, p] : links) spec.links.push_back({a, p});
    c.peers.push_back(std::move(spec));
  }
  c.connsPerLink = connsPerLink;
  c.timeoutSeconds = timeout;
  c.connectTimeoutSeconds = connectTimeout;
  c.complete = complete;
  c.ring = ring;
  c.ringConns = ringConns;
  c.segmentBytes = segmentBytes;
  c.smallBytes = smallBytes;
  c.pipelineDepth = pipelineDepth;
  c.algorithm = algorithm;
  c.socketBufferBytes = socketBuffer;
  c.logLevel = logLevel;
  c.transport = transport;
  c.shmRingBytes = shmRingBytes;
  c.shmSegmentBytes = shmSegmentBytes;
  c.singleCopyBytes = singleCopyBytes;
  c.jobId = jobId;
  c.allowNoToken = allowNoToken;
  c.handshakeTimeoutSeconds = handshakeTimeout;
  return c;
}

}  // namespace

NB_MODULE(_meshccl, m) {
  m.doc() = "meshccl native core (use the meshccl package, not this module)";

  // Error families as Python exceptions; meshccl/__init__.py re-exports them.
  PyObject* base = PyErr_NewException("meshccl.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(base);
  struct Family {
    meshccl::ErrorKind kind;
    const char* name;
    PyObject* extra;
  };
  const Family families[] = {
      {meshccl::ErrorKind::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {meshccl::ErrorKind::kIo, "PeerError", PyExc_ConnectionError},
      {meshccl::ErrorKind::kTimeout, "TimeoutError", PyExc_TimeoutError},
      {meshccl::ErrorKind::kMismatch, "MismatchError", nullptr},
      {meshccl::ErrorKind::kAuth, "AuthError", PyExc_PermissionError},
      {meshccl::ErrorKind::kBootstrap, "BootstrapError", nullptr},
      {meshccl::ErrorKind::kAborted, "AbortedError", nullptr},
  };
  for (const auto& f : families) {
    PyObject* bases = f.extra != nullptr ? PyTuple_Pack(2, base, f.extra) : PyTuple_Pack(1, base);
    PyObject* type = PyErr_NewException((std::string("meshccl.") + f.name).c_str(), bases, nullptr);
    Py_DECREF(bases);
    gErrorTypes[static_cast<int>(f.kind)] = type;
    m.attr(f.name) = nb::handle(type);
  }
  gErrorTypes[0] = base;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const meshccl::Error& e) {
      PyObject* type = gErrorTypes[static_cast<int>(e.kind())];
      PyErr_SetString(type != nullptr ? type : gErrorTypes[0], e.what());
    }
  });

  m.def("make_config", &makeConfig, "rank"_a, "size"_a, "token"_a, "listen"_a, "peers"_a, "conns_per_link"_a,
        "timeout"_a, "connect_timeout"_a, "complete"_a, "ring"_a, "ring_conns"_a, "segment_bytes"_a,
        "small_bytes"_a, "pipeline_depth"_a, "algorithm"_a, "socket_buffer"_a, "log_level"_a,
        "transport"_a, "shm_ring_bytes"_a, "shm_segment_bytes"_a,
        "single_copy_bytes"_a, "job_id"_a, "allow_no_token"_a,
        "handshake_timeout"_a = meshccl::Config{}.handshakeTimeoutSeconds);
  // The connect handshake's protocol (2: both ends prove the job token, it is never sent).
  m.attr("PROTOCOL_VERSION") = meshccl::kProtocolVersion;
  m.def("build_info", &buildInfo);
  nb::class_<meshccl::Config>(m, "Config");

  gMainThread = std::this_thread::get_id();  // the module is imported on the main thread
  nb::class_<PyWork>(m, "Work")
      .def("wait", &PyWork::wait, "timeout"_a = nb::none())
      .def("is_completed", &PyWork::isCompleted)
      .def("error_text", &PyWork::errorText);

  nb::class_<Communicator>(m, "Communicator")
      .def(nb::init<meshccl::Config>(), "config"_a)
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_rw("timeout", &Communicator::timeout, &Communicator::setTimeout)
      .def("connections", &Communicator::connections, "peer"_a)
      .def("linked", &Communicator::linked, "peer"_a)
      .def("transport", &Communicator::transport, "peer"_a)
      .def_prop_ro("transport_summary", &Communicator::transportSummary)
      .def_prop_ro("single_copy", &Communicator::singleCopy)
      .def_prop_ro("connect_stats", &Communicator::connectStats)
      .def_prop_ro("pending", &Communicator::pending)
      .def_prop_ro("closed", &Communicator::closed)
      .def("all_reduce", &Communicator::allReduce, "input"_a, "output"_a.noconvert(), "op"_a, "dtype"_a,
           "async_op"_a = false)
      .def("all_gather", &Communicator::allGather, "input"_a, "output"_a.noconvert(), "dtype"_a, "async_op"_a = false)
      .def("reduce_scatter", &Communicator::reduceScatter, "input"_a, "output"_a.noconvert(), "op"_a, "dtype"_a,
           "async_op"_a = false)
      .def("broadcast", &Communicator::broadcast, "buffer"_a.noconvert(), "root"_a, "dtype"_a, "async_op"_a = false)
      .def("send", &Communicator::send, "buffer"_a, "dst"_a, "dtype"_a, "async_op"_a = false)
      .def("recv", &Communicator::recv, "buffer"_a.noconvert(), "src"_a, "dtype"_a, "async_op"_a = false)
      .def("exchange", &Communicator::exchange, "sends"_a, "recvs"_a, "async_op"_a = false)
      .def("messages", &Communicator::messages, "sends"_a, "recvs"_a, "sources"_a = nb::none(),
           "async_op"_a = false)
      .def("barrier", &Communicator::barrier, "async_op"_a = false)
      .def("abort", &Communicator::abort, "reason"_a)
      .def("close", &Communicator::close);
}
