#pragma once

// The engine: the one place a communicator's operations run, from any number of threads.
//
// Every operation (a collective, a batch of sends and receives) is a function over the
// Context. The engine runs them one at a time, in the order they were submitted, so the
// Context (which is single-threaded by design) only ever sees one caller:
//
//   submit(op)   queues the operation for the engine's own thread (started on first use) and
//                returns a Work at once: async calls, as torch's async_op=True wants.
//   run(op)      a blocking call. With nothing queued or running it runs on the caller's
//                thread (a hand-off to another thread costs microseconds that a 4 KiB
//                all-reduce cannot spare); otherwise it queues behind the others and waits.
//   abort(why)   from any thread: the running operation fails with kAborted at its next look
//                (poll() is woken), its ABORT reaches every peer, whose calls fail alike; queued
//                operations then fail with the same error. With nothing running the ABORTs go
//                out at once.
//   close()      from any thread: with operations running or queued it aborts them first
//                ("closed during a call"), waits for the engine to be idle, then closes.
//
// A Work completes exactly once, with success or the operation's error.

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <deque>

#include "meshccl/context.h"

namespace meshccl {

class Work {
 public:
  // Waits up to `seconds` (< 0: without limit); true once the operation has ended.
  bool waitFor(double seconds) const;
  bool done() const;
  // The operation's error once it has ended with one (else null).
  std::exception_ptr error() const;
  // Waits without limit and rethrows the operation's error.
  void get() const;

 private:
  friend class Engine;
  void finish(std::exception_ptr error);

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class Engine {
 public:
  using Op = std::function<void(Context&)>;

  explicit Engine(Config config);  // connects (see Context)
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Immutable after connect: safe to read from any thread.
  const Context& context() const { return *ctx_; }
  void setTimeout(double seconds);

  std::shared_ptr<Work> submit(Op op);
  // `interrupt` (may be empty) is polled about every 50 ms while an inline call waits on the
  // network; true aborts the call ("interrupted"). Queued behind others, the caller waits on
  // the Work instead and `interrupt` is polled between waits.
  void run(Op op, const std::function<bool()>& interrupt = {});
  void abort(const std::string& reason);
  void close();
  bool closed() const;
  // Operations queued or running right now.
  size_t pending() const;

 private:
  struct Item {
    Op op;
    std::shared_ptr<Work> work;
  };
  void loop();
  // Runs one operation (busy_ is set) and makes the engine idle again; its error, if any.
  std::exception_ptr execute(Op& op, const std::function<bool()>& interrupt);

  std::unique_ptr<Context> ctx_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // the engine thread: work queued, idle again, stopping
  std::deque<Item> queue_;
  bool busy_ = false;    // an operation runs (on the engine thread or a caller's)
  bool closed_ = false;  // no new operations
  bool stop_ = false;    // the engine thread ends
  std::thread thread_;
};

}  // namespace meshccl
