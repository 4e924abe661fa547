#include "meshccl/engine.h"

#include <chrono>

namespace meshccl {

bool Work::waitFor(double seconds) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (seconds < 0) {
    cv_.wait(lock, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_; });
}

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::exception_ptr Work::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Work::get() const {
  waitFor(-1);
  if (auto e = error()) std::rethrow_exception(e);
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

Engine::Engine(Config config) : ctx_(std::make_unique<Context>(std::move(config))) {}

Engine::~Engine() {
  try {
    close();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; close() reports nothing else
  }
}

void Engine::setTimeout(double seconds) { ctx_->setTimeout(seconds); }

namespace {
[[noreturn]] void raiseClosed() { raise(ErrorKind::kInvalidArgument, "the communicator is closed"); }
}  // namespace

std::shared_ptr<Work> Engine::submit(Op op) {
  auto work = std::make_shared<Work>();
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) raiseClosed();
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  queue_.push_back(Item{std::move(op), work});
  cv_.notify_all();
  return work;
}

void Engine::run(Op op, const std::function<bool()>& interrupt) {
  std::shared_ptr<Work> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) raiseClosed();
    if (busy_ || !queue_.empty()) {
      work = std::make_shared<Work>();
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back(Item{std::move(op), work});
      cv_.notify_all();
    } else {
      busy_ = true;  // idle: run here, on the caller's thread
    }
  }
  if (!work) {
    if (auto error = execute(op, interrupt)) std::rethrow_exception(error);
    return;
  }
  while (!work->waitFor(interrupt ? 0.05 : -1.0)) {
    if (interrupt && interrupt()) {
      abort("interrupted (Ctrl-C)");
      break;
    }
  }
  work->get();
}

// An abort asked for while the operation ran is acted on before the engine is idle (under the
// lock abort() reads busy_ with), so one of the two always sends the ABORTs.
std::exception_ptr Engine::execute(Op& op, const std::function<bool()>& interrupt) {
  std::exception_ptr error;
  ctx_->setInterruptCheck(interrupt);
  try {
    op(*ctx_);
  } catch (...) {
    error = std::current_exception();
  }
  ctx_->setInterruptCheck({});
  std::unique_lock<std::mutex> lock(mu_);
  if (ctx_->abortRequested()) {
    lock.unlock();
    ctx_->abortIfRequested();
    lock.lock();
  }
  busy_ = false;
  cv_.notify_all();
  return error;
}

void Engine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!busy_ && !queue_.empty()); });
    if (stop_) return;  // close() waited for the queue to empty first
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    item.work->finish(execute(item.op, {}));
    lock.lock();
  }
}

void Engine::abort(const std::string& reason) {
  ctx_->requestAbort(reason);
  std::unique_lock<std::mutex> lock(mu_);
  if (busy_) return;  // the running operation fails at its next look, or execute() sends the ABORTs
  busy_ = true;
  lock.unlock();
  ctx_->abortIfRequested();
  lock.lock();
  busy_ = false;
  cv_.notify_all();
}

void Engine::close() {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return;
  closed_ = true;  // nothing new from here on
  if (busy_ || !queue_.empty()) {
    lock.unlock();
    abort("the communicator was closed during a call");
    lock.lock();
    cv_.wait(lock, [&] { return !busy_ && queue_.empty(); });  // queued operations fail at once (poisoned)
  }
  stop_ = true;
  cv_.notify_all();
  std::thread t = std::move(thread_);
  lock.unlock();
  if (t.joinable()) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // an operation closing its own communicator: the loop returns after it
    } else {
      t.join();
    }
  }
  ctx_->close();
}

bool Engine::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

size_t Engine::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + (busy_ ? 1 : 0);
}

}  // namespace meshccl
