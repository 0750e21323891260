// qkv/distributed.hpp — context-parallel attention over MPI: one long
// sequence split by its sequence axis across the R ranks of a communicator.
// Built when CMake finds MPI (target qkv::dist, option QKV_WITH_MPI); the
// rest of the library never depends on it. docs/distributed.md has the
// pictures, the message schedule and the scaling model.
//
// Every rank passes its own shard of q, k, v in the usual layout
// (qkv/attention.hpp), the same shapes and options on every rank:
//   q    [B, nq, Hq,  Dk]     rows of the rank's shard of the query sequence
//   k    [B, nk, Hkv, Dk]     rows of the rank's shard of the key sequence
//   v    [B, nk, Hkv, Dv]
//   out  [B, nq, Hq,  Dv]     the rank's shard of the output, rows as in q
//   lse  [B, Hq, nq]          f32 (f64 for f64 inputs)
// The whole problem has Nq = R * nq query rows and Nk = R * nk keys, in the
// order of `Layout`. Options speak of the whole problem: positions, causal
// alignment, windows, key_lengths ([B], each <= Nk), ALiBi and the dropout
// mask are global, so the gathered result equals one qkv::attention call on
// the gathered inputs (within the merge's rounding: parts are added in a
// different order, docs/distributed.md gives the error model).
//
// Supported options: scaled_dot and dot scores, scale, causal (both
// alignments), window_left/right, key_lengths, alibi_slopes ([Hq] or
// [B * Hq]), softcap, dropout, backend, return_lse. Not supported (a
// qkv::Error says so): masks, varlen packing, relative bias, additive
// scores, score_mod/mask_mod, sparse patterns, return_probs, and a nonzero
// options.shard (the distributed functions set it).
//
// Errors are collective: every check runs on every rank, including that all
// ranks agree on shapes, dtypes and options (return_lse included), and when any rank's input is bad
// every rank throws the same qkv::Error, naming the first bad rank, before any message is sent. A
// call never deadlocks on bad input. All ranks must call the same function in the same order, as
// with any MPI collective. Threads: the kernels use OpenMP threads as qkv::attention does; MPI is
// called only from the calling thread (MPI_THREAD_FUNNELED suffices).
#pragma once

#include <mpi.h>

#include <cstdint>

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/shard_layout.hpp"

namespace qkv::dist {

// Where one ring call's time went on this rank (seconds, wall clock).
struct RingStats {
  double compute_s = 0;              // in the attention kernels and merges
  double wait_s = 0;                 // blocked in MPI_Wait: transfers not hidden
  double total_s = 0;                // the whole call, validation included
  std::int64_t bytes_sent = 0;       // payload this rank sent
  std::int64_t messages_sent = 0;    // point-to-point messages this rank sent
  std::int64_t pieces_computed = 0;  // (query chunk, key chunk) kernel calls
  std::int64_t pieces_skipped = 0;   // pairs no query could attend to
  std::int64_t arrived_early = 0;    // receives complete before compute ended
  std::int64_t receives = 0;         // receives posted
};

// Options of the ring functions beyond AttentionOptions.
struct RingOptions {
  Layout layout = Layout::contiguous;  // the shard layout of q, k, v (and out)
  RingStats* stats = nullptr;          // filled in when given
};

// Ring attention (Liu et al., 2023). K/V shards travel around the ring with
// non-blocking messages, the next one's transfer overlapped with the kernel
// on the current one; a rank computes only the (query, key) chunk pairs its
// masks admit, and a shard is sent only to ranks that need it or pass it on
// to one that does. Partial results merge by logsumexp. Returns this rank's
// out (and lse when options.return_lse).
AttentionResult ring_attention(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                               ConstTensorView v, const AttentionOptions& options = {},
                               const RingOptions& ring = {});

// Gradients of ring_attention: given this rank's shards of q, k, v, out,
// dout and lse (all from the forward), returns this rank's dq, dk, dv, and
// with options.sinks d_sinks [Hq] of the whole problem (the same on every
// rank). K/V shards travel as in the forward; dK/dV accumulators follow one
// step behind and end at their owner after R steps; dq stays local. Bitwise
// deterministic for a given rank count, layout and thread count.
AttentionGradients ring_attention_backward(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                           ConstTensorView v, ConstTensorView out,
                                           ConstTensorView dout, ConstTensorView lse,
                                           const AttentionOptions& options = {},
                                           const RingOptions& ring = {});

// All-to-all attention (DeepSpeed-Ulysses): MPI_Alltoall turns the
// sequence-sharded q, k, v (contiguous layout) into head-sharded ones, each
// rank attends over the whole sequence for Hq / R query heads (Hkv / R KV
// heads), and a second all-to-all returns the output to sequence shards.
// Hq and Hkv must be multiples of R.
AttentionResult ulysses_attention(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                  ConstTensorView v, const AttentionOptions& options = {});

// Gradients of ulysses_attention, with the same exchanges around
// qkv::attention_backward; d_sinks as ring_attention_backward's.
AttentionGradients ulysses_attention_backward(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                              ConstTensorView v, ConstTensorView out,
                                              ConstTensorView dout, ConstTensorView lse,
                                              const AttentionOptions& options = {});

}  // namespace qkv::dist
