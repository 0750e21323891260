#include "core/problem.hpp"

namespace qkv::detail {

SequenceExtent AttentionProblem::sequence(std::int64_t s) const {
  SequenceExtent e;
  if (varlen) {
    const auto i = static_cast<std::size_t>(s);
    e.q_begin = cu_seqlens_q[i];
    e.nq = cu_seqlens_q[i + 1] - e.q_begin;
    e.k_begin = cu_seqlens_k[i];
    e.nk_rows = cu_seqlens_k[i + 1] - e.k_begin;
    e.batch = 0;
  } else {
    e.nq = nq;
    e.nk_rows = nk;
    e.batch = s;
  }
  e.nk = key_lengths.empty() ? e.nk_rows : key_lengths[static_cast<std::size_t>(s)];
  return e;
}

}  // namespace qkv::detail
