// The transport-free half of context parallelism (pieces.hpp).
#include "dist/pieces.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include "api/validate.hpp"
#include "core/capabilities.hpp"
#include "core/elements.hpp"
#include "core/key_range.hpp"
#include "core/parameters.hpp"
#include "core/query_maps.hpp"
#include "core/softmax_epilogue.hpp"
#include "qkv/backward.hpp"
#include "reference/backward.hpp"

namespace qkv::dist::detail {

std::vector<Chunk> chunks_of(Layout layout, int rank, int ranks, std::int64_t n) {
  if (layout == Layout::contiguous) return {{rank * n, 0, n}};
  const std::int64_t c = n / 2;
  return {{rank * c, 0, c}, {(2 * std::int64_t{ranks} - 1 - rank) * c, c, c}};
}

namespace {

// FNV-1a over the bytes of a span: a fingerprint that ranks compare.
template <class T>
std::int64_t fingerprint(std::span<const T> values) {
  std::uint64_t h = 1469598103934665603ull;
  for (const T& x : values) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &x, sizeof(T));
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  }
  return static_cast<std::int64_t>(h >> 1);
}

template <class T>
struct IsSpan : std::false_type {};
template <class T>
struct IsSpan<std::span<T>> : std::true_type {};

// One integer per option that ranks compare: the value of a number, an enum
// or a flag, a fingerprint of a span, else whether the option is on (the
// options qkv::dist refuses: check_supported names them).
template <class T>
std::int64_t agreement_value(const AttentionOptions& o, qkv::detail::Option option,
                             const T& value) {
  if constexpr (std::is_enum_v<T> || std::is_integral_v<T>) {
    return static_cast<std::int64_t>(value);
  } else if constexpr (std::is_floating_point_v<T>) {
    return std::bit_cast<std::int64_t>(static_cast<double>(value));
  } else if constexpr (std::is_same_v<T, std::optional<double>>) {
    return value ? std::bit_cast<std::int64_t>(*value) : -1;
  } else if constexpr (IsSpan<T>::value) {
    return fingerprint(value);
  } else {
    return qkv::detail::is_on(o, option);
  }
}

// Every value a rank's call depends on: shapes, dtypes and options.
std::vector<Agreed> agreed_values(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                  const AttentionOptions& o, const CallSpec& spec) {
  auto size = [](ConstTensorView t, int d) { return t.rank() > d ? t.size(d) : -1; };
  std::vector<Agreed> agreed = {
      {"q's rank", q.rank()},
      {"q's batch size (dim 0)", size(q, 0)},
      {"q's rows (dim 1)", size(q, 1)},
      {"q's heads (dim 2)", size(q, 2)},
      {"q's head dim (dim 3)", size(q, 3)},
      {"k's rows (dim 1)", size(k, 1)},
      {"k's heads (dim 2)", size(k, 2)},
      {"k's head dim (dim 3)", size(k, 3)},
      {"v's head dim (dim 3)", size(v, 3)},
      {"the dtype of q", static_cast<std::int64_t>(q.dtype())},
      {"the layout", static_cast<std::int64_t>(spec.layout)},
  };
  qkv::detail::for_each_option(o, [&](qkv::detail::Option option, const auto& value) {
    agreed.push_back({std::string("options.") + qkv::detail::option_name(option),
                      agreement_value(o, option, value)});
  });
  return agreed;
}

void check_supported(const AttentionOptions& o, const CallSpec& spec, Reasons& r) {
  qkv::detail::refuse_unsupported(qkv::detail::Path::context_parallel, o,
                                  std::string("qkv::dist::") + spec.function, "", r);
  if (o.score == Score::additive) {
    r.push_back("options.score: Score::additive is not supported by qkv::dist::" +
                std::string(spec.function));
  }
  if (spec.layout != Layout::contiguous && spec.layout != Layout::zigzag) {
    r.push_back("layout: expected Layout::contiguous or Layout::zigzag, got value " +
                std::to_string(static_cast<int>(spec.layout)));
  }
}

}  // namespace

namespace {

// This rank's inputs alone, through the library's own checks; the key
// lengths speak of the whole sequence, so check_whole checks them.
Setup check_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                   const AttentionOptions& o, const CallSpec& spec, int rank, int ranks,
                   Reasons& r) {
  Setup s;
  s.rank = rank;
  s.ranks = ranks;
  s.layout = spec.layout;
  check_supported(o, spec, r);
  AttentionOptions local = o;
  local.key_lengths = {};
  local.shard = {};
  try {
    const qkv::detail::AttentionProblem p = qkv::detail::check_attention_inputs(q, k, v, local);
    if (spec.backward) qkv::detail::check_backward_inputs(p, spec.out, spec.dout, spec.lse, local);
    s.batch = p.batch;
    s.nq = p.nq;
    s.nk = p.nk;
    s.hq = p.hq;
    s.hkv = p.hkv;
    s.dk = p.dk;
    s.dv = p.dv;
    s.dtype = p.dtype;
    s.stat_dtype = p.stat_dtype;
    s.problem = p;
  } catch (const Error& e) {
    r.insert(r.end(), e.reasons().begin(), e.reasons().end());
  }
  return s;
}

// The checks of the whole problem, for inputs that passed check_inputs.
void check_whole(const Setup& s, const AttentionOptions& o, const CallSpec& spec, Reasons& w) {
  if (s.nq < 1 || s.nk < 1) {
    w.push_back("q, k: expected at least one row per rank, got " + std::to_string(s.nq) +
                " query and " + std::to_string(s.nk) + " key rows");
  }
  if (s.nq > qkv::detail::kMaxSequence / s.ranks || s.nk > qkv::detail::kMaxSequence / s.ranks) {
    w.push_back("q, k: expected the whole sequence (rows per rank times " +
                std::to_string(s.ranks) + " ranks) below 2^60, got " + std::to_string(s.nq) +
                " query and " + std::to_string(s.nk) + " key rows per rank");
  }
  if (s.layout == Layout::zigzag && (s.nq % 2 != 0 || s.nk % 2 != 0)) {
    w.push_back(
        "q, k: Layout::zigzag expects an even number of rows per rank (two chunks), "
        "got " +
        std::to_string(s.nq) + " query and " + std::to_string(s.nk) + " key rows");
  }
  if (spec.heads_divide && (s.hq % s.ranks != 0 || s.hkv % s.ranks != 0)) {
    w.push_back("q, k: all-to-all attention splits heads over the " + std::to_string(s.ranks) +
                " ranks, so Hq and Hkv must be multiples of " + std::to_string(s.ranks) +
                ", got Hq = " + std::to_string(s.hq) + " and Hkv = " + std::to_string(s.hkv));
  }
  if (!o.key_lengths.empty()) {
    if (static_cast<std::int64_t>(o.key_lengths.size()) != s.batch) {
      w.push_back("options.key_lengths: expected B = " + std::to_string(s.batch) +
                  " lengths, got " + std::to_string(o.key_lengths.size()));
    } else {
      for (std::size_t b = 0; b < o.key_lengths.size(); ++b) {
        if (o.key_lengths[b] < 0 || o.key_lengths[b] > s.total_k()) {
          w.push_back("options.key_lengths[" + std::to_string(b) +
                      "]: expected a length in [0, Nk = " + std::to_string(s.total_k()) +
                      "] (keys of the whole sequence), got " + std::to_string(o.key_lengths[b]));
        }
      }
    }
  }
}

}  // namespace

LocalCheck check_locally(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         const AttentionOptions& o, const CallSpec& spec, int rank, int ranks) {
  LocalCheck c;
  c.setup = check_inputs(q, k, v, o, spec, rank, ranks, c.reasons);
  c.agreed = agreed_values(q, k, v, o, spec);
  if (c.reasons.empty()) check_whole(c.setup, o, spec, c.whole);
  return c;
}

Setup setup_of(ConstTensorView q, ConstTensorView k, ConstTensorView v,
               const AttentionOptions& options, const CallSpec& spec, int rank, int ranks) {
  Reasons r;
  const Setup s = check_inputs(q, k, v, options, spec, rank, ranks, r);
  if (r.empty()) check_whole(s, options, spec, r);
  if (!r.empty()) throw Error(r);
  return s;
}

std::vector<BatchGroup> batch_groups(const Setup& s, const AttentionOptions& o) {
  const bool bottom_right = o.align == Align::bottom_right;
  if (o.key_lengths.empty()) {
    return {{0, s.batch, bottom_right ? s.total_k() - s.total_q() : 0, s.total_k()}};
  }
  std::vector<BatchGroup> groups;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = o.key_lengths[static_cast<std::size_t>(b)];
    groups.push_back({b, 1, bottom_right ? length - s.total_q() : 0, length});
  }
  return groups;
}

// Whether a query chunk admits any key of a key chunk: the rows' key rule
// (core/key_range.hpp, which the pieces' calls apply) tested on whole chunks.
bool may_attend(const AttentionOptions& o, const BatchGroup& g, const Chunk& qc, const Chunk& kc) {
  const std::int64_t first = qc.global + g.delta;
  return qkv::detail::key_rule(o).reaches(first, first + qc.length - 1, kc.global,
                                          std::min(kc.global + kc.length, g.valid_keys));
}

bool needs(const Setup& s, const AttentionOptions& o, const std::vector<BatchGroup>& groups, int a,
           int x) {
  for (const BatchGroup& g : groups) {
    for (const Chunk& qc : chunks_of(s.layout, a, s.ranks, s.nq)) {
      for (const Chunk& kc : chunks_of(s.layout, x, s.ranks, s.nk)) {
        if (may_attend(o, g, qc, kc)) return true;
      }
    }
  }
  return false;
}

std::vector<int> last_holders(const Setup& s, const AttentionOptions& o,
                              const std::vector<BatchGroup>& groups) {
  std::vector<int> last(static_cast<std::size_t>(s.ranks), 0);
  for (int x = 0; x < s.ranks; ++x) {
    for (int u = s.ranks - 1; u > 0; --u) {
      if (needs(s, o, groups, (x + u) % s.ranks, x)) {
        last[static_cast<std::size_t>(x)] = u;
        break;
      }
    }
  }
  return last;
}

AttentionOptions piece_options(const AttentionOptions& o, const Setup& s, const BatchGroup& g,
                               const Chunk& qc, const Chunk& kc,
                               std::vector<std::int64_t>& lengths) {
  AttentionOptions p = o;
  p.align = Align::top_left;
  p.return_lse = false;
  p.return_probs = false;
  p.shard = {.position = qc.global + g.delta - kc.global,
             .row = qc.global,
             .key = kc.global,
             .partial_keys = true};
  if (g.count < s.batch) {
    // One batch entry b0 of B: its dropout stream b0 * Hq + h is stream
    // `head + h` of a problem of B * Hq heads.
    p.shard.head = g.b0 * s.hq;
    p.shard.heads = s.batch * s.hq;
  }
  if (!o.key_lengths.empty()) {
    lengths.clear();
    for (std::int64_t b = g.b0; b < g.b0 + g.count; ++b) {
      const std::int64_t here = o.key_lengths[static_cast<std::size_t>(b)] - kc.global;
      lengths.push_back(std::clamp<std::int64_t>(here, 0, kc.length));
    }
    p.key_lengths = lengths;
  }
  p.sinks = {};
  if (static_cast<std::int64_t>(o.alibi_slopes.size()) != s.hq && !o.alibi_slopes.empty()) {
    p.alibi_slopes = o.alibi_slopes.subspan(static_cast<std::size_t>(g.b0 * s.hq),
                                            static_cast<std::size_t>(g.count * s.hq));
  }
  return p;
}

AttentionOptions head_options(const AttentionOptions& o, const Setup& s,
                              std::vector<float>& slopes) {
  const std::int64_t hl = s.hq / s.ranks, h0 = s.rank * hl;
  AttentionOptions p = o;
  p.shard = {.head = h0, .heads = s.hq};
  if (!o.alibi_slopes.empty()) {
    const std::int64_t sequences = static_cast<std::int64_t>(o.alibi_slopes.size()) / s.hq;
    slopes.clear();
    for (std::int64_t b = 0; b < sequences; ++b) {
      for (std::int64_t h = 0; h < hl; ++h) {
        slopes.push_back(o.alibi_slopes[static_cast<std::size_t>(b * s.hq + h0 + h)]);
      }
    }
    p.alibi_slopes = slopes;
  }
  if (!o.sinks.empty()) {
    p.sinks = o.sinks.subspan(static_cast<std::size_t>(h0), static_cast<std::size_t>(hl));
  }
  qkv::detail::select_query_map_heads(p, h0, hl);
  return p;
}

std::vector<qkv::detail::QueryRow> shard_query_rows(const Setup& s, const AttentionOptions& o) {
  std::vector<qkv::detail::QueryRow> rows;
  const qkv::detail::KeyRule rule = qkv::detail::key_rule(o);
  for (const BatchGroup& g : batch_groups(s, o)) {
    for (std::int64_t b = g.b0; b < g.b0 + g.count; ++b) {
      for (const Chunk& c : chunks_of(s.layout, s.rank, s.ranks, s.nq)) {
        for (std::int64_t t = 0; t < c.length; ++t) {
          rows.push_back({b, c.local + t, rule.range(c.global + t + g.delta, g.valid_keys).size()});
        }
      }
    }
  }
  return rows;
}

namespace {

// Rows [b0, b0 + count) and [row0, row0 + rows) of a [B, N, H, D] view.
ConstTensorView rows_of(ConstTensorView t, const BatchGroup& g, const Chunk& c) {
  return t.slice(0, g.b0, g.count).slice(1, c.local, c.length);
}

// Calls f(group, query rows, key chunk) for every piece of a step that the
// masks may admit, in blocks of at most kRowsPerCall query rows with
// `between` called between blocks; counts the pieces.
template <class F>
void for_each_piece(const Setup& s, const AttentionOptions& o,
                    const std::vector<BatchGroup>& groups, int holder, PieceCounts& counts, F&& f,
                    const std::function<void()>& between) {
  for (const BatchGroup& g : groups) {
    for (const Chunk& qc : chunks_of(s.layout, s.rank, s.ranks, s.nq)) {
      for (const Chunk& kc : chunks_of(s.layout, holder, s.ranks, s.nk)) {
        if (!may_attend(o, g, qc, kc)) {
          ++counts.skipped;
          continue;
        }
        ++counts.computed;
        for (std::int64_t i = 0; i < qc.length; i += kRowsPerCall) {
          const std::int64_t n = std::min(kRowsPerCall, qc.length - i);
          const Chunk rows{qc.global + i, qc.local + i, n};
          if (may_attend(o, g, rows, kc)) f(g, rows, kc);
          if (between) between();
        }
      }
    }
  }
}

// Merges one piece (out [count, rows, Hq, Dv], lse [count, Hq, rows]) into
// the running result of its rows.
template <class Real>
void merge_piece(const Setup& s, const BatchGroup& g, const Chunk& qc, const Tensor& out,
                 const Tensor& lse, Real* acc, Real* acc_lse) {
  const std::int64_t dv = s.dv;
  const std::int64_t n = g.count * qc.length * s.hq;
#pragma omp parallel for schedule(static) if (n * dv >= (std::int64_t{1} << 16))
  for (std::int64_t x = 0; x < n; ++x) {
    const std::int64_t h = x % s.hq, i = (x / s.hq) % qc.length, b = x / (s.hq * qc.length);
    thread_local std::vector<Real> piece, merged;
    piece.resize(static_cast<std::size_t>(dv));
    merged.resize(static_cast<std::size_t>(dv));
    const std::int64_t at = x * dv;  // out is contiguous [count, rows, Hq, Dv]
    if (s.dtype == DType::f32) {
      const float* p = static_cast<const float*>(out.view().data()) + at;
      std::copy(p, p + dv, piece.begin());
    } else {
      for (std::int64_t c = 0; c < dv; ++c) {
        piece[static_cast<std::size_t>(c)] =
            static_cast<Real>(qkv::detail::load(out.view().data(), s.dtype, at + c));
      }
    }
    Real* row = acc + (((g.b0 + b) * s.nq + qc.local + i) * s.hq + h) * dv;
    Real& row_lse = acc_lse[((g.b0 + b) * s.hq + h) * s.nq + qc.local + i];
    const qkv::detail::SoftmaxPart<Real> parts[2] = {
        {row_lse, Real(1), row},
        {static_cast<Real>(
             qkv::detail::load(lse.view().data(), s.stat_dtype, (b * s.hq + h) * qc.length + i)),
         Real(1), piece.data()}};
    row_lse = qkv::detail::merge_softmax_parts<Real>(
        2, dv, [&](std::int64_t p) { return parts[p]; }, merged.data());
    std::copy(merged.begin(), merged.end(), row);
  }
}

// What a step's pieces run on. They compute on f32 copies of 16-bit inputs
// (exact: widening rounds nothing), so that their outputs and gradients
// reach the f32 merges and sums unrounded, and the result is rounded to 16
// bits once, as one call's. With maps of the queries, the queries are this
// rank's mapped in that dtype (with their whole-problem key ranges,
// shard_query_rows) and the options go without the maps.
struct Working {
  Setup s;
  AttentionOptions options;  // the pieces' (before piece_options)
  ConstTensorView queries;
  std::vector<Tensor> copies;
  ConstTensorView operator()(ConstTensorView t) {
    if (t.dtype() == s.dtype) return t;
    copies.push_back(to_dtype(t, s.dtype));
    return copies.back().view();
  }
};

Working working(const Setup& s0, const AttentionOptions& o, ConstTensorView q) {
  Working w{s0, o, {}, {}};
  w.copies.reserve(6);  // the views stay where they are
  if (s0.dtype == DType::bf16 || s0.dtype == DType::f16) w.s.dtype = DType::f32;
  if (!qkv::detail::maps_queries(o)) {
    w.queries = w(q);
  } else {
    w.copies.push_back(qkv::detail::mapped_queries(q, shard_query_rows(s0, o), o, w.s.dtype));
    w.queries = w.copies.back().view();
    w.options = qkv::detail::without_query_maps(o);
  }
  return w;
}

}  // namespace

template <class Real>
void ring_forward_step(const Setup& s0, const AttentionOptions& o0,
                       const std::vector<BatchGroup>& groups, int holder, ConstTensorView q,
                       ConstTensorView k, ConstTensorView v, Real* acc, Real* acc_lse,
                       PieceCounts& counts, const std::function<void()>& between) {
  Working w = working(s0, o0, q);
  const Setup& s = w.s;
  const AttentionOptions& o = w.options;
  const ConstTensorView qw = w.queries, kw = w(k), vw = w(v);
  std::vector<std::int64_t> lengths;
  for_each_piece(
      s, o, groups, holder, counts,
      [&](const BatchGroup& g, const Chunk& qc, const Chunk& kc) {
        const AttentionOptions po = piece_options(o, s, g, qc, kc, lengths);
        Tensor out(s.dtype, {g.count, qc.length, s.hq, s.dv});
        Tensor lse(s.stat_dtype, {g.count, s.hq, qc.length});
        attention_into(rows_of(qw, g, qc), rows_of(kw, g, kc), rows_of(vw, g, kc),
                       {.out = out, .lse = lse}, po);
        merge_piece<Real>(s, g, qc, out, lse, acc, acc_lse);
      },
      between);
}

// The finish of core/softmax_epilogue.hpp on one part, with the sink.
template <class Real>
void add_sinks(const Setup& s, std::span<const float> sinks, Real* acc, Real* acc_lse) {
  const std::int64_t n = s.batch * s.nq * s.hq;
#pragma omp parallel for schedule(static) if (n * s.dv >= (std::int64_t{1} << 16))
  for (std::int64_t x = 0; x < n; ++x) {
    const std::int64_t h = x % s.hq, i = (x / s.hq) % s.nq, b = x / (s.hq * s.nq);
    thread_local std::vector<Real> merged;
    merged.resize(static_cast<std::size_t>(s.dv));
    Real* row = acc + x * s.dv;
    Real& row_lse = acc_lse[(b * s.hq + h) * s.nq + i];
    const qkv::detail::SoftmaxPart<Real> part{row_lse, Real(1), row};
    row_lse = qkv::detail::merge_softmax_parts<Real>(
        1, s.dv, [&](std::int64_t) { return part; }, merged.data(),
        static_cast<Real>(sinks[static_cast<std::size_t>(h)]));
    std::copy(merged.begin(), merged.end(), row);
  }
}

template <class Real>
void ring_backward_step(const Setup& s0, const AttentionOptions& o0,
                        const std::vector<BatchGroup>& groups, int holder, ConstTensorView q,
                        ConstTensorView k, ConstTensorView v, ConstTensorView out,
                        ConstTensorView dout, ConstTensorView lse, Real* dq, Real* dk, Real* dv,
                        PieceCounts& counts, const std::function<void()>& between) {
  Working w = working(s0, o0, q);
  const Setup& s = w.s;
  const AttentionOptions& o = w.options;
  const ConstTensorView qw = w.queries, kw = w(k), vw = w(v), ow = w(out), gw = w(dout);
  const Shape dq_strides = contiguous_strides(Shape{s.batch, s.nq, s.hq, s.dk});
  const Shape dk_strides = contiguous_strides(Shape{s.batch, s.nk, s.hkv, s.dk});
  const Shape dv_strides = contiguous_strides(Shape{s.batch, s.nk, s.hkv, s.dv});
  std::vector<std::int64_t> lengths;
  for_each_piece(
      s, o, groups, holder, counts,
      [&](const BatchGroup& g, const Chunk& qc, const Chunk& kc) {
        const AttentionOptions po = piece_options(o, s, g, qc, kc, lengths);
        Tensor dq_piece(s.dtype, {g.count, qc.length, s.hq, s.dk});
        Tensor dk_piece(s.dtype, {g.count, kc.length, s.hkv, s.dk});
        Tensor dv_piece(s.dtype, {g.count, kc.length, s.hkv, s.dv});
        attention_backward_into(rows_of(qw, g, qc), rows_of(kw, g, kc), rows_of(vw, g, kc),
                                rows_of(ow, g, qc), rows_of(gw, g, qc),
                                lse.slice(0, g.b0, g.count).slice(2, qc.local, qc.length),
                                {.dq = dq_piece, .dk = dk_piece, .dv = dv_piece}, po);
        add_into<Real>(dq_piece, dq + (g.b0 * s.nq + qc.local) * dq_strides[1], dq_strides);
        add_into<Real>(dk_piece, dk + (g.b0 * s.nk + kc.local) * dk_strides[1], dk_strides);
        add_into<Real>(dv_piece, dv + (g.b0 * s.nk + kc.local) * dv_strides[1], dv_strides);
      },
      between);
}

template <class Real>
AttentionGradients finish_query_maps(const Setup& s, const AttentionOptions& o, ConstTensorView q,
                                     Real* dq) {
  AttentionGradients shares;
  if (!qkv::detail::maps_queries(o)) return shares;
  const DType real = sizeof(Real) == 8 ? DType::f64 : DType::f32;
  const qkv::Shape sizes{s.batch, s.nq, s.hq, s.dk}, strides = contiguous_strides(sizes);
  const TensorView acc(dq, real, std::span<const std::int64_t>(sizes.data(), 4),
                       std::span<const std::int64_t>(strides.data(), 4));
  GradientOutputs views;
  const std::vector<qkv::detail::ParameterRow> rows = qkv::detail::parameter_rows(s.problem, o);
  for (const qkv::detail::QueryMap* m : qkv::detail::used_query_maps(o)) {
    for (const qkv::detail::ParameterRow& row : rows) {
      if (row.tensor != m->gradient) continue;
      shares.*m->gradient = Tensor(s.stat_dtype, row.sizes);
      views.*m->gradient_view = shares.*m->gradient;
    }
  }
  // The steps mapped in the working dtype (working()), which is Real's.
  qkv::detail::query_map_gradients(q, acc, shard_query_rows(s, o), o, real, acc, views);
  return shares;
}

Tensor local_sink_gradients(const Setup& s, ConstTensorView out, ConstTensorView dout,
                            ConstTensorView lse, const AttentionOptions& o) {
  Tensor mine(s.stat_dtype, {s.hq});
  AttentionOptions local = o;
  local.key_lengths = {};  // the problem's rows are this rank's, whole
  qkv::reference::sink_gradients(s.problem, out, dout, lse, local, mine.view());
  return mine;
}

namespace {

// Calls f(src element offset, dst element offset, count) for each innermost
// row of a rank <= 4 view against contiguous-like destination strides.
template <class F>
void for_each_row(ConstTensorView t, const qkv::Shape& other, F&& f) {
  const int rank = t.rank();
  qkv::Shape outer = t.sizes();
  outer[rank - 1] = 1;
  qkv::detail::for_each_index(outer, rank, [&](const qkv::Shape& idx) {
    f(qkv::detail::offset(idx, t.strides(), rank), qkv::detail::offset(idx, other, rank),
      t.size(rank - 1));
  });
}

}  // namespace

template <class Real>
void add_into(ConstTensorView src, Real* dst, const qkv::Shape& dst_strides) {
  const std::int64_t step = src.stride(src.rank() - 1);
  for_each_row(src, dst_strides, [&](std::int64_t so, std::int64_t d, std::int64_t n) {
    if (src.dtype() == DType::f32 || src.dtype() == DType::f64) {
      for (std::int64_t c = 0; c < n; ++c) {
        dst[d + c] += static_cast<Real>(
            src.dtype() == DType::f32 ? static_cast<const float*>(src.data())[so + c * step]
                                      : static_cast<const double*>(src.data())[so + c * step]);
      }
    } else {
      for (std::int64_t c = 0; c < n; ++c) {
        dst[d + c] += static_cast<Real>(qkv::detail::load(src.data(), src.dtype(), so + c * step));
      }
    }
  });
}

template <class Real>
void store_from(const Real* src, const qkv::Shape& src_strides, TensorView dst) {
  const std::int64_t step = dst.stride(dst.rank() - 1);
  for_each_row(dst, src_strides, [&](std::int64_t d, std::int64_t so, std::int64_t n) {
    for (std::int64_t c = 0; c < n; ++c) {
      qkv::detail::store(dst.data(), dst.dtype(), d + c * step, static_cast<double>(src[so + c]));
    }
  });
}

template void add_into<float>(ConstTensorView, float*, const qkv::Shape&);
template void add_into<double>(ConstTensorView, double*, const qkv::Shape&);
template void store_from<float>(const float*, const qkv::Shape&, TensorView);
template void store_from<double>(const double*, const qkv::Shape&, TensorView);

template void ring_forward_step<float>(const Setup&, const AttentionOptions&,
                                       const std::vector<BatchGroup>&, int, ConstTensorView,
                                       ConstTensorView, ConstTensorView, float*, float*,
                                       PieceCounts&, const std::function<void()>&);
template void ring_forward_step<double>(const Setup&, const AttentionOptions&,
                                        const std::vector<BatchGroup>&, int, ConstTensorView,
                                        ConstTensorView, ConstTensorView, double*, double*,
                                        PieceCounts&, const std::function<void()>&);
template void add_sinks<float>(const Setup&, std::span<const float>, float*, float*);
template void add_sinks<double>(const Setup&, std::span<const float>, double*, double*);
template void ring_backward_step<float>(const Setup&, const AttentionOptions&,
                                        const std::vector<BatchGroup>&, int, ConstTensorView,
                                        ConstTensorView, ConstTensorView, ConstTensorView,
                                        ConstTensorView, ConstTensorView, float*, float*, float*,
                                        PieceCounts&, const std::function<void()>&);
template AttentionGradients finish_query_maps<float>(const Setup&, const AttentionOptions&,
                                                     ConstTensorView, float*);
template AttentionGradients finish_query_maps<double>(const Setup&, const AttentionOptions&,
                                                      ConstTensorView, double*);
template void ring_backward_step<double>(const Setup&, const AttentionOptions&,
                                         const std::vector<BatchGroup>&, int, ConstTensorView,
                                         ConstTensorView, ConstTensorView, ConstTensorView,
                                         ConstTensorView, ConstTensorView, double*, double*,
                                         double*, PieceCounts&, const std::function<void()>&);

}  // namespace qkv::dist::detail
