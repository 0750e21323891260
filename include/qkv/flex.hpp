// qkv/flex.hpp — FlexAttention-style score and mask callables, inlined.
//
//   auto score_mod = [](float s, std::int64_t b, std::int64_t h, std::int64_t i,
//                       std::int64_t j) { return s - 0.1f * float(i - j); };
//   auto mask_mod = [](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
//     return (i / 64) == (j / 64);  // block-diagonal
//   };
//   qkv::AttentionResult r = qkv::flex_attention(q, k, v, score_mod, mask_mod, options);
//
// Semantics are those of AttentionOptions::score_mod / mask_mod (see
// qkv/attention.hpp): score_mod(s, b, h, i, j) replaces the score after every
// built-in bias; mask_mod(b, h, i, j) == false drops key j. Unlike the
// std::function options, these templates are instantiated here, in the
// caller's code: the fast kernels call them once per tile of scores (a loop
// the compiler sees whole), never through a per-element indirect call, and
// evaluate mask_mod once per call to skip blocks it masks entirely.
// Pass qkv::no_score_mod or qkv::no_mask_mod for "none".
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "qkv/attention.hpp"

namespace qkv {

struct NoScoreMod {};
struct NoMaskMod {};
inline constexpr NoScoreMod no_score_mod{};
inline constexpr NoMaskMod no_mask_mod{};

namespace detail {

// A rectangle of scores for one sequence b and query head h: query positions
// i0 .. i0 + rows - 1 and keys j0 .. j0 + cols - 1; the score of (i0 + r,
// j0 + c) is scores[r * query_stride + c * key_stride].
struct ScoreBlock {
  float* scores;
  std::int64_t query_stride, key_stride;
  std::int64_t b, h, i0, rows, j0, cols;
  float& at(std::int64_t r, std::int64_t c) const {
    return scores[r * query_stride + c * key_stride];
  }
};

// Type-erased, tile-granular hooks built from the callables (null = none).
struct TileMods {
  const void* context = nullptr;
  // scores = score_mod(scores, b, h, i, j) over the block.
  void (*score_mod)(const void* context, const ScoreBlock& block) = nullptr;
  // scores = -inf wherever mask_mod(b, h, i, j) is false.
  void (*mask_mod)(const void* context, const ScoreBlock& block) = nullptr;
  // How many (i, j) of the block mask_mod admits (scores unused).
  std::int64_t (*admitted)(const void* context, const ScoreBlock& block) = nullptr;
};

template <class ScoreModFn, class MaskModFn>
struct FlexCallables {
  ScoreModFn score_mod;
  MaskModFn mask_mod;

  static void apply_score_mod(const void* context, const ScoreBlock& t) {
    const auto& f = static_cast<const FlexCallables*>(context)->score_mod;
    // Keys outer: the kernels store a block with queries contiguous.
    for (std::int64_t c = 0; c < t.cols; ++c) {
      for (std::int64_t r = 0; r < t.rows; ++r) {
        float& s = t.at(r, c);
        s = static_cast<float>(f(s, t.b, t.h, t.i0 + r, t.j0 + c));
      }
    }
  }
  static void apply_mask_mod(const void* context, const ScoreBlock& t) {
    const auto& f = static_cast<const FlexCallables*>(context)->mask_mod;
    for (std::int64_t c = 0; c < t.cols; ++c) {
      for (std::int64_t r = 0; r < t.rows; ++r) {
        if (!f(t.b, t.h, t.i0 + r, t.j0 + c)) t.at(r, c) = -std::numeric_limits<float>::infinity();
      }
    }
  }
  static std::int64_t count_admitted(const void* context, const ScoreBlock& t) {
    const auto& f = static_cast<const FlexCallables*>(context)->mask_mod;
    std::int64_t n = 0;
    for (std::int64_t r = 0; r < t.rows; ++r) {
      for (std::int64_t c = 0; c < t.cols; ++c) n += f(t.b, t.h, t.i0 + r, t.j0 + c) ? 1 : 0;
    }
    return n;
  }

  TileMods tile_mods() const {
    TileMods m;
    m.context = this;
    if constexpr (!std::is_same_v<ScoreModFn, NoScoreMod>) m.score_mod = &apply_score_mod;
    if constexpr (!std::is_same_v<MaskModFn, NoMaskMod>) {
      m.mask_mod = &apply_mask_mod;
      m.admitted = &count_admitted;
    }
    return m;
  }

  // The same callables as std::function options, for the reference backend.
  AttentionOptions with_options(AttentionOptions options) const {
    if constexpr (!std::is_same_v<ScoreModFn, NoScoreMod>) {
      if (options.score_mod) {
        throw Error("options.score_mod: must be empty when flex_attention is given a score_mod");
      }
      options.score_mod = [f = score_mod](double s, std::int64_t b, std::int64_t h, std::int64_t i,
                                          std::int64_t j) {
        return static_cast<double>(f(static_cast<float>(s), b, h, i, j));
      };
    }
    if constexpr (!std::is_same_v<MaskModFn, NoMaskMod>) {
      if (options.mask_mod) {
        throw Error("options.mask_mod: must be empty when flex_attention is given a mask_mod");
      }
      options.mask_mod = mask_mod;
    }
    return options;
  }
};

// Runs attention with tile hooks (fast backend) and the equivalent
// std::function options (reference backend).
void attention_with_mods(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         const AttentionOutputs& outputs, const AttentionOptions& options,
                         const TileMods& mods);
AttentionResult attention_with_mods(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                    const AttentionOptions& options, const TileMods& mods);

}  // namespace detail

// attention() with inlined score_mod / mask_mod callables. The options must
// not also set score_mod or mask_mod. Throws qkv::Error on invalid input.
template <class ScoreModFn, class MaskModFn>
AttentionResult flex_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               ScoreModFn score_mod, MaskModFn mask_mod,
                               const AttentionOptions& options = {}) {
  const detail::FlexCallables<ScoreModFn, MaskModFn> callables{score_mod, mask_mod};
  return detail::attention_with_mods(q, k, v, callables.with_options(options),
                                     callables.tile_mods());
}

// flex_attention() into caller-provided outputs.
template <class ScoreModFn, class MaskModFn>
void flex_attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         const AttentionOutputs& outputs, ScoreModFn score_mod, MaskModFn mask_mod,
                         const AttentionOptions& options = {}) {
  const detail::FlexCallables<ScoreModFn, MaskModFn> callables{score_mod, mask_mod};
  detail::attention_with_mods(q, k, v, outputs, callables.with_options(options),
                              callables.tile_mods());
}

}  // namespace qkv
