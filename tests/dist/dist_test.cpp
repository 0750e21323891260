// qkv::dist under mpiexec: every rank builds the whole problem from one
// seed, computes its shard with ring or all-to-all attention, and compares
// it with the same rows of one single-process call. ctest runs this binary
// with 1, 2, 3 and 4 ranks (tests/CMakeLists.txt).
//
// Error model (docs/distributed.md): a distributed result is the merge of R
// partial results, each an f32 attention call over a subset of the keys;
// every merge step rounds a handful of times (exp, scale, add, divide), so
// its distance to the exact (f64) result is at most twice the single call's
// plus 4 R u max|result| (u = 2^-24). The gradients add R partial
// gradients, each from one fused backward call, with the same bound.
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dist/shards.hpp"
#include "gtest/gtest.h"
#include "qkv/distributed.hpp"
#include "qkv/qkv.hpp"
#include "test_util.hpp"

namespace qkv::test {
namespace {

int Rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int Ranks() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Global rows held by `rank`, in shard order (written from the layout's
// definition in qkv/distributed.hpp, independently of the library).
std::vector<std::int64_t> ShardRows(dist::Layout layout, int rank, int ranks, std::int64_t n) {
  std::vector<std::int64_t> rows;
  if (layout == dist::Layout::contiguous) {
    for (std::int64_t i = 0; i < n; ++i) rows.push_back(rank * n + i);
  } else {
    const std::int64_t c = n / 2;
    for (std::int64_t i = 0; i < c; ++i) rows.push_back(rank * c + i);
    for (std::int64_t i = 0; i < c; ++i) rows.push_back((2 * ranks - 1 - rank) * c + i);
  }
  return rows;
}

// The rows `rows` of dimension `dim` of a contiguous tensor, as a new tensor.
Tensor TakeRows(const Tensor& t, int dim, const std::vector<std::int64_t>& rows) {
  Shape sizes = t.sizes();
  sizes[dim] = static_cast<std::int64_t>(rows.size());
  Tensor out(t.dtype(), std::span<const std::int64_t>(sizes.data(), t.rank()));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    copy(t.view().slice(dim, rows[i], 1), out.view().slice(dim, static_cast<std::int64_t>(i), 1));
  }
  return out;
}

// Largest |a - b| over elements, infinities of the same sign counting as equal.
double MaxDiff(ConstTensorView a, ConstTensorView b) {
  double worst = 0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    const double x = detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank()));
    const double y = detail::load(b.data(), b.dtype(), detail::offset(idx, b.strides(), b.rank()));
    if (x == y) return;
    worst = std::max(worst,
                     std::isnan(x - y) ? std::numeric_limits<double>::infinity() : std::abs(x - y));
  });
  return worst;
}

double MaxFinite(ConstTensorView a) {
  double m = 0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    const double x = detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank()));
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  });
  return m;
}

// Checks a distributed shard against the same rows of the single-process
// result, both measured against the f64 reference.
void ExpectWithinModel(const char* what, ConstTensorView got, ConstTensorView single,
                       ConstTensorView exact, int ranks) {
  const double single_error = MaxDiff(single, exact);
  const double bound = 2 * single_error + 4.0 * ranks * 0x1p-24 * MaxFinite(exact);
  EXPECT_LE(MaxDiff(got, exact), bound) << what << " on rank " << Rank() << " of " << ranks
                                        << " (single-process error " << single_error << ")";
}

struct Problem {
  Tensor q, k, v, dout;  // whole problem, f32
};

Problem MakeProblem(std::int64_t b, std::int64_t nq, std::int64_t nk, std::int64_t hq,
                    std::int64_t hkv, std::int64_t d, std::uint32_t seed) {
  return {random_tensor(DType::f32, {b, nq, hq, d}, seed),
          random_tensor(DType::f32, {b, nk, hkv, d}, seed + 1),
          random_tensor(DType::f32, {b, nk, hkv, d}, seed + 2),
          random_tensor(DType::f32, {b, nq, hq, d}, seed + 3)};
}

AttentionOptions Exact(AttentionOptions o) {
  o.backend = Backend::reference;
  return o;
}

Tensor F64(const Tensor& t) { return to_dtype(t, DType::f64); }

struct Config {
  std::string name;
  std::int64_t nq = 8, nk = 8;  // rows per rank
  std::function<void(AttentionOptions&)> set;
};

std::vector<std::int64_t> g_lengths;  // storage for key_lengths spans
std::vector<float> g_slopes;
std::vector<float> g_sinks;   // one logit per query head, resized by the caller
std::vector<float> g_scales;  // one logit scale per query head, likewise

std::vector<Config> Configs(int ranks) {
  const std::int64_t total = 8 * ranks;
  return {
      {"full", 8, 8, [](AttentionOptions&) {}},
      {"causal", 8, 8, [](AttentionOptions& o) { o.causal = true; }},
      {"causal top-left, Nq != Nk", 4, 8,
       [](AttentionOptions& o) {
         o.causal = true;
         o.align = Align::top_left;
       }},
      {"causal bottom-right, Nq != Nk", 4, 8, [](AttentionOptions& o) { o.causal = true; }},
      {"causal sliding window 5", 8, 8,
       [](AttentionOptions& o) {
         o.causal = true;
         o.window_left = 5;
       }},
      {"window 3 left, 2 right", 8, 8,
       [](AttentionOptions& o) {
         o.window_left = 3;
         o.window_right = 2;
       }},
      {"ALiBi and softcap", 8, 8,
       [](AttentionOptions& o) {
         g_slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
         o.alibi_slopes = g_slopes;
         o.softcap = 3.0;
         o.causal = true;
       }},
      {"dropout", 8, 8,
       [](AttentionOptions& o) {
         o.dropout_p = 0.25;
         o.dropout_seed = 0x1234567890abull;
         o.dropout_offset = 7;
         o.causal = true;
       }},
      {"key lengths, bottom-right, dropout", 8, 8,
       [total](AttentionOptions& o) {
         g_lengths = {total - 3, total / 2};
         o.key_lengths = g_lengths;
         o.causal = true;
         o.dropout_p = 0.3;
         o.dropout_seed = 5;
       }},
      {"key lengths, one empty", 8, 8,
       [total](AttentionOptions& o) {
         g_lengths = {0, total - 1};
         o.key_lengths = g_lengths;
       }},
      {"key lengths, top-left", 4, 8,
       [total](AttentionOptions& o) {
         g_lengths = {total / 2 + 1, total};
         o.key_lengths = g_lengths;
         o.align = Align::top_left;
       }},
      {"sinks, causal", 8, 8,
       [](AttentionOptions& o) {
         o.sinks = g_sinks;
         o.causal = true;
       }},
      {"sinks, key lengths, one empty", 8, 8,
       [total](AttentionOptions& o) {
         g_lengths = {0, total - 1};
         o.key_lengths = g_lengths;
         o.sinks = g_sinks;
       }},
      {"score_scale times ln n, causal window, sinks", 8, 8,
       [](AttentionOptions& o) {
         o.score_scale = g_scales;
         o.score_scale_log_n = true;
         o.sinks = g_sinks;
         o.causal = true;
         o.window_left = 11;
       }},
      {"score_scale times ln n, key lengths, bottom-right, Nq != Nk", 4, 8,
       [total](AttentionOptions& o) {
         g_lengths = {total - 5, total / 2};
         o.key_lengths = g_lengths;
         o.score_scale = g_scales;
         o.score_scale_log_n = true;
         o.causal = true;
       }},
  };
}

constexpr std::int64_t kBatch = 2, kHq = 4, kHkv = 2, kD = 16;

// Sink logits and logit scales of both signs and sizes, one per query head.
void SetHeadParameters(std::int64_t hq) {
  g_sinks.clear();
  g_scales.clear();
  for (std::int64_t h = 0; h < hq; ++h) {
    g_sinks.push_back(1.5f - 0.75f * static_cast<float>(h));
    g_scales.push_back(0.9f - 0.5f * static_cast<float>(h));
  }
}

// The per-head parameters' gradients (of the whole problem, on every rank)
// against the single-process and exact ones.
void ExpectParameterGradients(const AttentionGradients& g, const AttentionGradients& single,
                              const AttentionGradients& exact, const AttentionOptions& o,
                              int ranks) {
  ASSERT_EQ(g.d_sinks.defined(), !o.sinks.empty());
  if (!o.sinks.empty())
    ExpectWithinModel("d_sinks", g.d_sinks, single.d_sinks, exact.d_sinks, ranks);
  ASSERT_EQ(g.d_score_scale.defined(), !o.score_scale.empty());
  if (!o.score_scale.empty()) {
    ExpectWithinModel("d_score_scale", g.d_score_scale, single.d_score_scale, exact.d_score_scale,
                      ranks);
  }
}

void CheckRing(dist::Layout layout, bool backward) {
  const int rank = Rank(), ranks = Ranks();
  SetHeadParameters(kHq);
  for (const Config& c : Configs(ranks)) {
    SCOPED_TRACE(c.name);
    AttentionOptions o;
    c.set(o);
    o.return_lse = true;
    const Problem whole = MakeProblem(kBatch, c.nq * ranks, c.nk * ranks, kHq, kHkv, kD, 11);
    const std::vector<std::int64_t> qrows = ShardRows(layout, rank, ranks, c.nq);
    const std::vector<std::int64_t> krows = ShardRows(layout, rank, ranks, c.nk);
    const Tensor q = TakeRows(whole.q, 1, qrows), k = TakeRows(whole.k, 1, krows),
                 v = TakeRows(whole.v, 1, krows);
    const AttentionResult single = attention(whole.q, whole.k, whole.v, o);
    const AttentionResult exact = attention(F64(whole.q), F64(whole.k), F64(whole.v), Exact(o));
    dist::RingStats stats;
    const AttentionResult got =
        dist::ring_attention(MPI_COMM_WORLD, q, k, v, o, {.layout = layout, .stats = &stats});
    ExpectWithinModel("out", got.out, TakeRows(single.out, 1, qrows), TakeRows(exact.out, 1, qrows),
                      ranks);
    ExpectWithinModel("lse", got.lse, TakeRows(single.lse, 2, qrows), TakeRows(exact.lse, 2, qrows),
                      ranks);
    if (!backward) continue;
    const AttentionGradients gs =
        attention_backward(whole.q, whole.k, whole.v, single.out, whole.dout, single.lse, o);
    const AttentionGradients ge = attention_backward(
        F64(whole.q), F64(whole.k), F64(whole.v), exact.out, F64(whole.dout), exact.lse, Exact(o));
    const Tensor dout = TakeRows(whole.dout, 1, qrows);
    const dist::RingOptions ro{.layout = layout};
    const AttentionGradients g =
        dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, got.out, dout, got.lse, o, ro);
    ExpectWithinModel("dq", g.dq, TakeRows(gs.dq, 1, qrows), TakeRows(ge.dq, 1, qrows), ranks);
    ExpectWithinModel("dk", g.dk, TakeRows(gs.dk, 1, krows), TakeRows(ge.dk, 1, krows), ranks);
    ExpectWithinModel("dv", g.dv, TakeRows(gs.dv, 1, krows), TakeRows(ge.dv, 1, krows), ranks);
    ExpectParameterGradients(g, gs, ge, o, ranks);
    // Deterministic: a second run gives the same bits.
    const AttentionGradients again =
        dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, got.out, dout, got.lse, o, ro);
    EXPECT_EQ(MaxDiff(again.dq, g.dq), 0.0);
    EXPECT_EQ(MaxDiff(again.dk, g.dk), 0.0);
    EXPECT_EQ(MaxDiff(again.dv, g.dv), 0.0);
  }
}

TEST(Ring, ForwardAndBackwardContiguous) { CheckRing(dist::Layout::contiguous, true); }
TEST(Ring, ForwardAndBackwardZigzag) { CheckRing(dist::Layout::zigzag, true); }

// f64 inputs run each piece on the reference backend (in double): the ring
// gives the single-process f64 result to within double rounding, and its
// backward takes each piece's weights from the whole row's lse.
TEST(Ring, Float64OnTheReference) {
  const int rank = Rank(), ranks = Ranks();
  const Problem whole = MakeProblem(1, 4 * ranks, 4 * ranks, kHq, kHkv, 8, 31);
  const Tensor q64 = F64(whole.q), k64 = F64(whole.k), v64 = F64(whole.v), d64 = F64(whole.dout);
  AttentionOptions o;
  o.causal = true;
  o.dropout_p = 0.2;
  o.dropout_seed = 99;
  o.return_lse = true;
  const std::vector<std::int64_t> rows = ShardRows(dist::Layout::zigzag, rank, ranks, 4);
  const AttentionResult single = attention(q64, k64, v64, o);
  const AttentionGradients gs = attention_backward(q64, k64, v64, single.out, d64, single.lse, o);
  const Tensor q = TakeRows(q64, 1, rows), k = TakeRows(k64, 1, rows), v = TakeRows(v64, 1, rows);
  const dist::RingOptions ro{.layout = dist::Layout::zigzag};
  const AttentionResult got = dist::ring_attention(MPI_COMM_WORLD, q, k, v, o, ro);
  const AttentionGradients g = dist::ring_attention_backward(
      MPI_COMM_WORLD, q, k, v, got.out, TakeRows(d64, 1, rows), got.lse, o, ro);
  // A few roundings of double per merge step and per added gradient.
  const double tol = 64.0 * ranks * 0x1p-53;
  EXPECT_LE(MaxDiff(got.out, TakeRows(single.out, 1, rows)), tol * MaxFinite(single.out));
  EXPECT_LE(MaxDiff(got.lse, TakeRows(single.lse, 2, rows)), tol * MaxFinite(single.lse));
  EXPECT_LE(MaxDiff(g.dq, TakeRows(gs.dq, 1, rows)), tol * MaxFinite(gs.dq));
  EXPECT_LE(MaxDiff(g.dk, TakeRows(gs.dk, 1, rows)), tol * MaxFinite(gs.dk));
  EXPECT_LE(MaxDiff(g.dv, TakeRows(gs.dv, 1, rows)), tol * MaxFinite(gs.dv));
}

// Causal, contiguous: rank r needs shards 0..r only, so a shard is sent
// only while a later rank needs it and no rank computes a piece above the
// diagonal.
TEST(Ring, CausalContiguousSendsOnlyNeededShards) {
  const int rank = Rank(), ranks = Ranks();
  const Problem whole = MakeProblem(1, 8 * ranks, 8 * ranks, kHq, kHkv, kD, 5);
  const std::vector<std::int64_t> rows = ShardRows(dist::Layout::contiguous, rank, ranks, 8);
  AttentionOptions o;
  o.causal = true;
  dist::RingStats st;
  dist::ring_attention(MPI_COMM_WORLD, TakeRows(whole.q, 1, rows), TakeRows(whole.k, 1, rows),
                       TakeRows(whole.v, 1, rows), o, {.stats = &st});
  EXPECT_EQ(st.messages_sent, rank + 1 < ranks ? rank + 1 : 0);
  EXPECT_EQ(st.pieces_computed, rank + 1);
}

// Zigzag balances causal work: every rank computes the same number of pieces.
TEST(Ring, ZigzagBalancesCausalWork) {
  const int rank = Rank(), ranks = Ranks();
  const Problem whole = MakeProblem(1, 8 * ranks, 8 * ranks, kHq, kHkv, kD, 6);
  const std::vector<std::int64_t> rows = ShardRows(dist::Layout::zigzag, rank, ranks, 8);
  AttentionOptions o;
  o.causal = true;
  dist::RingStats st;
  dist::ring_attention(MPI_COMM_WORLD, TakeRows(whole.q, 1, rows), TakeRows(whole.k, 1, rows),
                       TakeRows(whole.v, 1, rows), o,
                       {.layout = dist::Layout::zigzag, .stats = &st});
  // Chunk pairs (i, j) with j <= i among the 2R chunks, spread evenly:
  // (2R (2R + 1) / 2) / R = 2R + 1 per rank.
  EXPECT_EQ(st.pieces_computed, 2 * ranks + 1);
}

TEST(Ulysses, ForwardAndBackward) {
  const int rank = Rank(), ranks = Ranks();
  const std::int64_t hkv = ranks, hq = 2 * ranks;  // heads divide over ranks, GQA group 2
  SetHeadParameters(hq);
  for (const Config& c : Configs(ranks)) {
    SCOPED_TRACE(c.name);
    AttentionOptions o;
    c.set(o);
    if (!o.alibi_slopes.empty()) {
      g_slopes.assign(static_cast<std::size_t>(hq), 0.0f);
      for (std::int64_t h = 0; h < hq; ++h) g_slopes[h] = std::ldexp(1.0f, -static_cast<int>(h));
      o.alibi_slopes = g_slopes;
    }
    o.return_lse = true;
    const Problem whole = MakeProblem(kBatch, c.nq * ranks, c.nk * ranks, hq, hkv, kD, 21);
    const std::vector<std::int64_t> qrows = ShardRows(dist::Layout::contiguous, rank, ranks, c.nq);
    const std::vector<std::int64_t> krows = ShardRows(dist::Layout::contiguous, rank, ranks, c.nk);
    const Tensor q = TakeRows(whole.q, 1, qrows), k = TakeRows(whole.k, 1, krows),
                 v = TakeRows(whole.v, 1, krows);
    const AttentionResult single = attention(whole.q, whole.k, whole.v, o);
    const AttentionResult exact = attention(F64(whole.q), F64(whole.k), F64(whole.v), Exact(o));
    const AttentionResult got = dist::ulysses_attention(MPI_COMM_WORLD, q, k, v, o);
    ExpectWithinModel("out", got.out, TakeRows(single.out, 1, qrows), TakeRows(exact.out, 1, qrows),
                      1);
    ExpectWithinModel("lse", got.lse, TakeRows(single.lse, 2, qrows), TakeRows(exact.lse, 2, qrows),
                      1);
    const AttentionGradients gs =
        attention_backward(whole.q, whole.k, whole.v, single.out, whole.dout, single.lse, o);
    const AttentionGradients ge = attention_backward(
        F64(whole.q), F64(whole.k), F64(whole.v), exact.out, F64(whole.dout), exact.lse, Exact(o));
    const AttentionGradients g = dist::ulysses_attention_backward(
        MPI_COMM_WORLD, q, k, v, got.out, TakeRows(whole.dout, 1, qrows), got.lse, o);
    ExpectWithinModel("dq", g.dq, TakeRows(gs.dq, 1, qrows), TakeRows(ge.dq, 1, qrows), 1);
    ExpectWithinModel("dk", g.dk, TakeRows(gs.dk, 1, krows), TakeRows(ge.dk, 1, krows), 1);
    ExpectWithinModel("dv", g.dv, TakeRows(gs.dv, 1, krows), TakeRows(ge.dv, 1, krows), 1);
    ExpectParameterGradients(g, gs, ge, o, 1);
  }
}

// The schedule's test of a (query chunk, key chunk) pair against brute
// force over the definition of qkv/attention.hpp: a pair is skipped exactly
// when no query of it admits any key of it (skipping never drops a key, and
// never computes an empty piece).
TEST(Schedule, ChunkPairsMatchBruteForce) {
  std::mt19937 rng(7);
  auto pick = [&](std::initializer_list<std::int64_t> v) {
    return *(v.begin() + std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng));
  };
  for (int trial = 0; trial < 3000; ++trial) {
    dist::detail::Setup s;
    s.ranks = static_cast<int>(pick({1, 2, 3, 4}));
    s.layout = pick({0, 1}) == 0 ? dist::Layout::contiguous : dist::Layout::zigzag;
    s.batch = 2;
    s.nq = pick({2, 4, 6});
    s.nk = pick({2, 4, 6});
    s.hq = 1;
    AttentionOptions o;
    o.causal = pick({0, 1}) == 1;
    o.align = pick({0, 1}) == 1 ? Align::top_left : Align::bottom_right;
    // Windows up to the int64 limit, which the distances must not overflow.
    constexpr std::int64_t kHuge = std::numeric_limits<std::int64_t>::max();
    o.window_left = pick({-1, 0, 1, 3, 7, kHuge - 1, kHuge});
    o.window_right = pick({-1, 0, 1, 3, 7, kHuge - 1, kHuge});
    std::vector<std::int64_t> lengths;
    if (pick({0, 1}) == 1) {
      for (int b = 0; b < 2; ++b) {
        lengths.push_back(std::uniform_int_distribution<std::int64_t>(0, s.total_k())(rng));
      }
      o.key_lengths = lengths;
    }
    for (const dist::detail::BatchGroup& g : dist::detail::batch_groups(s, o)) {
      for (int a = 0; a < s.ranks; ++a) {
        for (int x = 0; x < s.ranks; ++x) {
          for (const dist::detail::Chunk& qc :
               dist::detail::chunks_of(s.layout, a, s.ranks, s.nq)) {
            for (const dist::detail::Chunk& kc :
                 dist::detail::chunks_of(s.layout, x, s.ranks, s.nk)) {
              bool admitted = false;
              for (std::int64_t b = g.b0; b < g.b0 + g.count; ++b) {
                const std::int64_t valid = lengths.empty() ? s.total_k() : lengths[b];
                const std::int64_t delta = o.align == Align::bottom_right ? valid - s.total_q() : 0;
                for (std::int64_t i = qc.global; i < qc.global + qc.length; ++i) {
                  const std::int64_t p = i + delta;
                  for (std::int64_t j = kc.global; j < kc.global + kc.length; ++j) {
                    admitted = admitted || (j < valid && (!o.causal || j <= p) &&
                                            (o.window_left < 0 || p - j <= o.window_left) &&
                                            (o.window_right < 0 || j - p <= o.window_right));
                  }
                }
              }
              ASSERT_EQ(dist::detail::may_attend(o, g, qc, kc), admitted)
                  << "trial " << trial << ": q chunk at " << qc.global << ", k chunk at "
                  << kc.global;
            }
          }
        }
      }
    }
  }
}

// The message of the qkv::Error every rank throws, or "" if none.
std::string ErrorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A bad shape on the last rank only: every rank throws the same error,
// naming that rank, and nobody waits forever.
TEST(Collective, BadInputOnOneRankRaisesEverywhere) {
  const int rank = Rank(), ranks = Ranks();
  const std::int64_t rows = rank == ranks - 1 ? 6 : 8;
  const Tensor q = random_tensor(DType::f32, {1, rows, kHq, kD}, 1);
  const Tensor k = random_tensor(DType::f32, {1, 8, kHkv, kD}, 2);
  const Tensor v = random_tensor(DType::f32, {1, 8, kHkv, kD}, 3);
  const std::string last = "rank " + std::to_string(ranks - 1) + " of " + std::to_string(ranks);
  if (ranks > 1) {
    const std::string ring = ErrorOf([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v); });
    EXPECT_NE(ring.find("qkv::dist::ring_attention, rank 0 of"), std::string::npos) << ring;
    EXPECT_NE(ring.find("q's rows (dim 1): expected the same value on every rank"),
              std::string::npos)
        << ring;
  }
  // A tensor that fails the library's own checks, on the last rank only:
  // v's KV heads differ from k's there.
  const Tensor bad_v =
      random_tensor(DType::f32, {1, 8, rank == ranks - 1 ? kHkv + 1 : kHkv, kD}, 3);
  const std::string msg =
      ErrorOf([&] { dist::ring_attention(MPI_COMM_WORLD, k.view(), k, bad_v); });
  EXPECT_NE(msg.find("qkv::dist::ring_attention, " + last + ": v"), std::string::npos) << msg;
  // Unsupported options, and heads that do not divide over the ranks.
  AttentionOptions masked;
  const Tensor mask(DType::boolean, {8, 8});
  masked.mask = mask;
  const std::string m =
      ErrorOf([&] { dist::ring_attention(MPI_COMM_WORLD, k.view(), k, k, masked); });
  EXPECT_NE(m.find("options.mask: not supported by qkv::dist::ring_attention"), std::string::npos)
      << m;
  if (ranks == 3) {
    const std::string u = ErrorOf([&] { dist::ulysses_attention(MPI_COMM_WORLD, k.view(), k, k); });
    EXPECT_NE(u.find("Hq and Hkv must be multiples of 3, got Hq = 2 and Hkv = 2"),
              std::string::npos)
        << u;
  }
  AttentionOptions odd;
  const Tensor q3 = random_tensor(DType::f32, {1, 3, kHq, kD}, 1);
  const std::string z = ErrorOf([&] {
    dist::ring_attention(MPI_COMM_WORLD, q3, q3.view().slice(2, 0, kHkv),
                         q3.view().slice(2, 0, kHkv), odd, {.layout = dist::Layout::zigzag});
  });
  EXPECT_NE(z.find("Layout::zigzag expects an even number of rows per rank"), std::string::npos)
      << z;
  // After the errors, the ranks still agree: a good call succeeds.
  const AttentionResult ok = dist::ring_attention(MPI_COMM_WORLD, q.view().slice(1, 0, 6),
                                                  k.view().slice(1, 0, 6), v.view().slice(1, 0, 6));
  EXPECT_EQ(ok.out.size(1), 6);
}

}  // namespace
}  // namespace qkv::test

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  // Only rank 0 prints the test list; failures print on every rank.
  if (qkv::test::Rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
