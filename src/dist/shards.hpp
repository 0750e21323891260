// What the ring and all-to-all functions share: the geometry of a shard
// layout, which (query chunk, key chunk) pairs the masks admit, the message
// schedule that follows from it, the collective validation, and the moves
// between strided views and the accumulators.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/problem.hpp"
#include "qkv/distributed.hpp"

namespace qkv::dist::detail {

using qkv::detail::Reasons;

// Rows [global, global + length) of the whole sequence, held by a rank at
// rows [local, local + length) of its shard.
struct Chunk {
  std::int64_t global = 0;
  std::int64_t local = 0;
  std::int64_t length = 0;
};

// The chunks rank `rank` of `ranks` holds when every shard has n rows.
std::vector<Chunk> chunks_of(Layout layout, int rank, int ranks, std::int64_t n);

// The validated geometry of a distributed call, the same on every rank.
struct Setup {
  int rank = 0, ranks = 1;
  std::int64_t batch = 0, nq = 0, nk = 0;  // shard rows
  std::int64_t hq = 0, hkv = 0, dk = 0, dv = 0;
  DType dtype = DType::f32;
  DType stat_dtype = DType::f32;  // of lse
  Layout layout = Layout::contiguous;
  qkv::detail::AttentionProblem problem;  // this rank's shard as one call
  std::int64_t total_q() const { return nq * ranks; }
  std::int64_t total_k() const { return nk * ranks; }
};

// What a distributed function validates, beyond the tensors themselves.
struct CallSpec {
  const char* function;                           // "ring_attention", ...
  Layout layout;                                  // the layout of the shards
  bool heads_divide = false;                      // all-to-all: Hq and Hkv multiples of R
  bool backward = false;                          // out, dout and lse are inputs too
  ConstTensorView out = {}, dout = {}, lse = {};  // when backward
};

// Validates this rank's inputs and that every rank passes the same shapes
// and options; collective. When any rank fails, every rank throws the same
// qkv::Error naming the first failing rank and its reasons.
Setup validate_collectively(MPI_Comm comm, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                            const AttentionOptions& options, const CallSpec& spec);

// A set of batch entries that share query positions and valid keys: all of
// them, or (with key_lengths) one at a time.
struct BatchGroup {
  std::int64_t b0 = 0, count = 0;
  std::int64_t delta = 0;       // p_i = global row + delta
  std::int64_t valid_keys = 0;  // keys [0, valid_keys) may be admitted
};
std::vector<BatchGroup> batch_groups(const Setup& s, const AttentionOptions& o);

// Whether any query of chunk `qc` may attend to any key of chunk `kc`
// (conservative: true may still admit nothing; false never drops a key).
bool may_attend(const AttentionOptions& o, const BatchGroup& g, const Chunk& qc, const Chunk& kc);

// Whether rank a's queries attend to any key of rank x's shard.
bool needs(const Setup& s, const AttentionOptions& o, const std::vector<BatchGroup>& groups, int a,
           int x);

// The ring's schedule: shard x visits ranks x, x + 1, ... (mod R); the last
// visit that is needed is step last_holder(x), after which it travels no
// further (its gradient accumulator goes straight back to x).
std::vector<int> last_holders(const Setup& s, const AttentionOptions& o,
                              const std::vector<BatchGroup>& groups);

// The options of one (query chunk, key chunk) piece: global positions and
// dropout coordinates through options.shard, key lengths local to the chunk
// (into `lengths`), per-sequence slopes of the group, and no sinks (the
// ring adds them once, to the merged rows).
AttentionOptions piece_options(const AttentionOptions& o, const Setup& s, const BatchGroup& g,
                               const Chunk& qc, const Chunk& kc,
                               std::vector<std::int64_t>& lengths);

// d_sinks of the whole problem on every rank: each rank's rows' part
// (reference::sink_gradients), summed over the ranks. Collective.
Tensor sink_gradients(MPI_Comm comm, const Setup& s, ConstTensorView out, ConstTensorView dout,
                      ConstTensorView lse, const AttentionOptions& options);

// Element moves between strided views and contiguous accumulators of Real.
template <class Real>
void add_into(ConstTensorView src, Real* dst, const qkv::Shape& dst_strides);
template <class Real>
void store_from(const Real* src, const qkv::Shape& src_strides, TensorView dst);

// Non-blocking transfers of a byte buffer, split into messages of at most
// 1 GiB (MPI counts are int). Appends the requests.
void post_send(const void* data, std::int64_t bytes, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);
void post_recv(void* data, std::int64_t bytes, int source, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);
// Waits for every request and clears the list.
void wait_all(std::vector<MPI_Request>& requests);

}  // namespace qkv::dist::detail
