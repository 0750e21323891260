// qkv::AttentionOptions as Python sees it: enums as strings, arrays held
// (so the views stay valid while a call runs), one struct shared by the
// forward, the backward and decoding.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "arrays.hpp"
#include "qkv/attention.hpp"

namespace qkv::python {

struct Options {
  std::string score = "scaled_dot";          // "scaled_dot", "dot" or "additive"
  std::optional<double> scale;               // scaled_dot: default 1/sqrt(Dk)
  std::optional<In> additive_w_q;            // additive: [A, Dq]
  std::optional<In> additive_w_k;            // additive: [A, Dk]
  std::optional<In> additive_v;              // additive: [A]
  std::optional<In> additive_bias;           // additive: [A], optional
  bool causal = false;                       // drop keys after the query's position
  std::string align = "bottom_right";        // "bottom_right" or "top_left"
  std::int64_t window_left = -1;             // -1 = unbounded
  std::int64_t window_right = -1;            // -1 = unbounded
  std::optional<Ints> key_lengths;           // [B] valid keys per sequence
  std::optional<Ints> cu_seqlens_q;          // [S + 1] packed query offsets
  std::optional<Ints> cu_seqlens_k;          // [S + 1] packed key offsets
  std::optional<In> mask;                    // bool (true = attend) or float (added)
  std::optional<Floats> alibi_slopes;        // [Hq] or [B * Hq]
  std::optional<In> rel_bias_table;          // [Hq, num_buckets]
  std::int64_t rel_bias_max_distance = 128;  // T5 bucket limit
  bool rel_bias_bidirectional = true;        // false: keys after the query share bucket 0
  double softcap = 0.0;                      // c > 0: c * tanh(s / c)
  double dropout_p = 0.0;                    // probability of zeroing a weight
  std::uint64_t dropout_seed = 0;            // key of the dropout generator
  std::uint32_t dropout_offset = 0;          // counter offset
  std::string backend = "automatic";         // "automatic", "reference" or "fast"
  SparsePattern sparse;                      // undefined = off

  // The C++ options; views and spans point into the arrays held here.
  AttentionOptions to_cpp() const;
};

// String to enum, throwing qkv::Error naming the argument and the choices.
Score parse_score(const std::string& s);
Align parse_align(const std::string& s);
Backend parse_backend(const std::string& s);

}  // namespace qkv::python
