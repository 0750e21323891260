// What the kernels and validation need from a SparsePattern: per-tile
// coverage (decided from the pattern's parameters, never element by
// element), per-tile element masks, and the checks against a problem.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "qkv/sparse.hpp"

namespace qkv::detail {

// A rectangle of (query row, key) pairs of one query head: rows i0 .. i0 +
// rows - 1 at key-axis positions p0 .. p0 + rows - 1, keys j0 .. j0 + cols - 1.
struct PatternTile {
  std::int64_t h = 0;
  std::int64_t i0 = 0, rows = 0;
  std::int64_t p0 = 0;
  std::int64_t j0 = 0, cols = 0;
};

// How much of a tile a pattern admits. `some` may also be returned for a
// tile that is in fact empty or full (it is always safe), never the reverse.
enum class Coverage : std::uint8_t { none, some, all };

Coverage coverage(const SparsePattern& pattern, const PatternTile& tile);

// Keys [begin, end) (empty when begin >= end).
struct KeyInterval {
  std::int64_t begin = 0, end = 0;
};

// An interval of keys of [j0, j0 + cols) holding every key that row i (at
// position p) of head h may attend to: exact for windows, global tokens and
// layouts, at worst the whole range. The kernels compute only these keys.
KeyInterval row_key_span(const SparsePattern& pattern, std::int64_t h, std::int64_t i,
                         std::int64_t p, std::int64_t j0, std::int64_t cols);

// keep[c * tile.rows + r] = whether row r may attend to key c of the tile.
void fill_admitted(const SparsePattern& pattern, const PatternTile& tile, std::uint8_t* keep);

// Sets scores[r * query_stride + c * key_stride] to -inf for every pair of
// the tile the pattern rejects.
void mask_rejected(const SparsePattern& pattern, const PatternTile& tile, float* scores,
                   std::int64_t query_stride, std::int64_t key_stride);

// Whether the pattern reads the query row i (a block layout somewhere in it),
// not only positions: decode, whose query rows are not the sequence's, takes
// only patterns that do not.
bool uses_query_rows(const SparsePattern& pattern);

// Appends a reason for each block layout of the pattern that does not fit
// `hq` query heads or does not cover a sequence of nq[s] rows and nk[s] keys.
void check_sparse(const SparsePattern& pattern, std::int64_t hq,
                  const std::vector<std::int64_t>& nq, const std::vector<std::int64_t>& nk,
                  std::vector<std::string>& reasons);

// A dilated window alone is, for each residue class c of the dilation r, a
// plain sliding window over rows c, c + r, c + 2r, ... of q, k and v (with
// d = p - j = r (t - s) for class indices t, s): r window problems on
// strided views, in which no masked pair is computed. That holds when
// nothing else depends on positions or indices: a dense batch with Nq == Nk,
// no key lengths, masks, callables, ALiBi, relative bias, window options or
// dropout. `dilation` is 0 when the split does not apply.
struct DilatedSplit {
  std::int64_t dilation = 0;
  std::int64_t left = 0, right = 0;  // the window in class indices

  // The options of each class's problem: the window instead of the pattern.
  AttentionOptions window_options(AttentionOptions options) const {
    options.sparse = {};
    options.window_left = left;
    options.window_right = right;
    return options;
  }

  // Calls run(rows) for each class c of a problem with nq query rows, where
  // rows(t, dim) views rows c, c + dilation, ... of t's dimension `dim`;
  // returns whether every call returned true.
  template <class Run>
  bool for_each_class(std::int64_t nq, Run&& run) const;
};
DilatedSplit dilated_split(const AttentionProblem& problem, const AttentionOptions& options);

// Rows start, start + step, ... of dimension `dim` of t (no copy).
template <bool Const>
BasicTensorView<Const> every_nth(const BasicTensorView<Const>& t, int dim, std::int64_t start,
                                 std::int64_t step);

template <class Run>
bool DilatedSplit::for_each_class(std::int64_t nq, Run&& run) const {
  bool all = true;
  for (std::int64_t c = 0; c < std::min(dilation, nq); ++c) {
    all &= run([&](auto t, int dim) { return every_nth(t, dim, c, dilation); });
  }
  return all;
}

template <bool Const>
BasicTensorView<Const> every_nth(const BasicTensorView<Const>& t, int dim, std::int64_t start,
                                 std::int64_t step) {
  if (!t.defined()) return t;
  Shape sizes = t.sizes(), strides = t.strides();
  const std::int64_t rest = start < t.size(dim) ? t.size(dim) - start : 0;
  sizes[dim] = rest / step + (rest % step != 0 ? 1 : 0);
  // With two rows or more, step < size and the product stays inside t's extent.
  if (sizes[dim] > 1) strides[dim] = t.stride(dim) * step;
  const auto bytes = static_cast<std::int64_t>(dtype_size(t.dtype()));
  auto* base = static_cast<std::conditional_t<Const, const std::byte*, std::byte*>>(t.data());
  return BasicTensorView<Const>(sizes[dim] > 0 ? base + start * t.stride(dim) * bytes : base,
                                t.dtype(), std::span<const std::int64_t>(sizes.data(), t.rank()),
                                std::span<const std::int64_t>(strides.data(), t.rank()));
}

}  // namespace qkv::detail
