// Ring attention: K/V shards travel rank r -> r + 1; at step t rank r holds
// the shard of rank r - t (mod R), attends to it with qkv::attention (global
// positions through options.shard) and merges the piece into its running
// result by logsumexp (core/softmax_epilogue.hpp); learned sinks join the
// merged rows once, at the end. The backward sends dK/dV accumulators one
// step behind their shards.
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "core/parameters.hpp"
#include "dist/shards.hpp"
#include "qkv/distributed.hpp"

namespace qkv::dist {
namespace {

using detail::BatchGroup;
using detail::Setup;

constexpr int kTagKv = 0x5171;      // K/V shard, hop to the next rank
constexpr int kTagGrad = 0x5172;    // dK/dV accumulator, hop to the next rank
constexpr int kTagReturn = 0x5173;  // dK/dV accumulator, back to its owner

// A contiguous buffer holding [B, nk, Hkv, Dk] followed by [B, nk, Hkv, Dv].
struct PairBuffer {
  Tensor storage;
  TensorView first, second;
  std::int64_t bytes = 0;

  PairBuffer(DType dtype, const Setup& s)
      : storage(dtype, {s.batch * s.nk * s.hkv * (s.dk + s.dv)}) {
    auto* base = static_cast<std::byte*>(storage.view().data());
    const std::int64_t split = s.batch * s.nk * s.hkv * s.dk;
    first = TensorView(base, dtype, {s.batch, s.nk, s.hkv, s.dk});
    second = TensorView(base + split * static_cast<std::int64_t>(dtype_size(dtype)), dtype,
                        {s.batch, s.nk, s.hkv, s.dv});
    bytes = storage.numel() * static_cast<std::int64_t>(dtype_size(dtype));
  }
  void zero() { std::fill_n(static_cast<std::byte*>(storage.view().data()), bytes, std::byte{0}); }
  template <class Real>
  Real* first_data() {
    return static_cast<Real*>(first.data());
  }
  template <class Real>
  Real* second_data() {
    return static_cast<Real*>(second.data());
  }
};

int mod(int a, int n) { return ((a % n) + n) % n; }

// MPI moves a large message only while a rank is inside an MPI call, so
// between a step's kernel calls (detail::kRowsPerCall query rows each) the
// ring drives the transfers in flight (MPI_Testall): they then overlap the
// compute instead of starting when it ends.
// Lets MPI progress the transfers in flight, without waiting.
void progress(std::vector<MPI_Request>* const* lists, int n) {
  for (int i = 0; i < n; ++i) {
    std::vector<MPI_Request>& r = *lists[i];
    if (r.empty()) continue;
    int done = 0;
    MPI_Testall(static_cast<int>(r.size()), r.data(), &done, MPI_STATUSES_IGNORE);
  }
}

void count(const detail::PieceCounts& counts, RingStats& st) {
  st.pieces_computed += counts.computed;
  st.pieces_skipped += counts.skipped;
}

// Posts step t's K/V transfers: the held shard on to rank r + 1 while a
// later rank needs it, and the receive of step t + 1's shard from r - 1
// when this rank will hold one.
void post_kv_transfers(MPI_Comm comm, const Setup& s, const std::vector<int>& last, int t,
                       PairBuffer& cur, PairBuffer& next, std::vector<MPI_Request>& sends,
                       std::vector<MPI_Request>& receives, RingStats& st) {
  const int r = s.rank, ranks = s.ranks;
  if (t < last[static_cast<std::size_t>(mod(r - t, ranks))]) {
    detail::post_send(cur.storage.view().data(), cur.bytes, mod(r + 1, ranks), kTagKv, comm, sends);
    st.bytes_sent += cur.bytes;
    ++st.messages_sent;
  }
  if (t + 1 < ranks && t + 1 <= last[static_cast<std::size_t>(mod(r - t - 1, ranks))]) {
    detail::post_recv(next.storage.view().data(), next.bytes, mod(r - 1, ranks), kTagKv, comm,
                      receives);
    ++st.receives;
  }
}

template <class Real>
AttentionResult ring_forward(MPI_Comm comm, const Setup& s, ConstTensorView q, ConstTensorView k,
                             ConstTensorView v, const AttentionOptions& o, RingStats& st) {
  const std::vector<BatchGroup> groups = detail::batch_groups(s, o);
  const std::vector<int> last = detail::last_holders(s, o, groups);
  const int r = s.rank, ranks = s.ranks;
  std::vector<Real> acc(static_cast<std::size_t>(s.batch * s.nq * s.hq * s.dv), Real(0));
  std::vector<Real> acc_lse(static_cast<std::size_t>(s.batch * s.hq * s.nq),
                            -std::numeric_limits<Real>::infinity());
  PairBuffer cur(s.dtype, s), next(s.dtype, s);
  copy(k, cur.first);
  copy(v, cur.second);
  std::vector<MPI_Request> sends, receives;
  for (int t = 0; t < ranks; ++t) {
    const int holder = mod(r - t, ranks);
    const bool holding = t <= last[static_cast<std::size_t>(holder)];
    post_kv_transfers(comm, s, last, t, cur, next, sends, receives, st);
    const double start = MPI_Wtime();
    if (holding) {
      detail::PieceCounts counts;
      detail::ring_forward_step<Real>(s, o, groups, holder, q, cur.first, cur.second, acc.data(),
                                      acc_lse.data(), counts, [&] {
                                        std::vector<MPI_Request>* lists[] = {&sends, &receives};
                                        progress(lists, 2);
                                      });
      count(counts, st);
    }
    const double computed = MPI_Wtime();
    st.compute_s += computed - start;
    if (!receives.empty()) {
      int done = 0;
      MPI_Testall(static_cast<int>(receives.size()), receives.data(), &done, MPI_STATUSES_IGNORE);
      if (done) ++st.arrived_early;
    }
    detail::wait_all(receives);
    detail::wait_all(sends);
    st.wait_s += MPI_Wtime() - computed;
    std::swap(cur, next);
  }
  if (!o.sinks.empty()) detail::add_sinks<Real>(s, o.sinks, acc.data(), acc_lse.data());
  AttentionResult result;
  result.out = Tensor(s.dtype, {s.batch, s.nq, s.hq, s.dv});
  detail::store_from(acc.data(), contiguous_strides(result.out.sizes()), result.out);
  if (o.return_lse) {
    result.lse = Tensor(s.stat_dtype, {s.batch, s.hq, s.nq});
    detail::store_from(acc_lse.data(), contiguous_strides(result.lse.sizes()), result.lse);
  }
  return result;
}

template <class Real>
AttentionGradients ring_backward(MPI_Comm comm, const Setup& s, ConstTensorView q,
                                 ConstTensorView k, ConstTensorView v, ConstTensorView out,
                                 ConstTensorView dout, ConstTensorView lse,
                                 const AttentionOptions& o, RingStats& st) {
  const std::vector<BatchGroup> groups = detail::batch_groups(s, o);
  const std::vector<int> last = detail::last_holders(s, o, groups);
  const int r = s.rank, ranks = s.ranks;
  const DType real = sizeof(Real) == 8 ? DType::f64 : DType::f32;
  std::vector<Real> dq(static_cast<std::size_t>(s.batch * s.nq * s.hq * s.dk), Real(0));
  const Shape dq_strides = contiguous_strides(Shape{s.batch, s.nq, s.hq, s.dk});
  PairBuffer cur(s.dtype, s), next(s.dtype, s);
  copy(k, cur.first);
  copy(v, cur.second);
  // This step's contribution to the held shard's dK/dV, two accumulators
  // that alternate (one may still be in flight), and the owner's result.
  PairBuffer mine(real, s), grads[2] = {PairBuffer(real, s), PairBuffer(real, s)};
  PairBuffer own(real, s);
  const Shape dk_strides = contiguous_strides(Shape{s.batch, s.nk, s.hkv, s.dk});
  const Shape dv_strides = contiguous_strides(Shape{s.batch, s.nk, s.hkv, s.dv});
  std::vector<MPI_Request> kv_sends, kv_receives, grad_sends[2], grad_receives, returns;
  const int own_last = last[static_cast<std::size_t>(r)];
  if (own_last > 0) {
    detail::post_recv(own.storage.view().data(), own.bytes, mod(r + own_last, ranks), kTagReturn,
                      comm, returns);
    ++st.receives;
  }
  for (int t = 0; t < ranks; ++t) {
    const int holder = mod(r - t, ranks);
    const int holder_last = last[static_cast<std::size_t>(holder)];
    const bool holding = t <= holder_last;
    PairBuffer& acc = grads[t % 2];
    post_kv_transfers(comm, s, last, t, cur, next, kv_sends, kv_receives, st);
    if (holding && t > 0) {
      detail::wait_all(grad_sends[t % 2]);  // the buffer's previous use has left
      detail::post_recv(acc.storage.view().data(), acc.bytes, mod(r - 1, ranks), kTagGrad, comm,
                        grad_receives);
      ++st.receives;
    }
    const double start = MPI_Wtime();
    if (holding) {
      mine.zero();
      detail::PieceCounts counts;
      detail::ring_backward_step<Real>(
          s, o, groups, holder, q, cur.first, cur.second, out, dout, lse, dq.data(),
          mine.first_data<Real>(), mine.second_data<Real>(), counts, [&] {
            std::vector<MPI_Request>* lists[] = {&kv_sends,      &kv_receives,   &grad_sends[0],
                                                 &grad_sends[1], &grad_receives, &returns};
            progress(lists, 6);
          });
      count(counts, st);
    }
    const double computed = MPI_Wtime();
    st.compute_s += computed - start;
    if (!kv_receives.empty() || !grad_receives.empty()) {
      int kv_done = 1, grad_done = 1;
      if (!kv_receives.empty()) {
        MPI_Testall(static_cast<int>(kv_receives.size()), kv_receives.data(), &kv_done,
                    MPI_STATUSES_IGNORE);
      }
      if (!grad_receives.empty()) {
        MPI_Testall(static_cast<int>(grad_receives.size()), grad_receives.data(), &grad_done,
                    MPI_STATUSES_IGNORE);
      }
      if (kv_done && grad_done) ++st.arrived_early;
    }
    detail::wait_all(grad_receives);
    st.wait_s += MPI_Wtime() - computed;
    if (holding) {
      // The accumulator of the held shard: what earlier ranks added, then
      // this rank's part, always in ring order.
      const double add_start = MPI_Wtime();
      if (t == 0) acc.zero();
      const std::int64_t n = acc.storage.numel();
      Real* a = static_cast<Real*>(acc.storage.view().data());
      const Real* m = static_cast<const Real*>(mine.storage.view().data());
      for (std::int64_t i = 0; i < n; ++i) a[i] += m[i];
      st.compute_s += MPI_Wtime() - add_start;
      if (t < holder_last) {
        detail::post_send(acc.storage.view().data(), acc.bytes, mod(r + 1, ranks), kTagGrad, comm,
                          grad_sends[t % 2]);
        st.bytes_sent += acc.bytes;
        ++st.messages_sent;
      } else if (t > 0) {
        detail::post_send(acc.storage.view().data(), acc.bytes, holder, kTagReturn, comm,
                          grad_sends[t % 2]);
        st.bytes_sent += acc.bytes;
        ++st.messages_sent;
      } else {  // nobody else attends to this shard
        std::memcpy(own.storage.view().data(), acc.storage.view().data(),
                    static_cast<std::size_t>(acc.bytes));
      }
    }
    const double waited = MPI_Wtime();
    detail::wait_all(kv_receives);
    detail::wait_all(kv_sends);
    st.wait_s += MPI_Wtime() - waited;
    std::swap(cur, next);
  }
  const double waited = MPI_Wtime();
  detail::wait_all(returns);
  detail::wait_all(grad_sends[0]);
  detail::wait_all(grad_sends[1]);
  st.wait_s += MPI_Wtime() - waited;
  // dq' to dq, and the maps' parameter gradients summed over the ranks.
  AttentionGradients result = detail::finish_query_maps(s, o, q, dq.data());
  for (const qkv::detail::ParameterRow& row : qkv::detail::parameter_rows(s.problem, o)) {
    Tensor& share = result.*row.tensor;
    if (share.defined()) share = detail::sum_over_ranks(comm, share);
  }
  result.dq = Tensor(s.dtype, {s.batch, s.nq, s.hq, s.dk});
  result.dk = Tensor(s.dtype, {s.batch, s.nk, s.hkv, s.dk});
  result.dv = Tensor(s.dtype, {s.batch, s.nk, s.hkv, s.dv});
  detail::store_from(dq.data(), dq_strides, result.dq);
  detail::store_from(own.first_data<Real>(), dk_strides, result.dk);
  detail::store_from(own.second_data<Real>(), dv_strides, result.dv);
  if (!o.sinks.empty()) result.d_sinks = detail::sink_gradients(comm, s, out, dout, lse, o);
  return result;
}

}  // namespace

AttentionResult ring_attention(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                               ConstTensorView v, const AttentionOptions& options,
                               const RingOptions& ring) {
  const double start = MPI_Wtime();
  const Setup s = detail::validate_collectively(
      comm, q, k, v, options, {.function = "ring_attention", .layout = ring.layout});
  RingStats st;
  AttentionResult result = s.dtype == DType::f64
                               ? ring_forward<double>(comm, s, q, k, v, options, st)
                               : ring_forward<float>(comm, s, q, k, v, options, st);
  st.total_s = MPI_Wtime() - start;
  if (ring.stats != nullptr) *ring.stats = st;
  return result;
}

AttentionGradients ring_attention_backward(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                           ConstTensorView v, ConstTensorView out,
                                           ConstTensorView dout, ConstTensorView lse,
                                           const AttentionOptions& options,
                                           const RingOptions& ring) {
  const double start = MPI_Wtime();
  const Setup s = detail::validate_collectively(comm, q, k, v, options,
                                                {.function = "ring_attention_backward",
                                                 .layout = ring.layout,
                                                 .backward = true,
                                                 .out = out,
                                                 .dout = dout,
                                                 .lse = lse});
  RingStats st;
  AttentionGradients result =
      s.dtype == DType::f64 ? ring_backward<double>(comm, s, q, k, v, out, dout, lse, options, st)
                            : ring_backward<float>(comm, s, q, k, v, out, dout, lse, options, st);
  st.total_s = MPI_Wtime() - start;
  if (ring.stats != nullptr) *ring.stats = st;
  return result;
}

}  // namespace qkv::dist
