/* meshccl C ABI. Every call returns a meshccl_result; on failure the message is available
 * from meshccl_comm_last_error (or, for meshccl_comm_create, written to the caller's buffer).
 * A result other than MESHCCL_OK and MESHCCL_ERR_INVALID leaves the communicator poisoned:
 * every later call fails the same way; destroy it. */
#ifndef MESHCCL_MESHCCL_H_
#define MESHCCL_MESHCCL_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: connect protocol 2 (the token is proven both ways, never sent); job_id, allow_no_token and
 * handshake_timeout_s appended to meshccl_config (fill it with meshccl_config_init).
 * 3: functions added (meshccl_abi_version, meshccl_build_info, meshccl_comm_transport,
 * meshccl_comm_single_copy); meshccl_config and every earlier function unchanged, so a program
 * built for 2 runs unchanged on 3. */
#define MESHCCL_ABI_VERSION 3

#if defined(__GNUC__)
#define MESHCCL_API __attribute__((visibility("default")))
#else
#define MESHCCL_API
#endif

typedef enum {
  MESHCCL_OK = 0,
  MESHCCL_ERR_INVALID = 1,   /* bad argument; the communicator stays usable */
  MESHCCL_ERR_IO = 2,        /* a peer died or a connection failed */
  MESHCCL_ERR_TIMEOUT = 3,   /* an operation or the connect phase ran past its deadline */
  MESHCCL_ERR_MISMATCH = 4,  /* ranks made different calls */
  MESHCCL_ERR_AUTH = 5,      /* no job token, or a peer that could not prove it */
  MESHCCL_ERR_BOOTSTRAP = 6, /* bad configuration (addresses, ports, links) */
  MESHCCL_ERR_INTERNAL = 7,
  MESHCCL_ERR_ABORTED = 8    /* the job was aborted: abort() on some rank, Ctrl-C, close during a call */
} meshccl_result;

typedef enum {
  MESHCCL_FLOAT32 = 0,
  MESHCCL_FLOAT64 = 1,
  MESHCCL_FLOAT16 = 2,
  MESHCCL_BFLOAT16 = 3,
  MESHCCL_INT8 = 4,
  MESHCCL_INT32 = 5,
  MESHCCL_INT64 = 6,
  MESHCCL_UINT8 = 7
} meshccl_dtype;

typedef enum { MESHCCL_SUM = 0, MESHCCL_PROD = 1, MESHCCL_MIN = 2, MESHCCL_MAX = 3 } meshccl_op;

typedef struct {
  const char* address; /* numeric IPv4 or IPv6 */
  int port;
} meshccl_endpoint;

typedef struct {
  int rank;
  int num_links;                /* one per cable (or one for loopback / rendezvous) */
  const meshccl_endpoint* links; /* where this rank reaches the peer */
  int initiate;                  /* 1: this rank connects, 0: the peer does, -1: the higher rank */
  int same_host;                 /* both ranks on one host: data through shared memory */
} meshccl_peer;

typedef struct {
  int rank;
  int size;
  const char* token; /* job token: both ends of every connection prove it (never sent); "" only with allow_no_token */
  int num_listen;
  const meshccl_endpoint* listen; /* the only addresses this rank listens on */
  int num_peers;
  const meshccl_peer* peers; /* the ranks this rank shares a link with */
  int conns_per_link;
  double timeout_s;
  double connect_timeout_s;
  int complete;   /* every pair of ranks linked (same on every rank) */
  int ring;       /* rank r linked to r+1 mod size (same on every rank) */
  int ring_conns; /* connections per ring neighbour pair, minimum over the ring */
  size_t segment_bytes;
  size_t small_bytes;
  int pipeline_depth;
  const char* algorithm; /* "auto", "ring" or "direct" */
  int socket_buffer_bytes;
  int log_level;
  const char* transport; /* "auto" (shared memory between same-host ranks) or "tcp" */
  size_t shm_ring_bytes; /* per direction and connection, a power of two */
  size_t shm_segment_bytes; /* pipeline segment when every rank is on one host; 0: segment_bytes */
  size_t single_copy_bytes; /* every rank on one host: from this size read peers' buffers directly; 0: never */
  const char* job_id;       /* the job's name (not secret), part of every proof; may be "" */
  int allow_no_token;       /* 1: run without a token (anyone who reaches a port can join); logged at start */
  double handshake_timeout_s; /* an incoming connection must prove itself within this (default 5 s) */
} meshccl_config;

typedef struct meshccl_comm meshccl_comm;

/* The library's MESHCCL_ABI_VERSION (compare with the header's when loading it at run time). */
MESHCCL_API int meshccl_abi_version(void);
/* What this build selected, one line of key=value pairs (static storage), e.g.
 * "system=linux portable=0 single_copy=1 sockets=accept4 sigpipe=MSG_NOSIGNAL
 * shm_reserve=posix_fallocate shm_name_max=30". portable=1: a Linux build on the code paths
 * macOS takes (MESHCCL_PORTABLE). single_copy=0: ranks of one host copy through shared memory. */
MESHCCL_API const char* meshccl_build_info(void);

/* Fills every field with its default (rank 0 of 1, no peers). */
MESHCCL_API void meshccl_config_init(meshccl_config* config);
MESHCCL_API int meshccl_comm_create(const meshccl_config* config, meshccl_comm** comm, char* error, size_t error_len);
MESHCCL_API void meshccl_comm_destroy(meshccl_comm* comm);
MESHCCL_API int meshccl_comm_rank(const meshccl_comm* comm);
MESHCCL_API int meshccl_comm_size(const meshccl_comm* comm);
MESHCCL_API const char* meshccl_comm_last_error(const meshccl_comm* comm);
/* How this rank reaches `peer`: "shm" (shared memory), "tcp", "shm+tcp" (some connections fell
 * back to TCP), "" (no link); peer -1: over every peer ("" for a rank alone). Static storage. */
MESHCCL_API const char* meshccl_comm_transport(const meshccl_comm* comm, int peer);
/* 1: every peer shares this host and this rank can read their memory, so large calls copy each
 * byte once (when every rank can); 0: they copy through shared memory or TCP. */
MESHCCL_API int meshccl_comm_single_copy(const meshccl_comm* comm);

MESHCCL_API int meshccl_all_reduce(meshccl_comm* comm, const void* send, void* recv, size_t count, meshccl_dtype dtype,
                       meshccl_op op);
MESHCCL_API int meshccl_all_gather(meshccl_comm* comm, const void* send, void* recv, size_t count, meshccl_dtype dtype);
MESHCCL_API int meshccl_reduce_scatter(meshccl_comm* comm, const void* send, void* recv, size_t count, meshccl_dtype dtype,
                           meshccl_op op);
MESHCCL_API int meshccl_broadcast(meshccl_comm* comm, void* buf, size_t count, meshccl_dtype dtype, int root);
MESHCCL_API int meshccl_send(meshccl_comm* comm, const void* buf, size_t count, meshccl_dtype dtype, int dst);
MESHCCL_API int meshccl_recv(meshccl_comm* comm, void* buf, size_t count, meshccl_dtype dtype, int src);
MESHCCL_API int meshccl_barrier(meshccl_comm* comm);

#ifdef __cplusplus
}
#endif

#endif /* MESHCCL_MESHCCL_H_ */
