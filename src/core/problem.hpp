// The resolved geometry of an attention call, which validation
// (api/validate.hpp) produces and every backend consumes: sizes, heads, the
// scale, dtypes and the extent of each sequence. A primitive: it neither
// checks nor computes anything.
#pragma once

#include <cstdint>
#include <span>

#include "qkv/attention.hpp"

namespace qkv::detail {

// The longest sequence (Nq, Nk) a call may have: positions p_i and their
// differences p_i - j then stay far inside int64, so mask and pattern
// arithmetic on them cannot overflow. No backed tensor comes near; only
// empty or broadcast views could ask for more.
inline constexpr std::int64_t kMaxSequence = (std::int64_t{1} << 60) - 1;

// Rows of one sequence (a batch entry, or a packed sequence in varlen mode).
struct SequenceExtent {
  std::int64_t q_begin = 0;  // first query row in q's dimension 1
  std::int64_t nq = 0;       // query rows
  std::int64_t k_begin = 0;  // first key row in k's and v's dimension 1
  std::int64_t nk_rows = 0;  // key rows present in k and v
  std::int64_t nk = 0;       // valid keys (key_lengths, else nk_rows)
  std::int64_t batch = 0;    // index into dimension 0 of q, k, v, out
};

// The geometry of a validated attention call.
struct AttentionProblem {
  std::int64_t batch = 0;      // q.size(0)
  std::int64_t sequences = 0;  // batch, or S in varlen mode
  std::int64_t nq = 0;         // q.size(1) (total rows in varlen mode)
  std::int64_t nk = 0;         // k.size(1)
  std::int64_t hq = 0;
  std::int64_t hkv = 0;
  std::int64_t dq = 0;  // q's head dim (differs from dk only for additive scores)
  std::int64_t dk = 0;
  std::int64_t dv = 0;
  std::int64_t attention_size = 0;  // A of the additive score
  bool varlen = false;
  // The sequences' offsets and valid keys: views of the call's
  // options.cu_seqlens_q, cu_seqlens_k and key_lengths (valid while they are).
  std::span<const std::int64_t> cu_seqlens_q, cu_seqlens_k, key_lengths;
  double scale = 1.0;             // multiplies <q, k> (1 for Score::dot)
  DType dtype = DType::f32;       // of q, k, v and out
  DType stat_dtype = DType::f32;  // of lse and probs

  std::int64_t group() const { return hkv == 0 ? 0 : hq / hkv; }
  SequenceExtent sequence(std::int64_t s) const;
};

}  // namespace qkv::detail
