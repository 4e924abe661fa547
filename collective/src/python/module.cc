// Python binding: a thin layer over the C++ Context and collectives. Arrays come in through
// nanobind's ndarray (buffer protocol and DLPack: NumPy arrays, PyTorch CPU tensors, ...)
// without copies; outputs are never converted (a converted output would be a silent copy).
// The GIL is released for the duration of every network call.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshccl/collectives.h"
#include "meshccl/crypto.h"
#include "meshccl/meshccl.h"
#include "meshccl/platform.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;
using OutArray = nb::ndarray<nb::device::cpu, nb::c_contig>;

// Python exception types, one per error family; created at import.
PyObject* gErrorTypes[8] = {nullptr};

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

class Communicator {
 public:
  explicit Communicator(meshccl::Config config) {
    nb::gil_scoped_release release;
    ctx_ = std::make_unique<meshccl::Context>(std::move(config));
  }

  int rank() const { return ctx().rank(); }
  int size() const { return ctx().size(); }
  double timeout() const { return ctx().timeout(); }
  void setTimeout(double s) { ctx().setTimeout(s); }
  int connections(int peer) const { return ctx().connCount(peer); }
  bool linked(int peer) const { return ctx().connected(peer); }
  std::string transport(int peer) const { return ctx().transport(peer); }
  std::string transportSummary() const { return ctx().transportSummary(); }
  bool singleCopy() const { return ctx().canReadPeers(); }
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

  void allReduce(const InArray& in, const OutArray& out, int op, int dtype) {
    size_t n = 0, m = 0;
    const auto t = resolve(in.dtype(), dtype, bytesOf(in), "input", &n);
    resolve(out.dtype(), dtype, out.nbytes(), "output", &m);
    if (n != m) throw nb::value_error("all_reduce: input and output differ in element count");
    checkSameType(in, out, dtype);
    nb::gil_scoped_release release;
    meshccl::allReduce(ctx(), in.data(), out.data(), n, t, redop(op));
  }

  void allGather(const InArray& in, const OutArray& out, int dtype) {
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
    nb::gil_scoped_release release;
    meshccl::allGather(ctx(), in.data(), out.data(), n, t);
  }

  void reduceScatter(const InArray& in, const OutArray& out, int op, int dtype) {
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
    nb::gil_scoped_release release;
    meshccl::reduceScatter(ctx(), in.data(), out.data(), m, t, redop(op));
  }

  void broadcast(const OutArray& buf, int root, int dtype) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, buf.nbytes(), "buffer", &n);
    nb::gil_scoped_release release;
    meshccl::broadcast(ctx(), buf.data(), n, t, root);
  }

  void send(const InArray& buf, int dst, int dtype) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, bytesOf(buf), "buffer", &n);
    nb::gil_scoped_release release;
    meshccl::send(ctx(), buf.data(), n, t, dst);
  }

  void recv(const OutArray& buf, int src, int dtype) {
    size_t n = 0;
    const auto t = resolve(buf.dtype(), dtype, buf.nbytes(), "buffer", &n);
    nb::gil_scoped_release release;
    meshccl::recv(ctx(), buf.data(), n, t, src);
  }

  void barrier() {
    nb::gil_scoped_release release;
    meshccl::barrier(ctx());
  }

  void close() {
    if (!ctx_) return;
    nb::gil_scoped_release release;
    ctx_->close();
    ctx_.reset();
  }

 private:
  meshccl::Context& ctx() const {
    if (!ctx_) throw meshccl::Error(meshccl::ErrorKind::kInvalidArgument, "the communicator is closed");
    return *ctx_;
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

  std::unique_ptr<meshccl::Context> ctx_;
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
      .def("all_reduce", &Communicator::allReduce, "input"_a, "output"_a.noconvert(), "op"_a, "dtype"_a)
      .def("all_gather", &Communicator::allGather, "input"_a, "output"_a.noconvert(), "dtype"_a)
      .def("reduce_scatter", &Communicator::reduceScatter, "input"_a, "output"_a.noconvert(), "op"_a, "dtype"_a)
      .def("broadcast", &Communicator::broadcast, "buffer"_a.noconvert(), "root"_a, "dtype"_a)
      .def("send", &Communicator::send, "buffer"_a, "dst"_a, "dtype"_a)
      .def("recv", &Communicator::recv, "buffer"_a.noconvert(), "src"_a, "dtype"_a)
      .def("barrier", &Communicator::barrier)
      .def("close", &Communicator::close);
}
