#pragma once

// Errors. Two families, as in gloo: a recoverable failure of the job (a peer died, stalled,
// called something else, was not who it claimed to be) poisons the communicator — every later
// call raises the same error and the communicator must be rebuilt; misuse (bad argument) raises
// and leaves the communicator usable.

#include <sstream>
#include <stdexcept>
#include <string>

namespace meshccl {

enum class ErrorKind : unsigned char {
  kInvalidArgument = 1,  // misuse: the communicator stays usable
  kIo = 2,               // a connection failed or a peer closed it
  kTimeout = 3,          // an operation or the connect phase ran past its deadline
  kMismatch = 4,         // ranks called different collectives / dtypes / counts / roots
  kAuth = 5,             // a peer without the job token, or not the rank it should be
  kBootstrap = 6,        // bad configuration: hostfile, addresses, ports
  // 7 is the C ABI's MESHCCL_ERR_INTERNAL.
  kAborted = 8,  // abort() on some rank (another thread, Ctrl-C, close during a call)
};

// A kind that can travel in an ABORT frame.
inline bool validErrorKind(int k) { return (k >= 1 && k <= 6) || k == 8; }

const char* kindName(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] inline void raise(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

}  // namespace meshccl

// Invariants on arguments: raise InvalidArgument with the message.
#define MESHCCL_ENFORCE(cond, ...)                                                           \
  do {                                                                                       \
    if (!(cond)) ::meshccl::raise(::meshccl::ErrorKind::kInvalidArgument, ::meshccl::cat(__VA_ARGS__)); \
  } while (0)
