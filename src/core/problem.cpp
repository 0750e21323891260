#include "core/problem.hpp"

namespace qkv::detail {

SequenceExtent AttentionProblem::sequence(std::int64_t s, const AttentionOptions& o) const {
  SequenceExtent e;
  if (varlen) {
    const auto i = static_cast<std::size_t>(s);
    e.q_begin = o.cu_seqlens_q[i];
    e.nq = o.cu_seqlens_q[i + 1] - e.q_begin;
    e.k_begin = o.cu_seqlens_k[i];
    e.nk_rows = o.cu_seqlens_k[i + 1] - e.k_begin;
    e.batch = 0;
  } else {
    e.nq = nq;
    e.nk_rows = nk;
    e.batch = s;
  }
  e.nk = o.key_lengths.empty() ? e.nk_rows : o.key_lengths[static_cast<std::size_t>(s)];
  return e;
}

}  // namespace qkv::detail
