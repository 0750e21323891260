// Sparse attention patterns: the element-wise definition (admits), tile
// coverage from the parameters alone, tile masks, and BigBird layouts.
#include "core/sparse.hpp"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <new>
#include <numeric>

#include "core/capabilities.hpp"
#include "core/checks.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace detail {

struct SparseNode {
  enum class Kind : std::uint8_t {
    window,
    dilated,
    strided,
    fixed,
    global,
    prefix,
    layout,
    any,
    all
  };
  Kind kind = Kind::window;
  // window: left, right; dilated: left, right, dilation; strided: stride;
  // fixed: block, summary; prefix: length.
  std::int64_t a = 0, b = 0, c = 0;
  std::vector<std::int64_t> tokens;                         // global: sorted, unique
  BlockLayout layout;                                       // layout
  std::vector<std::shared_ptr<const SparseNode>> children;  // any, all
};

namespace {

using Kind = SparseNode::Kind;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
// Bands reaching this far count as unbounded: validation keeps positions
// below 2^60 (kMaxSequence), so |p - j| never comes near.
constexpr std::int64_t kUnbounded = kMax / 4;

// Pattern parameters may be as large as int64 allows, so sums and products
// with them saturate, and divisions never form x + m - 1 (m > 0 throughout).
std::int64_t sat_add(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return b > 0 ? kMax : std::numeric_limits<std::int64_t>::min();
}
std::int64_t sat_mul(std::int64_t a, std::int64_t b) {  // a, b >= 0
  std::int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kMax : r;
}
std::int64_t floor_div(std::int64_t x, std::int64_t m) {
  return x >= 0 ? x / m : -1 - (-(x + 1)) / m;
}
std::int64_t floor_mod(std::int64_t x, std::int64_t m) {
  const std::int64_t r = x % m;
  return r < 0 ? r + m : r;
}
std::int64_t ceil_div(std::int64_t x, std::int64_t m) {  // x >= 0
  return x / m + (x % m != 0 ? 1 : 0);
}

// Tokens of a sorted list in [lo, hi].
std::int64_t count_in(const std::vector<std::int64_t>& t, std::int64_t lo, std::int64_t hi) {
  return std::upper_bound(t.begin(), t.end(), hi) - std::lower_bound(t.begin(), t.end(), lo);
}
bool contains(const std::vector<std::int64_t>& t, std::int64_t x) {
  return std::binary_search(t.begin(), t.end(), x);
}

// The band lo <= d <= hi of d = p - j, as window-like nodes see it.
struct Band {
  std::int64_t lo, hi;
};
Band band_of(const SparseNode& n) {
  const std::int64_t step = n.kind == Kind::dilated ? n.c : 1;
  return {n.b < 0 ? -kUnbounded : -std::min(sat_mul(n.b, step), kUnbounded),
          n.a < 0 ? kUnbounded : std::min(sat_mul(n.a, step), kUnbounded)};
}

bool admits(const SparseNode& n, std::int64_t h, std::int64_t i, std::int64_t p, std::int64_t j) {
  const std::int64_t d = p - j;
  switch (n.kind) {
    case Kind::window:
    case Kind::dilated: {
      const Band band = band_of(n);
      return band.lo <= d && d <= band.hi && (n.kind == Kind::window || d % n.c == 0);
    }
    case Kind::strided:
      return (d < n.a && -d < n.a) || d % n.a == 0;
    case Kind::fixed:
      return floor_div(p, n.a) == floor_div(j, n.a) || floor_mod(j, n.a) >= n.a - n.b;
    case Kind::global:
      return contains(n.tokens, p) || contains(n.tokens, j);
    case Kind::prefix:
      return j < n.a;
    case Kind::layout: {
      const std::int64_t bs = n.layout.block_size;
      return i >= 0 && j >= 0 && i / bs < n.layout.q_blocks && j / bs < n.layout.k_blocks &&
             n.layout.at(h, i / bs, j / bs);
    }
    case Kind::any:
      return std::any_of(n.children.begin(), n.children.end(),
                         [&](const auto& c) { return admits(*c, h, i, p, j); });
    case Kind::all:
      return std::all_of(n.children.begin(), n.children.end(),
                         [&](const auto& c) { return admits(*c, h, i, p, j); });
  }
  return false;
}

Coverage coverage_of(const SparseNode& n, const PatternTile& t) {
  if (t.rows <= 0 || t.cols <= 0) return Coverage::none;
  const std::int64_t p1 = t.p0 + t.rows - 1;
  const std::int64_t j1 = t.j0 + t.cols - 1;
  // Every d = p - j in [dmin, dmax] occurs in the tile.
  const std::int64_t dmin = t.p0 - j1;
  const std::int64_t dmax = p1 - t.j0;
  switch (n.kind) {
    case Kind::window:
    case Kind::dilated: {
      const Band band = band_of(n);
      const std::int64_t lo = std::max(dmin, band.lo);
      const std::int64_t hi = std::min(dmax, band.hi);
      if (lo > hi) return Coverage::none;
      if (n.kind == Kind::dilated && n.c > 1) {
        // Some multiple of the dilation in [lo, hi]?
        return floor_div(hi, n.c) * n.c >= lo ? Coverage::some : Coverage::none;
      }
      return lo == dmin && hi == dmax ? Coverage::all : Coverage::some;
    }
    case Kind::strided: {
      const std::int64_t l = n.a;
      if (l == 1) return Coverage::all;
      // Outside (-l, l) every d must be a multiple: each part outside is then
      // a single point (l >= 2 leaves gaps between multiples).
      const auto single_multiple = [l](std::int64_t lo, std::int64_t hi) {
        return lo > hi || (lo == hi && lo % l == 0);
      };
      if (single_multiple(dmin, std::min(dmax, -l)) && single_multiple(std::max(dmin, l), dmax)) {
        return Coverage::all;
      }
      const bool near = dmin < l && dmax > -l;
      const bool multiple = floor_div(dmax, l) * l >= dmin;
      return near || multiple ? Coverage::some : Coverage::none;
    }
    case Kind::fixed: {
      const std::int64_t l = n.a, c = n.b;
      const std::int64_t m0 = floor_mod(t.j0, l), m1 = m0 + (t.cols - 1);
      const bool summary_any = c > 0 && (t.cols >= l || m1 >= l - c);
      const bool summary_all = c == l || (m0 >= l - c && m1 <= l - 1);
      const std::int64_t rb0 = floor_div(t.p0, l), rb1 = floor_div(p1, l);
      const std::int64_t kb0 = floor_div(t.j0, l), kb1 = floor_div(j1, l);
      const bool same_any = rb0 <= kb1 && kb0 <= rb1;
      const bool same_all = rb0 == rb1 && kb0 == kb1 && rb0 == kb0;
      if (summary_all || same_all) return Coverage::all;
      return summary_any || same_any ? Coverage::some : Coverage::none;
    }
    case Kind::global: {
      const std::int64_t rows_in = count_in(n.tokens, t.p0, p1);
      const std::int64_t keys_in = count_in(n.tokens, t.j0, j1);
      if (rows_in == t.rows || keys_in == t.cols) return Coverage::all;
      return rows_in > 0 || keys_in > 0 ? Coverage::some : Coverage::none;
    }
    case Kind::prefix:
      if (j1 < n.a) return Coverage::all;
      return t.j0 >= n.a ? Coverage::none : Coverage::some;
    case Kind::layout: {
      const BlockLayout& L = n.layout;
      const std::int64_t bs = L.block_size;
      const std::int64_t a0 = std::max<std::int64_t>(t.i0, 0) / bs;
      const std::int64_t a1 = std::min((t.i0 + t.rows - 1) / bs, L.q_blocks - 1);
      const std::int64_t b0 = std::max<std::int64_t>(t.j0, 0) / bs;
      const std::int64_t b1 = std::min(j1 / bs, L.k_blocks - 1);
      std::int64_t set = 0;
      for (std::int64_t a = a0; a <= a1; ++a) {
        for (std::int64_t b = b0; b <= b1; ++b) set += L.at(t.h, a, b) ? 1 : 0;
      }
      if (set == 0) return Coverage::none;
      const bool inside =
          t.i0 >= 0 && t.j0 >= 0 && (t.i0 + t.rows - 1) / bs < L.q_blocks && j1 / bs < L.k_blocks;
      return inside && set == (a1 - a0 + 1) * (b1 - b0 + 1) ? Coverage::all : Coverage::some;
    }
    case Kind::any:
    case Kind::all: {
      // A union is covered by one covering child, an intersection emptied
      // by one empty child; otherwise a child covering some makes it some.
      const bool any = n.kind == Kind::any;
      const Coverage decides = any ? Coverage::all : Coverage::none;
      Coverage result = any ? Coverage::none : Coverage::all;
      for (const auto& child : n.children) {
        const Coverage c = coverage_of(*child, t);
        if (c == decides) return decides;
        if (c == Coverage::some) result = Coverage::some;
      }
      return result;
    }
  }
  return Coverage::some;
}

// The keys of [j0, j1] row (h, i, p) may attend to lie in the result.
KeyInterval span_of(const SparseNode& n, std::int64_t h, std::int64_t i, std::int64_t p,
                    std::int64_t j0, std::int64_t j1) {
  const KeyInterval all{j0, j1 + 1};
  const KeyInterval none{j0, j0};
  const auto clip = [&](std::int64_t a, std::int64_t b) {  // [a, b] within [j0, j1]
    return KeyInterval{std::max(a, j0), std::min(b, j1) + 1};
  };
  switch (n.kind) {
    case Kind::window:
    case Kind::dilated: {
      const Band band = band_of(n);
      return clip(band.hi >= kUnbounded ? j0 : p - band.hi,
                  band.lo <= -kUnbounded ? j1 : p - band.lo);
    }
    case Kind::strided: {
      // The near band, and the keys j = p (mod l) from the first to the last.
      const std::int64_t l = n.a;
      const KeyInterval near = clip(sat_add(p, 1 - l), sat_add(p, l - 1));
      const KeyInterval far = clip(sat_add(j0, floor_mod(p - j0, l)), j1 - floor_mod(j1 - p, l));
      if (near.begin >= near.end) return far;
      if (far.begin >= far.end) return near;
      return {std::min(near.begin, far.begin), std::max(near.end, far.end)};
    }
    case Kind::fixed: {
      const std::int64_t l = n.a, c = n.b;
      const std::int64_t start = floor_div(p, l) * l;
      KeyInterval span = clip(start, start + l - 1);
      if (c > 0) {
        // The first and last summary keys (j mod l >= l - c) in [j0, j1].
        const std::int64_t first = floor_mod(j0, l) >= l - c ? j0 : floor_div(j0, l) * l + l - c;
        const std::int64_t last = floor_mod(j1, l) >= l - c ? j1 : floor_div(j1, l) * l - 1;
        const KeyInterval summary = clip(first, last);
        if (summary.begin < summary.end) {
          span = span.begin < span.end ? KeyInterval{std::min(span.begin, summary.begin),
                                                     std::max(span.end, summary.end)}
                                       : summary;
        }
      }
      return span;
    }
    case Kind::global: {
      if (contains(n.tokens, p)) return all;
      const auto first = std::lower_bound(n.tokens.begin(), n.tokens.end(), j0);
      const auto last = std::upper_bound(n.tokens.begin(), n.tokens.end(), j1);
      if (first == last) return none;
      return {*first, *(last - 1) + 1};
    }
    case Kind::prefix:
      return clip(j0, n.a - 1);
    case Kind::layout: {
      const BlockLayout& L = n.layout;
      const std::int64_t bs = L.block_size, a = i / bs;
      std::int64_t lo = -1, hi = -1;
      for (std::int64_t b = j0 / bs; b <= std::min(j1 / bs, L.k_blocks - 1); ++b) {
        if (!L.at(h, a, b)) continue;
        if (lo < 0) lo = b;
        hi = b;
      }
      if (lo < 0) return none;
      return clip(lo * bs, hi * bs + bs - 1);
    }
    case Kind::any:
    case Kind::all: {
      const bool any = n.kind == Kind::any;
      KeyInterval span = any ? none : all;
      for (const auto& child : n.children) {
        const KeyInterval c = span_of(*child, h, i, p, j0, j1);
        if (any) {
          if (c.begin >= c.end) continue;
          span = span.begin >= span.end
                     ? c
                     : KeyInterval{std::min(span.begin, c.begin), std::max(span.end, c.end)};
        } else {
          span = {std::max(span.begin, c.begin), std::min(span.end, c.end)};
        }
      }
      return span;
    }
  }
  return all;
}

// Sets keep[r] = 1 for r in [lo, hi] clipped to [0, rows), every `step`-th
// from lo.
void set_rows(std::uint8_t* keep, std::int64_t rows, std::int64_t lo, std::int64_t hi,
              std::int64_t step = 1) {
  if (lo < 0) lo = floor_mod(lo, step);  // the first of lo, lo + step, ... that is >= 0
  hi = std::min(hi, rows - 1);
  if (step == 1) {
    if (lo <= hi) std::fill(keep + lo, keep + hi + 1, 1);
    return;
  }
  for (std::int64_t r = lo; r <= hi; r += step) {
    keep[r] = 1;
    if (hi - r < step) break;
  }
}

void fill(const SparseNode& n, const PatternTile& t, std::uint8_t* keep) {
  const std::int64_t rows = t.rows;
  const auto size = static_cast<std::size_t>(rows * t.cols);
  switch (n.kind) {
    case Kind::window:
    case Kind::dilated: {
      // Row r sees key j iff lo <= p0 + r - j <= hi (and, dilated, on the grid).
      std::fill_n(keep, size, 0);
      const Band band = band_of(n);
      const std::int64_t step = n.kind == Kind::dilated ? n.c : 1;
      for (std::int64_t c = 0; c < t.cols; ++c) {
        const std::int64_t base = t.j0 + c - t.p0;  // r = base + d
        const std::int64_t lo = band.lo <= -kUnbounded ? 0 : base + band.lo;
        const std::int64_t hi = band.hi >= kUnbounded ? rows - 1 : base + band.hi;
        // First r >= lo with (r - base) a multiple of step.
        const std::int64_t first = lo + floor_mod(base - lo, step);
        set_rows(keep + c * rows, rows, first, hi, step);
      }
      return;
    }
    case Kind::strided: {
      std::fill_n(keep, size, 0);
      const std::int64_t l = n.a;
      for (std::int64_t c = 0; c < t.cols; ++c) {
        const std::int64_t base = t.j0 + c - t.p0;
        set_rows(keep + c * rows, rows, sat_add(base, 1 - l), sat_add(base, l - 1));
        set_rows(keep + c * rows, rows, floor_mod(base, l), rows - 1, l);
      }
      return;
    }
    case Kind::fixed: {
      std::fill_n(keep, size, 0);
      const std::int64_t l = n.a;
      for (std::int64_t c = 0; c < t.cols; ++c) {
        const std::int64_t j = t.j0 + c;
        if (floor_mod(j, l) >= l - n.b) {
          std::fill_n(keep + c * rows, rows, 1);
        } else {
          const std::int64_t start = floor_div(j, l) * l;
          set_rows(keep + c * rows, rows, start - t.p0, sat_add(start - t.p0, l - 1));
        }
      }
      return;
    }
    case Kind::global: {
      std::vector<std::uint8_t> row_global(static_cast<std::size_t>(rows));
      for (std::int64_t r = 0; r < rows; ++r) row_global[r] = contains(n.tokens, t.p0 + r);
      for (std::int64_t c = 0; c < t.cols; ++c) {
        if (contains(n.tokens, t.j0 + c)) {
          std::fill_n(keep + c * rows, rows, 1);
        } else {
          std::copy(row_global.begin(), row_global.end(), keep + c * rows);
        }
      }
      return;
    }
    case Kind::prefix:
      for (std::int64_t c = 0; c < t.cols; ++c) {
        std::fill_n(keep + c * rows, rows, t.j0 + c < n.a ? 1 : 0);
      }
      return;
    case Kind::layout: {
      // A run of rows per query block: rows [first, last] of block a.
      const BlockLayout& L = n.layout;
      const std::int64_t bs = L.block_size;
      for (std::int64_t c = 0; c < t.cols; ++c) {
        const std::int64_t b = (t.j0 + c) / bs;
        for (std::int64_t r = 0; r < rows;) {
          const std::int64_t a = (t.i0 + r) / bs;
          const std::int64_t end = std::min(rows, (a + 1) * bs - t.i0);
          const bool set = a < L.q_blocks && b < L.k_blocks && L.at(t.h, a, b);
          std::fill(keep + c * rows + r, keep + c * rows + end, set ? 1 : 0);
          r = end;
        }
      }
      return;
    }
    case Kind::any:
    case Kind::all: {
      // Children that cover the tile wholly (or not at all) need no mask.
      const bool any = n.kind == Kind::any;
      std::fill_n(keep, size, any ? 0 : 1);
      std::vector<std::uint8_t> part;
      for (const auto& child : n.children) {
        const Coverage c = coverage_of(*child, t);
        if (c == (any ? Coverage::all : Coverage::none)) {
          std::fill_n(keep, size, any ? 1 : 0);
          return;
        }
        if (c != Coverage::some) continue;
        part.resize(size);
        fill(*child, t, part.data());
        for (std::size_t x = 0; x < size; ++x)
          keep[x] = any ? (keep[x] | part[x]) : (keep[x] & part[x]);
      }
      return;
    }
  }
}

std::string describe_node(const SparseNode& n) {
  const auto num = [](std::int64_t x) { return std::to_string(x); };
  switch (n.kind) {
    case Kind::window:
      return "window(" + num(n.a) + ", " + num(n.b) + ")";
    case Kind::dilated:
      return "dilated_window(" + num(n.a) + ", " + num(n.b) + ", " + num(n.c) + ")";
    case Kind::strided:
      return "strided(" + num(n.a) + ")";
    case Kind::fixed:
      return "fixed(" + num(n.a) + ", " + num(n.b) + ")";
    case Kind::global:
      return "global_tokens(" + num(static_cast<std::int64_t>(n.tokens.size())) + " tokens)";
    case Kind::prefix:
      return "prefix(" + num(n.a) + ")";
    case Kind::layout:
      return "block_sparse(" + num(n.layout.heads) + "x" + num(n.layout.q_blocks) + "x" +
             num(n.layout.k_blocks) + " blocks of " + num(n.layout.block_size) + ")";
    case Kind::any:
    case Kind::all: {
      std::string text = "(";
      for (std::size_t c = 0; c < n.children.size(); ++c) {
        if (c > 0) text += n.kind == Kind::any ? " | " : " & ";
        text += describe_node(*n.children[c]);
      }
      return text + ")";
    }
  }
  return {};
}

void check_layouts(const SparseNode& n, std::int64_t hq, const std::vector<std::int64_t>& nq,
                   const std::vector<std::int64_t>& nk, std::vector<std::string>& reasons) {
  for (const auto& child : n.children) check_layouts(*child, hq, nq, nk, reasons);
  if (n.kind != Kind::layout) return;
  const BlockLayout& L = n.layout;
  if (L.heads != 1 && L.heads != hq) {
    reasons.push_back("options.sparse: block layout has " + std::to_string(L.heads) +
                      " heads; expected 1 or Hq = " + std::to_string(hq));
  }
  for (std::size_t s = 0; s < nq.size(); ++s) {
    const std::int64_t need_q = ceil_div(nq[s], L.block_size);
    const std::int64_t need_k = ceil_div(nk[s], L.block_size);
    if (L.q_blocks < need_q || L.k_blocks < need_k) {
      reasons.push_back("options.sparse: block layout of " + std::to_string(L.q_blocks) + "x" +
                        std::to_string(L.k_blocks) + " blocks of " + std::to_string(L.block_size) +
                        " does not cover sequence " + std::to_string(s) + " (" +
                        std::to_string(nq[s]) + " queries, " + std::to_string(nk[s]) +
                        " keys: needs " + std::to_string(need_q) + "x" + std::to_string(need_k) +
                        ")");
      return;
    }
  }
}

}  // namespace

Coverage coverage(const SparsePattern& pattern, const PatternTile& tile) {
  if (!pattern.defined()) return Coverage::all;
  return coverage_of(*pattern.node(), tile);
}

KeyInterval row_key_span(const SparsePattern& pattern, std::int64_t h, std::int64_t i,
                         std::int64_t p, std::int64_t j0, std::int64_t cols) {
  if (!pattern.defined() || cols <= 0) return {j0, j0 + cols};
  return span_of(*pattern.node(), h, i, p, j0, j0 + cols - 1);
}

void fill_admitted(const SparsePattern& pattern, const PatternTile& tile, std::uint8_t* keep) {
  if (!pattern.defined()) {
    std::fill_n(keep, static_cast<std::size_t>(tile.rows * tile.cols), 1);
    return;
  }
  fill(*pattern.node(), tile, keep);
}

void mask_rejected(const SparsePattern& pattern, const PatternTile& tile, float* scores,
                   std::int64_t query_stride, std::int64_t key_stride) {
  if (!pattern.defined()) return;
  thread_local std::vector<std::uint8_t> keep;
  keep.resize(static_cast<std::size_t>(tile.rows * tile.cols));
  fill(*pattern.node(), tile, keep.data());
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::int64_t c = 0; c < tile.cols; ++c) {
    const std::uint8_t* k = keep.data() + c * tile.rows;
    float* s = scores + c * key_stride;
    if (query_stride == 1) {
      // A select rather than a conditional store, so that it vectorizes.
      for (std::int64_t r = 0; r < tile.rows; ++r) s[r] = k[r] != 0 ? s[r] : neg_inf;
    } else {
      for (std::int64_t r = 0; r < tile.rows; ++r) {
        if (k[r] == 0) s[r * query_stride] = neg_inf;
      }
    }
  }
}

DilatedSplit dilated_split(const AttentionProblem& p, const AttentionOptions& o) {
  const SparseNode* n = o.sparse.node();
  if (n == nullptr || n->kind != Kind::dilated || n->c < 2) return {};
  const bool positions_free = !p.varlen && p.nq == p.nk && supports_all(Path::dilated_split, o);
  if (!positions_free) return {};
  return {n->c, n->a, n->b};
}

namespace {
bool has_layout(const SparseNode& n) {
  return n.kind == Kind::layout ||
         std::any_of(n.children.begin(), n.children.end(),
                     [](const auto& child) { return has_layout(*child); });
}
}  // namespace

bool uses_query_rows(const SparsePattern& pattern) {
  return pattern.defined() && has_layout(*pattern.node());
}

void check_sparse(const SparsePattern& pattern, std::int64_t hq,
                  const std::vector<std::int64_t>& nq, const std::vector<std::int64_t>& nk,
                  std::vector<std::string>& reasons) {
  if (pattern.defined()) check_layouts(*pattern.node(), hq, nq, nk, reasons);
}

}  // namespace detail

namespace {

using detail::SparseNode;

std::shared_ptr<SparseNode> make_node(SparseNode::Kind kind, std::int64_t a = 0, std::int64_t b = 0,
                                      std::int64_t c = 0) {
  auto n = std::make_shared<SparseNode>();
  n->kind = kind;
  n->a = a;
  n->b = b;
  n->c = c;
  return n;
}

void require(bool ok, const std::string& reason) {
  if (!ok) throw Error(reason);
}

std::shared_ptr<const SparseNode> combine(
    SparseNode::Kind kind, const char* name,
    const std::vector<std::shared_ptr<const SparseNode>>& nodes) {
  require(!nodes.empty(), std::string(name) + ": needs at least one pattern");
  auto n = make_node(kind);
  for (const auto& node : nodes) {
    require(node != nullptr, std::string(name) + ": a pattern is undefined (default-constructed)");
    // Flatten nested unions (intersections) into one level.
    if (node->kind == kind) {
      n->children.insert(n->children.end(), node->children.begin(), node->children.end());
    } else {
      n->children.push_back(node);
    }
  }
  return n;
}

}  // namespace

SparsePattern SparsePattern::window(std::int64_t left, std::int64_t right) {
  require(left >= -1 && right >= -1,
          "SparsePattern::window: left and right must be >= 0 (or -1 for unbounded); got " +
              std::to_string(left) + ", " + std::to_string(right));
  return SparsePattern(make_node(SparseNode::Kind::window, left, right));
}

SparsePattern SparsePattern::dilated_window(std::int64_t left, std::int64_t right,
                                            std::int64_t dilation) {
  require(left >= 0 && right >= 0 && dilation >= 1,
          "SparsePattern::dilated_window: left and right must be >= 0 and dilation >= 1; got " +
              std::to_string(left) + ", " + std::to_string(right) + ", " +
              std::to_string(dilation));
  return SparsePattern(make_node(SparseNode::Kind::dilated, left, right, dilation));
}

SparsePattern SparsePattern::strided(std::int64_t stride) {
  require(stride >= 1,
          "SparsePattern::strided: stride must be >= 1; got " + std::to_string(stride));
  return SparsePattern(make_node(SparseNode::Kind::strided, stride));
}

SparsePattern SparsePattern::fixed(std::int64_t block, std::int64_t summary) {
  require(block >= 1 && summary >= 0 && summary <= block,
          "SparsePattern::fixed: need block >= 1 and 0 <= summary <= block; got " +
              std::to_string(block) + ", " + std::to_string(summary));
  return SparsePattern(make_node(SparseNode::Kind::fixed, block, summary));
}

SparsePattern SparsePattern::global_tokens(std::vector<std::int64_t> tokens) {
  for (const std::int64_t t : tokens) {
    require(t >= 0,
            "SparsePattern::global_tokens: positions must be >= 0; got " + std::to_string(t));
  }
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  auto n = make_node(SparseNode::Kind::global);
  n->tokens = std::move(tokens);
  return SparsePattern(n);
}

SparsePattern SparsePattern::prefix(std::int64_t length) {
  require(length >= 0, "SparsePattern::prefix: length must be >= 0; got " + std::to_string(length));
  return SparsePattern(make_node(SparseNode::Kind::prefix, length));
}

SparsePattern SparsePattern::prefix_lm(std::int64_t prefix_length) {
  require(prefix_length >= 0, "SparsePattern::prefix_lm: prefix_length must be >= 0; got " +
                                  std::to_string(prefix_length));
  return prefix(prefix_length) | window(-1, 0);
}

SparsePattern SparsePattern::block_sparse(BlockLayout layout) {
  require(
      layout.heads >= 1 && layout.q_blocks >= 0 && layout.k_blocks >= 0 && layout.block_size >= 1,
      "SparsePattern::block_sparse: need heads >= 1, q_blocks >= 0, k_blocks >= 0 and "
      "block_size >= 1");
  std::int64_t cells = 0;
  require(detail::checked_product({layout.heads, layout.q_blocks, layout.k_blocks}, cells),
          "SparsePattern::block_sparse: heads * q_blocks * k_blocks = " +
              std::to_string(layout.heads) + " * " + std::to_string(layout.q_blocks) + " * " +
              std::to_string(layout.k_blocks) + " overflows int64");
  require(static_cast<std::int64_t>(layout.bits.size()) == cells,
          "SparsePattern::block_sparse: bits has " + std::to_string(layout.bits.size()) +
              " entries; expected heads * q_blocks * k_blocks = " + std::to_string(cells));
  auto n = make_node(SparseNode::Kind::layout);
  n->layout = std::move(layout);
  return SparsePattern(n);
}

bool SparsePattern::admits(std::int64_t h, std::int64_t i, std::int64_t p, std::int64_t j) const {
  return node_ == nullptr || detail::admits(*node_, h, i, p, j);
}

std::string SparsePattern::describe() const {
  return node_ == nullptr ? "none" : detail::describe_node(*node_);
}

SparsePattern or_patterns(std::initializer_list<SparsePattern> patterns) {
  std::vector<std::shared_ptr<const SparseNode>> nodes;
  for (const SparsePattern& p : patterns) nodes.push_back(p.node_);
  return SparsePattern(combine(SparseNode::Kind::any, "or_patterns", nodes));
}

SparsePattern and_patterns(std::initializer_list<SparsePattern> patterns) {
  std::vector<std::shared_ptr<const SparseNode>> nodes;
  for (const SparsePattern& p : patterns) nodes.push_back(p.node_);
  return SparsePattern(combine(SparseNode::Kind::all, "and_patterns", nodes));
}

BlockLayout bigbird_layout(const BigBirdConfig& c) {
  require(c.heads >= 1 && c.nq >= 0 && c.nk >= 0 && c.block_size >= 1 && c.window_blocks >= 0 &&
              c.global_blocks >= 0 && c.random_blocks >= 0,
          "bigbird_layout: need heads >= 1, nq >= 0, nk >= 0, block_size >= 1 and non-negative "
          "block counts");
  BlockLayout L;
  L.heads = c.heads;
  L.block_size = c.block_size;
  L.q_blocks = detail::ceil_div(c.nq, c.block_size);
  L.k_blocks = detail::ceil_div(c.nk, c.block_size);
  std::int64_t cells = 0;
  require(detail::checked_product({L.heads, L.q_blocks, L.k_blocks}, cells),
          "bigbird_layout: heads * q_blocks * k_blocks = " + std::to_string(L.heads) + " * " +
              std::to_string(L.q_blocks) + " * " + std::to_string(L.k_blocks) + " overflows int64");
  // More bytes than the machine has can never be allocated: refused before
  // trying (a sanitizer's `new` aborts where the system's throws).
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  const double memory = pages > 0 && page_size > 0
                            ? static_cast<double>(pages) * static_cast<double>(page_size)
                            : std::numeric_limits<double>::infinity();
  try {
    if (static_cast<double>(cells) > memory) throw std::bad_alloc();
    L.bits.assign(static_cast<std::size_t>(cells), 0);
  } catch (const std::bad_alloc&) {
    throw Error("bigbird_layout: a layout of " + std::to_string(cells) +
                " blocks does not fit in memory");
  }
  std::vector<std::int64_t> free;
  for (std::int64_t h = 0; h < L.heads; ++h) {
    for (std::int64_t a = 0; a < L.q_blocks; ++a) {
      std::uint8_t* row = L.bits.data() + (h * L.q_blocks + a) * L.k_blocks;
      if (a < c.global_blocks) {
        std::fill_n(row, L.k_blocks, 1);
        continue;
      }
      // The diagonal of the (nq, nk) grid, aligned at the bottom right.
      const std::int64_t diag = a + (L.k_blocks - L.q_blocks);
      for (std::int64_t b = 0; b < L.k_blocks; ++b) {
        const std::int64_t off_diagonal = b - diag;
        if (b < c.global_blocks ||
            (off_diagonal >= -c.window_blocks && off_diagonal <= c.window_blocks)) {
          row[b] = 1;
        }
      }
      free.clear();
      for (std::int64_t b = 0; b < L.k_blocks; ++b) {
        if (row[b] == 0) free.push_back(b);
      }
      // Partial Fisher-Yates with SplitMix64 of (seed, h, a): reproducible.
      std::uint64_t state =
          c.seed ^ (0x9E3779B97F4A7C15ULL * static_cast<std::uint64_t>(h * L.q_blocks + a + 1));
      const auto next = [&state] {
        std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
      };
      const auto draws = std::min<std::int64_t>(c.random_blocks, free.size());
      for (std::int64_t t = 0; t < draws; ++t) {
        const auto pick = t + static_cast<std::int64_t>(next() % (free.size() - t));
        std::swap(free[t], free[pick]);
        row[free[t]] = 1;
      }
    }
  }
  return L;
}

}  // namespace qkv
