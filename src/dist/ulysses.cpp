// All-to-all attention (DeepSpeed-Ulysses): sequence shards become head
// shards with one MPI_Alltoall per tensor, each rank runs qkv::attention
// (or its backward) on the whole sequence for its heads, and the results go
// back to sequence shards the same way.
#include <mpi.h>

#include <climits>
#include <cstddef>
#include <vector>

#include "core/parameters.hpp"
#include "dist/shards.hpp"
#include "qkv/distributed.hpp"

namespace qkv::dist {
namespace {

using detail::Setup;

// Exchanges equal-sized blocks: block p of `send` goes to rank p, and the
// block rank p sent this rank lands in recv[p]. Collective.
void all_to_all(MPI_Comm comm, const std::vector<ConstTensorView>& send,
                const std::vector<TensorView>& recv) {
  const std::int64_t block = send.front().numel();
  const DType dtype = send.front().dtype();
  const auto bytes = block * static_cast<std::int64_t>(dtype_size(dtype));
  if (bytes > INT_MAX) {
    // Shapes agree on every rank, so every rank throws here together.
    throw Error("q, k, v: one all-to-all block holds " + std::to_string(bytes) +
                " bytes, more than one MPI message carries (2^31 - 1); use more ranks or the "
                "ring");
  }
  const auto ranks = static_cast<std::int64_t>(send.size());
  Tensor out(dtype, {ranks * block}), in(dtype, {ranks * block});
  auto* out_base = static_cast<std::byte*>(out.view().data());
  auto* in_base = static_cast<std::byte*>(in.view().data());
  for (std::int64_t p = 0; p < ranks; ++p) {
    const ConstTensorView& b = send[static_cast<std::size_t>(p)];
    copy(b, TensorView(out_base + p * bytes, dtype, b.size_span()));
  }
  MPI_Alltoall(out_base, static_cast<int>(bytes), MPI_BYTE, in_base, static_cast<int>(bytes),
               MPI_BYTE, comm);
  for (std::int64_t p = 0; p < ranks; ++p) {
    const TensorView& b = recv[static_cast<std::size_t>(p)];
    copy(ConstTensorView(in_base + p * bytes, dtype, b.size_span()), b);
  }
}

// Cuts `t` into R equal blocks along `split` (block p goes to rank p) and
// joins the blocks received along `join` (rank p's block at position p):
// split 2, join 1 turns [B, n, H, D] sequence shards into [B, R n, H / R, D]
// head shards; split 1, join 2 turns them back; lse [B, H, n] uses 1 and 2
// the other way round. Collective.
Tensor regroup(MPI_Comm comm, const Setup& s, ConstTensorView t, int split, int join) {
  Shape sizes = t.sizes();
  const std::int64_t part = sizes[split] / s.ranks, joined = sizes[join];
  sizes[split] = part;
  sizes[join] = joined * s.ranks;
  Tensor result(t.dtype(), std::span<const std::int64_t>(sizes.data(), t.rank()));
  std::vector<ConstTensorView> send;
  std::vector<TensorView> recv;
  for (int p = 0; p < s.ranks; ++p) {
    send.push_back(t.slice(split, p * part, part));
    recv.push_back(result.view().slice(join, p * joined, joined));
  }
  all_to_all(comm, send, recv);
  return result;
}

Tensor to_heads(MPI_Comm comm, const Setup& s, ConstTensorView t) {
  return regroup(comm, s, t, 2, 1);
}
Tensor to_rows(MPI_Comm comm, const Setup& s, ConstTensorView t) {
  return regroup(comm, s, t, 1, 2);
}

}  // namespace

AttentionResult ulysses_attention(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                  ConstTensorView v, const AttentionOptions& options) {
  const Setup s = detail::validate_collectively(
      comm, q, k, v, options,
      {.function = "ulysses_attention", .layout = Layout::contiguous, .heads_divide = true});
  std::vector<float> slopes;
  AttentionOptions o = detail::head_options(options, s, slopes);
  o.return_lse = options.return_lse;
  const Tensor qh = to_heads(comm, s, q), kh = to_heads(comm, s, k), vh = to_heads(comm, s, v);
  const AttentionResult local = attention(qh, kh, vh, o);
  AttentionResult result;
  result.out = to_rows(comm, s, local.out);
  if (options.return_lse) result.lse = regroup(comm, s, local.lse, 2, 1);
  return result;
}

AttentionGradients ulysses_attention_backward(MPI_Comm comm, ConstTensorView q, ConstTensorView k,
                                              ConstTensorView v, ConstTensorView out,
                                              ConstTensorView dout, ConstTensorView lse,
                                              const AttentionOptions& options) {
  const Setup s = detail::validate_collectively(comm, q, k, v, options,
                                                {.function = "ulysses_attention_backward",
                                                 .layout = Layout::contiguous,
                                                 .heads_divide = true,
                                                 .backward = true,
                                                 .out = out,
                                                 .dout = dout,
                                                 .lse = lse});
  std::vector<float> slopes;
  const AttentionOptions o = detail::head_options(options, s, slopes);
  const Tensor qh = to_heads(comm, s, q), kh = to_heads(comm, s, k), vh = to_heads(comm, s, v);
  const Tensor oh = to_heads(comm, s, out), gh = to_heads(comm, s, dout);
  const Tensor lh = regroup(comm, s, lse, 1, 2);
  const AttentionGradients local = attention_backward(qh, kh, vh, oh, gh, lh, o);
  AttentionGradients result;
  result.dq = to_rows(comm, s, local.dq);
  result.dk = to_rows(comm, s, local.dk);
  result.dv = to_rows(comm, s, local.dv);
  // The parameters qkv::dist takes are per head ([Hq]): this rank's heads'
  // gradients, gathered in head order.
  for (const qkv::detail::ParameterRow& row : qkv::detail::parameter_rows(s.problem, options)) {
    if (!row.used) continue;
    const Tensor& mine = local.*row.tensor;
    Tensor& all = result.*row.tensor;
    all = Tensor(s.stat_dtype, row.sizes);
    const int count = static_cast<int>(mine.numel());
    const MPI_Datatype type = s.stat_dtype == DType::f64 ? MPI_DOUBLE : MPI_FLOAT;
    MPI_Allgather(mine.view().data(), count, type, all.view().data(), count, type, comm);
  }
  return result;
}

}  // namespace qkv::dist
