// qkv/sparse.hpp — sparse attention patterns run by the fused kernels.
//
//   qkv::AttentionOptions opt;
//   opt.causal = true;
//   opt.sparse = qkv::SparsePattern::window(256, 0) |           // Longformer: a local window
//                qkv::SparsePattern::global_tokens({0, 1, 2});  // plus tokens seen by and seeing
//                all
//   qkv::AttentionResult r = qkv::attention(q, k, v, opt);
//
// A pattern decides, for query head h, query row i of a sequence (its
// position on the key axis p = p_i, as in qkv/attention.hpp) and key j,
// whether j may be attended to. It is one more mask: key j is dropped unless
// the pattern admits it *and* every other mask of the options does, so the
// result is exactly dense attention with the equivalent bool mask (which is
// what the reference backend computes). The fused kernels classify each
// (query tile, key tile) once per call from the pattern's parameters, skip the
// tiles it leaves empty without touching them, and mask element-wise only in
// the tiles it cuts, so a pattern with w keys per row costs O(N * w), never
// O(N^2). With d = p - j (how far key j lies before the query):
//
//   window(left, right)                 -right <= d <= left (-1: unbounded side)
//   dilated_window(left, right, r)      d = t * r for some t in [-right, left]
//                                       (Longformer's dilation: every r-th key)
//   strided(l)                          |d| < l or d a multiple of l
//                                       (Sparse Transformer's strided pattern)
//   fixed(l, c)                         floor(j / l) == floor(p / l), or key j
//                                       one of the last c of its block of l
//                                       (Sparse Transformer's fixed pattern)
//   global_tokens(T)                    p in T or j in T (attend to and from all)
//   prefix(n)                           j < n (the first n keys, seen by every query)
//   prefix_lm(n)                        prefix(n) | window(-1, 0): bidirectional
//                                       over a prefix of n keys, causal after it
//                                       (T5's prefix LM, PaliGemma); use it
//                                       without options.causal, which would cut
//                                       the prefix keys after a query
//   block_sparse(layout)                layout(h, i / bs, j / bs) set (bs the
//                                       layout's block size; i is the query row)
//   a | b, or_patterns({...})           admitted by any (FlexAttention or_masks)
//   a & b, and_patterns({...})          admitted by all (FlexAttention and_masks)
//
// Sparse Transformer's patterns are autoregressive: use them with
// options.causal = true, which drops d < 0. Plain windows are cheapest as
// options.window_left / window_right (a range, not a mask); window() exists
// to be composed. Patterns are immutable values; copies share their nodes.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace qkv {

// A block-sparse layout: block (h, a, b) set means query rows
// [a * block_size, (a + 1) * block_size) of head h may attend to keys
// [b * block_size, (b + 1) * block_size). One head broadcasts to all.
struct BlockLayout {
  std::int64_t heads = 1;          // 1 (shared by every query head) or Hq
  std::int64_t q_blocks = 0;       // query blocks: at least ceil(Nq / block_size)
  std::int64_t k_blocks = 0;       // key blocks: at least ceil(Nk / block_size)
  std::int64_t block_size = 0;     // rows and keys per block, >= 1
  std::vector<std::uint8_t> bits;  // [heads][q_blocks][k_blocks], nonzero = attend

  bool at(std::int64_t h, std::int64_t a, std::int64_t b) const {
    return bits[static_cast<std::size_t>(((heads == 1 ? 0 : h) * q_blocks + a) * k_blocks + b)] !=
           0;
  }
};

// BigBird's block layout (Zaheer et al. 2020) for one attention call.
struct BigBirdConfig {
  std::int64_t heads = 1;          // layouts to draw (1 = shared by all heads)
  std::int64_t nq = 0;             // query rows
  std::int64_t nk = 0;             // keys
  std::int64_t block_size = 64;    // rows and keys per block
  std::int64_t window_blocks = 1;  // key blocks on each side of the diagonal block
  std::int64_t global_blocks = 1;  // leading blocks that attend to and from all
  std::int64_t random_blocks = 2;  // extra key blocks per query block, drawn per head
  std::uint64_t seed = 0;          // the draw is a pure function of the seed
};

// Builds the layout over q_blocks = ceil(nq / block_size) query blocks and
// k_blocks = ceil(nk / block_size) key blocks: query block a sees the key
// blocks b with |b - d(a)| <= window_blocks around its diagonal block
// d(a) = a + (k_blocks - q_blocks) (the diagonal aligned at the bottom right,
// in block units, as Align::bottom_right aligns rows; d(a) = a when
// nq == nk), the first global_blocks key blocks, and random_blocks others
// drawn without replacement; the first global_blocks query blocks see every
// key block. Throws qkv::Error on bad parameters.
BlockLayout bigbird_layout(const BigBirdConfig& config);

namespace detail {
struct SparseNode;
}

// An immutable attention pattern (see the header). Default-constructed means
// "off" (admits everything) and cannot be composed.
class SparsePattern {
 public:
  SparsePattern() = default;

  // Each factory throws qkv::Error on an invalid parameter.
  static SparsePattern window(std::int64_t left, std::int64_t right);
  static SparsePattern dilated_window(std::int64_t left, std::int64_t right, std::int64_t dilation);
  static SparsePattern strided(std::int64_t stride);
  static SparsePattern fixed(std::int64_t block, std::int64_t summary);
  static SparsePattern global_tokens(std::vector<std::int64_t> tokens);
  static SparsePattern prefix(std::int64_t length);
  static SparsePattern prefix_lm(std::int64_t prefix_length);
  static SparsePattern block_sparse(BlockLayout layout);

  bool defined() const { return node_ != nullptr; }
  // Whether query head h, query row i at key-axis position p may attend to
  // key j (true when undefined). The reference backend's definition.
  bool admits(std::int64_t h, std::int64_t i, std::int64_t p, std::int64_t j) const;
  // A one-line description, e.g. "window(256, 0) | global_tokens(3 tokens)".
  std::string describe() const;

  const detail::SparseNode* node() const { return node_.get(); }

  friend SparsePattern or_patterns(std::initializer_list<SparsePattern> patterns);
  friend SparsePattern and_patterns(std::initializer_list<SparsePattern> patterns);

 private:
  explicit SparsePattern(std::shared_ptr<const detail::SparseNode> node) : node_(std::move(node)) {}
  std::shared_ptr<const detail::SparseNode> node_;
};

// Union and intersection of defined patterns (at least one); throw
// qkv::Error on an undefined one.
SparsePattern or_patterns(std::initializer_list<SparsePattern> patterns);
SparsePattern and_patterns(std::initializer_list<SparsePattern> patterns);
inline SparsePattern operator|(const SparsePattern& a, const SparsePattern& b) {
  return or_patterns({a, b});
}
inline SparsePattern operator&(const SparsePattern& a, const SparsePattern& b) {
  return and_patterns({a, b});
}

}  // namespace qkv
