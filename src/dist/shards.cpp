#include "dist/shards.hpp"

#include <algorithm>
#include <bit>
#include <climits>
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

struct Agreed {
  std::string name;
  std::int64_t value;
};

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

// Appends a reason for every value on which ranks disagree. Collective.
void check_agreement(MPI_Comm comm, int rank, const std::vector<Agreed>& mine, Reasons& r) {
  const auto n = static_cast<int>(mine.size());
  std::vector<std::int64_t> low(mine.size()), high(mine.size()), local(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) local[i] = mine[i].value;
  MPI_Allreduce(local.data(), low.data(), n, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(local.data(), high.data(), n, MPI_INT64_T, MPI_MAX, comm);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (low[i] != high[i]) {
      r.push_back(
          mine[i].name + ": expected the same value on every rank, but the ranks differ (rank " +
          std::to_string(rank) + ": " + std::to_string(local[i]) +
          ", range over ranks: " + std::to_string(low[i]) + " to " + std::to_string(high[i]) + ")");
    }
  }
}

// Every rank throws the first failing rank's reasons. Collective.
void raise_collectively(MPI_Comm comm, const char* function, int rank, int ranks,
                        const Reasons& r) {
  int bad = r.empty() ? ranks : rank, first = ranks;
  MPI_Allreduce(&bad, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == ranks) return;
  std::string text;
  if (rank == first) {
    for (const std::string& reason : r) text += reason + '\n';
  }
  std::int64_t length = static_cast<std::int64_t>(text.size());
  MPI_Bcast(&length, 1, MPI_INT64_T, first, comm);
  text.resize(static_cast<std::size_t>(length));
  MPI_Bcast(text.data(), static_cast<int>(length), MPI_CHAR, first, comm);
  Reasons all;
  const std::string prefix = std::string("qkv::dist::") + function + ", rank " +
                             std::to_string(first) + " of " + std::to_string(ranks) + ": ";
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = text.find('\n', at);
    all.push_back(prefix + text.substr(at, end - at));
    at = end + 1;
  }
  throw Error(all);
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

Setup validate_collectively(MPI_Comm comm, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                            const AttentionOptions& o, const CallSpec& spec) {
  if (comm == MPI_COMM_NULL) {
    throw Error(std::string("comm: expected a communicator, got MPI_COMM_NULL (qkv::dist::") +
                spec.function + ")");
  }
  int inter = 0;
  MPI_Comm_test_inter(comm, &inter);
  if (inter) {
    throw Error(std::string("comm: expected an intracommunicator, got an intercommunicator "
                            "(qkv::dist::") +
                spec.function + ")");
  }
  Setup s;
  MPI_Comm_rank(comm, &s.rank);
  MPI_Comm_size(comm, &s.ranks);
  s.layout = spec.layout;
  Reasons r;
  check_supported(o, spec, r);
  // The tensors through the library's own checks; the key lengths speak of
  // the whole sequence, so they are checked below instead.
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
  check_agreement(comm, s.rank, agreed_values(q, k, v, o, spec), r);
  if (r.empty()) {
    if (s.nq < 1 || s.nk < 1) {
      r.push_back("q, k: expected at least one row per rank, got " + std::to_string(s.nq) +
                  " query and " + std::to_string(s.nk) + " key rows");
    }
    if (s.nq > qkv::detail::kMaxSequence / s.ranks || s.nk > qkv::detail::kMaxSequence / s.ranks) {
      r.push_back("q, k: expected the whole sequence (rows per rank times " +
                  std::to_string(s.ranks) + " ranks) below 2^60, got " + std::to_string(s.nq) +
                  " query and " + std::to_string(s.nk) + " key rows per rank");
    }
    if (s.layout == Layout::zigzag && (s.nq % 2 != 0 || s.nk % 2 != 0)) {
      r.push_back(
          "q, k: Layout::zigzag expects an even number of rows per rank (two chunks), "
          "got " +
          std::to_string(s.nq) + " query and " + std::to_string(s.nk) + " key rows");
    }
    if (spec.heads_divide && (s.hq % s.ranks != 0 || s.hkv % s.ranks != 0)) {
      r.push_back("q, k: all-to-all attention splits heads over the " + std::to_string(s.ranks) +
                  " ranks, so Hq and Hkv must be multiples of " + std::to_string(s.ranks) +
                  ", got Hq = " + std::to_string(s.hq) + " and Hkv = " + std::to_string(s.hkv));
    }
    if (!o.key_lengths.empty()) {
      if (static_cast<std::int64_t>(o.key_lengths.size()) != s.batch) {
        r.push_back("options.key_lengths: expected B = " + std::to_string(s.batch) +
                    " lengths, got " + std::to_string(o.key_lengths.size()));
      } else {
        for (std::size_t b = 0; b < o.key_lengths.size(); ++b) {
          if (o.key_lengths[b] < 0 || o.key_lengths[b] > s.total_k()) {
            r.push_back("options.key_lengths[" + std::to_string(b) +
                        "]: expected a length in [0, Nk = " + std::to_string(s.total_k()) +
                        "] (keys of the whole sequence), got " + std::to_string(o.key_lengths[b]));
          }
        }
      }
    }
  }
  raise_collectively(comm, spec.function, s.rank, s.ranks, r);
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

Tensor sink_gradients(MPI_Comm comm, const Setup& s, ConstTensorView out, ConstTensorView dout,
                      ConstTensorView lse, const AttentionOptions& o) {
  Tensor mine(s.stat_dtype, {s.hq}), all(s.stat_dtype, {s.hq});
  AttentionOptions local = o;
  local.key_lengths = {};  // the problem's rows are this rank's, whole
  qkv::reference::sink_gradients(s.problem, out, dout, lse, local, mine.view());
  MPI_Allreduce(mine.view().data(), all.view().data(), static_cast<int>(s.hq),
                s.stat_dtype == DType::f64 ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM, comm);
  return all;
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

namespace {
constexpr std::int64_t kMessageBytes = std::int64_t{1} << 30;
}

void post_send(const void* data, std::int64_t bytes, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  const auto* p = static_cast<const char*>(data);
  for (std::int64_t at = 0; at < bytes || at == 0; at += kMessageBytes) {
    const auto n = static_cast<int>(std::min(kMessageBytes, bytes - at));
    requests.emplace_back();
    MPI_Isend(p + at, n, MPI_BYTE, dest, tag, comm, &requests.back());
    if (bytes == 0) break;
  }
}

void post_recv(void* data, std::int64_t bytes, int source, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  auto* p = static_cast<char*>(data);
  for (std::int64_t at = 0; at < bytes || at == 0; at += kMessageBytes) {
    const auto n = static_cast<int>(std::min(kMessageBytes, bytes - at));
    requests.emplace_back();
    MPI_Irecv(p + at, n, MPI_BYTE, source, tag, comm, &requests.back());
    if (bytes == 0) break;
  }
}

void wait_all(std::vector<MPI_Request>& requests) {
  if (!requests.empty()) {
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  }
  requests.clear();
}

}  // namespace qkv::dist::detail
