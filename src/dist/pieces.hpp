// What ring and all-to-all attention compute between their messages, with
// no transport in sight: the geometry of a shard layout, this rank's half of
// the collective checks (its reasons and the values every rank must agree
// on), which (query chunk, key chunk) pairs the masks admit, the options of
// each piece, a ring step's pieces merged into the running result (forward)
// or their gradients accumulated (backward), and the options of an
// all-to-all rank's heads. qkv::dist moves shards over MPI around these
// (shards.hpp, ring.cpp, ulysses.cpp); qkv.context_parallel moves them over
// torch.distributed (python/src/shards.cpp binds these). Part of libqkv.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/problem.hpp"
#include "core/query_maps.hpp"
#include "qkv/attention.hpp"
#include "qkv/shard_layout.hpp"

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

// A value every rank must pass alike, by the name a message gives it.
struct Agreed {
  std::string name;
  std::int64_t value;
};

// This rank's half of a collective check: the geometry, what is wrong with
// this rank's inputs alone (`reasons`), the values the ranks compare
// (shapes, dtype, layout, every option), and the checks of the whole
// problem (`whole`), which speak for every rank once they agree.
struct LocalCheck {
  Setup setup;
  Reasons reasons;
  std::vector<Agreed> agreed;
  Reasons whole;
};
LocalCheck check_locally(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         const AttentionOptions& options, const CallSpec& spec, int rank,
                         int ranks);

// The geometry of inputs that passed the collective check (every rank
// agreed, nobody had a reason); throws the reasons otherwise.
Setup setup_of(ConstTensorView q, ConstTensorView k, ConstTensorView v,
               const AttentionOptions& options, const CallSpec& spec, int rank, int ranks);

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

// The options of an all-to-all rank's Hq / R heads over the whole sequence:
// dropout sees global heads, ALiBi, sinks and the maps of the queries the
// values of those heads (ALiBi's copied into `slopes`).
AttentionOptions head_options(const AttentionOptions& o, const Setup& s,
                              std::vector<float>& slopes);

// Maps of the queries on a ring (core/query_maps.hpp): this rank's query
// rows, each with its keys in the whole problem. Each step maps the rank's
// queries with them and runs its pieces without the maps, so the backward
// steps accumulate dq', the gradient of the mapped queries;
// finish_query_maps turns it into dq in place and returns this rank's rows'
// shares of the maps' parameter gradients (stat dtype; the whole problem's
// are the sums over the ranks; none without maps).
std::vector<qkv::detail::QueryRow> shard_query_rows(const Setup& s, const AttentionOptions& o);
template <class Real>
AttentionGradients finish_query_maps(const Setup& s, const AttentionOptions& o, ConstTensorView q,
                                     Real* dq);

// Pieces a ring step computed and pairs it skipped (no query could attend).
struct PieceCounts {
  std::int64_t computed = 0;
  std::int64_t skipped = 0;
};

// Query rows per kernel call of a ring step; `between` runs between calls
// (MPI drives its transfers in flight there).
inline constexpr std::int64_t kRowsPerCall = 1024;

// One forward ring step: this rank's queries q [B, nq, Hq, Dk] against the
// shard of rank `holder`, k [B, nk, Hkv, Dk] and v [B, nk, Hkv, Dv], every
// piece the masks admit merged by logsumexp into the running result: acc
// [B, nq, Hq, Dv] and acc_lse [B, Hq, nq], contiguous, of Real (f32, or
// f64 for f64 inputs), starting at 0 and -inf.
template <class Real>
void ring_forward_step(const Setup& s, const AttentionOptions& o,
                       const std::vector<BatchGroup>& groups, int holder, ConstTensorView q,
                       ConstTensorView k, ConstTensorView v, Real* acc, Real* acc_lse,
                       PieceCounts& counts, const std::function<void()>& between);

// Adds each head's sink to the denominators of the merged rows, once, after
// the last step (the pieces have none).
template <class Real>
void add_sinks(const Setup& s, std::span<const float> sinks, Real* acc, Real* acc_lse);

// One backward ring step: the gradients of this rank's rows against the
// shard of `holder` (q, out, dout, lse this rank's; k, v the held shard's)
// added into dq [B, nq, Hq, Dk] (with maps of the queries: dq', see
// finish_query_maps) and into the held shard's dk [B, nk, Hkv, Dk] and dv
// [B, nk, Hkv, Dv], contiguous, of Real.
template <class Real>
void ring_backward_step(const Setup& s, const AttentionOptions& o,
                        const std::vector<BatchGroup>& groups, int holder, ConstTensorView q,
                        ConstTensorView k, ConstTensorView v, ConstTensorView out,
                        ConstTensorView dout, ConstTensorView lse, Real* dq, Real* dk, Real* dv,
                        PieceCounts& counts, const std::function<void()>& between);

// This rank's rows' part of d_sinks [Hq] (stat dtype); the whole problem's
// is the sum over the ranks.
Tensor local_sink_gradients(const Setup& s, ConstTensorView out, ConstTensorView dout,
                            ConstTensorView lse, const AttentionOptions& o);

// Element moves between strided views and contiguous accumulators of Real.
template <class Real>
void add_into(ConstTensorView src, Real* dst, const qkv::Shape& dst_strides);
template <class Real>
void store_from(const Real* src, const qkv::Shape& src_strides, TensorView dst);

}  // namespace qkv::dist::detail
