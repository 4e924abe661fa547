// The C ABI over the C++ core: exceptions become result codes and a stored message.

#include <cstring>
#include <memory>
#include <string>

#include "meshccl/collectives.h"
#include "meshccl/meshccl.h"
#include "meshccl/platform.h"

struct meshccl_comm {
  std::unique_ptr<meshccl::Context> ctx;
  std::string lastError;
};

namespace {

int codeOf(meshccl::ErrorKind kind) { return static_cast<int>(kind); }

template <typename F>
int guarded(meshccl_comm* comm, F&& body) {
  if (comm == nullptr || !comm->ctx) return MESHCCL_ERR_INVALID;
  try {
    body(*comm->ctx);
    return MESHCCL_OK;
  } catch (const meshccl::Error& e) {
    comm->lastError = e.what();
    return codeOf(e.kind());
  } catch (const std::exception& e) {
    comm->lastError = e.what();
    return MESHCCL_ERR_INTERNAL;
  }
}

meshccl::DataType dt(meshccl_dtype d) { return static_cast<meshccl::DataType>(d); }
meshccl::RedOp rop(meshccl_op o) { return static_cast<meshccl::RedOp>(o); }

}  // namespace

extern "C" {

void meshccl_config_init(meshccl_config* c) {
  const meshccl::Config d;
  std::memset(c, 0, sizeof(*c));
  c->rank = d.rank;
  c->size = d.size;
  c->token = "";
  c->conns_per_link = d.connsPerLink;
  c->timeout_s = d.timeoutSeconds;
  c->connect_timeout_s = d.connectTimeoutSeconds;
  c->ring_conns = d.ringConns;
  c->segment_bytes = d.segmentBytes;
  c->small_bytes = d.smallBytes;
  c->pipeline_depth = d.pipelineDepth;
  c->algorithm = "auto";
  c->socket_buffer_bytes = d.socketBufferBytes;
  c->log_level = d.logLevel;
  c->transport = "auto";
  c->shm_ring_bytes = d.shmRingBytes;
  c->shm_segment_bytes = d.shmSegmentBytes;
  c->single_copy_bytes = d.singleCopyBytes;
  c->job_id = "";
  c->allow_no_token = 0;
  c->handshake_timeout_s = d.handshakeTimeoutSeconds;
}

int meshccl_comm_create(const meshccl_config* c, meshccl_comm** out, char* error, size_t errorLen) {
  auto report = [&](const std::string& msg) {
    if (error != nullptr && errorLen > 0) {
      std::strncpy(error, msg.c_str(), errorLen - 1);
      error[errorLen - 1] = '\0';
    }
  };
  if (c == nullptr || out == nullptr) {
    report("meshccl_comm_create: null config or output pointer");
    return MESHCCL_ERR_INVALID;
  }
  *out = nullptr;
  try {
    meshccl::Config cfg;
    cfg.rank = c->rank;
    cfg.size = c->size;
    cfg.token = c->token != nullptr ? c->token : "";
    for (int i = 0; i < c->num_listen; ++i) cfg.listen.push_back({c->listen[i].address, c->listen[i].port});
    for (int i = 0; i < c->num_peers; ++i) {
      meshccl::PeerSpec p;
      p.rank = c->peers[i].rank;
      p.initiate = c->peers[i].initiate;
      p.sameHost = c->peers[i].same_host != 0;
      for (int l = 0; l < c->peers[i].num_links; ++l) p.links.push_back({c->peers[i].links[l].address, c->peers[i].links[l].port});
      cfg.peers.push_back(std::move(p));
    }
    cfg.connsPerLink = c->conns_per_link;
    cfg.timeoutSeconds = c->timeout_s;
    cfg.connectTimeoutSeconds = c->connect_timeout_s;
    cfg.complete = c->complete != 0;
    cfg.ring = c->ring != 0;
    cfg.ringConns = c->ring_conns;
    cfg.segmentBytes = c->segment_bytes;
    cfg.smallBytes = c->small_bytes;
    cfg.pipelineDepth = c->pipeline_depth;
    cfg.algorithm = c->algorithm != nullptr ? c->algorithm : "auto";
    cfg.socketBufferBytes = c->socket_buffer_bytes;
    cfg.logLevel = c->log_level;
    cfg.transport = c->transport != nullptr ? c->transport : "auto";
    cfg.shmRingBytes = c->shm_ring_bytes;
    cfg.shmSegmentBytes = c->shm_segment_bytes;
    cfg.singleCopyBytes = c->single_copy_bytes;
    cfg.jobId = c->job_id != nullptr ? c->job_id : "";
    cfg.allowNoToken = c->allow_no_token != 0;
    cfg.handshakeTimeoutSeconds = c->handshake_timeout_s;
    auto comm = std::make_unique<meshccl_comm>();
    comm->ctx = std::make_unique<meshccl::Context>(std::move(cfg));
    *out = comm.release();
    return MESHCCL_OK;
  } catch (const meshccl::Error& e) {
    report(e.what());
    return codeOf(e.kind());
  } catch (const std::exception& e) {
    report(e.what());
    return MESHCCL_ERR_INTERNAL;
  }
}

int meshccl_abi_version(void) { return MESHCCL_ABI_VERSION; }

const char* meshccl_build_info(void) {
  static const std::string text = meshccl::platform::buildInfoText();
  return text.c_str();
}

void meshccl_comm_destroy(meshccl_comm* comm) { delete comm; }
int meshccl_comm_rank(const meshccl_comm* comm) { return comm->ctx->rank(); }
int meshccl_comm_size(const meshccl_comm* comm) { return comm->ctx->size(); }
const char* meshccl_comm_last_error(const meshccl_comm* comm) { return comm->lastError.c_str(); }

const char* meshccl_comm_transport(const meshccl_comm* comm, int peer) {
  if (comm == nullptr || !comm->ctx) return "";
  const std::string t = peer == -1 ? comm->ctx->transportSummary() : comm->ctx->transport(peer);
  for (const char* known : {"shm", "tcp", "shm+tcp"}) {
    if (t == known) return known;
  }
  return "";
}

int meshccl_comm_single_copy(const meshccl_comm* comm) {
  return comm != nullptr && comm->ctx && comm->ctx->canReadPeers() ? 1 : 0;
}

int meshccl_all_reduce(meshccl_comm* comm, const void* s, void* r, size_t n, meshccl_dtype d, meshccl_op o) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::allReduce(ctx, s, r, n, dt(d), rop(o)); });
}
int meshccl_all_gather(meshccl_comm* comm, const void* s, void* r, size_t n, meshccl_dtype d) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::allGather(ctx, s, r, n, dt(d)); });
}
int meshccl_reduce_scatter(meshccl_comm* comm, const void* s, void* r, size_t n, meshccl_dtype d, meshccl_op o) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::reduceScatter(ctx, s, r, n, dt(d), rop(o)); });
}
int meshccl_broadcast(meshccl_comm* comm, void* b, size_t n, meshccl_dtype d, int root) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::broadcast(ctx, b, n, dt(d), root); });
}
int meshccl_send(meshccl_comm* comm, const void* b, size_t n, meshccl_dtype d, int dst) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::send(ctx, b, n, dt(d), dst); });
}
int meshccl_recv(meshccl_comm* comm, void* b, size_t n, meshccl_dtype d, int src) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::recv(ctx, b, n, dt(d), src); });
}
int meshccl_barrier(meshccl_comm* comm) {
  return guarded(comm, [&](meshccl::Context& ctx) { meshccl::barrier(ctx); });
}

}  // extern "C"
