// Dropout: the Philox4x32-10 generator against Random123's known answers, the
// documented layout of qkv::dropout_keep, the statistics of the mask, and the
// reference forward's use of it (out_i = sum_j P_ij Z_ij / (1 - p) v_j, with
// lse and probs those of P). Gradients with dropout are checked against
// finite differences in backward_reference_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "core/philox.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::DType;
using qkv::Tensor;
using qkv::detail::PhiloxCounter;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

TEST(Dropout, Philox4x32_10KnownAnswers) {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  EXPECT_EQ(qkv::detail::philox4x32_10({0, 0, 0, 0}, 0, 0),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(qkv::detail::philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, 0xffffffff,
                                       0xffffffff),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(qkv::detail::philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, 0xa4093822,
                                       0x299f31d0),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Dropout, KeepFollowsTheDocumentedCounterLayout) {
  // dropout_keep(seed, offset, p, Hq, b, h, i, j): Philox keyed by the seed
  // (low word first) on counter (j / 4, i, b * Hq + h, offset); word j % 4 as
  // u = (word >> 8) * 2^-24 keeps iff u >= p. Probabilities include exact
  // multiples of 2^-24 (the threshold's edge) and values between them.
  const std::uint64_t seed = 0x0123456789abcdefULL;
  const std::uint32_t offset = 77;
  const std::int64_t hq = 3;
  int kept = 0;
  int total = 0;
  for (double p : {0.1, 0.5, 0.75, 12345.0 / 16777216.0, (12345.0 + 0.5) / 16777216.0})
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t i = 0; i < 5; ++i)
          for (std::int64_t j = 0; j < 9; ++j) {
            const PhiloxCounter words = qkv::detail::philox4x32_10(
                {static_cast<std::uint32_t>(j / 4), static_cast<std::uint32_t>(i),
                 static_cast<std::uint32_t>(b * hq + h), offset},
                0x89abcdefu, 0x01234567u);
            const double u = std::ldexp(static_cast<double>(words[j % 4] >> 8), -24);
            const bool keep = qkv::dropout_keep(seed, offset, p, hq, b, h, i, j);
            EXPECT_EQ(keep, u >= p)
                << "p=" << p << " b=" << b << " h=" << h << " i=" << i << " j=" << j;
            kept += keep ? 1 : 0;
            ++total;
          }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, total);
}

// Number of kept weights of dropout_keep over a [2, 4, 64, 64] grid, keys
// restricted to j % 4 == lane (lane < 0: all keys).
std::int64_t count_kept(std::uint64_t seed, std::uint32_t offset, double p, int lane,
                        std::int64_t* n) {
  std::int64_t kept = 0;
  *n = 0;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 64; ++i)
        for (std::int64_t j = 0; j < 64; ++j) {
          if (lane >= 0 && j % 4 != lane) continue;
          kept += qkv::dropout_keep(seed, offset, p, 4, b, h, i, j) ? 1 : 0;
          ++*n;
        }
  return kept;
}

TEST(Dropout, KeptFractionIsOneMinusP) {
  // Each weight is kept independently with probability 1 - p, so the kept
  // count of n weights is Binomial(n, 1 - p): its fraction has standard
  // deviation sqrt(p (1 - p) / n), and a fraction 5 of them away from 1 - p
  // has probability below 1e-6. Each word position (j % 4) is checked too.
  for (double p : {0.1, 0.5, 0.9}) {
    for (int lane = -1; lane < 4; ++lane) {
      std::int64_t n = 0;
      const double fraction = static_cast<double>(count_kept(2024, 1, p, lane, &n)) / double(n);
      EXPECT_NEAR(fraction, 1.0 - p, 5.0 * std::sqrt(p * (1.0 - p) / double(n)))
          << "p=" << p << " lane=" << lane;
    }
  }
}

TEST(Dropout, SeedsAndOffsetsGiveDifferentMasks) {
  // Masks of two independent generators agree on a weight with probability
  // a = p^2 + (1 - p)^2 (0.5 for p = 0.5); the agreement of n weights is
  // within 5 binomial standard deviations sqrt(a (1 - a) / n) of a. The same
  // generator agrees with itself everywhere.
  const double p = 0.5;
  const double a = p * p + (1 - p) * (1 - p);
  struct Key {
    std::uint64_t seed;
    std::uint32_t offset;
  };
  const Key base{99, 4};
  for (const Key other : {Key{100, 4}, Key{99, 5}, Key{99ULL + (1ULL << 32), 4}, Key{99, 4}}) {
    std::int64_t agree = 0;
    std::int64_t n = 0;
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 32; ++i)
        for (std::int64_t j = 0; j < 64; ++j, ++n) {
          agree += qkv::dropout_keep(base.seed, base.offset, p, 4, 0, h, i, j) ==
                   qkv::dropout_keep(other.seed, other.offset, p, 4, 0, h, i, j);
        }
    const double fraction = static_cast<double>(agree) / double(n);
    if (other.seed == base.seed && other.offset == base.offset) {
      EXPECT_EQ(agree, n);
    } else {
      EXPECT_NEAR(fraction, a, 5.0 * std::sqrt(a * (1 - a) / double(n)))
          << "seed " << other.seed << " offset " << other.offset;
    }
  }
}

struct Qkv {
  Tensor q, k, v;
};

Qkv random_qkv(std::int64_t b, std::int64_t nq, std::int64_t nk, std::int64_t hq, std::int64_t hkv,
               std::int64_t d, std::int64_t dv, std::uint32_t seed) {
  return {random_tensor(DType::f64, {b, nq, hq, d}, seed),
          random_tensor(DType::f64, {b, nk, hkv, d}, seed + 1),
          random_tensor(DType::f64, {b, nk, hkv, dv}, seed + 2)};
}

qkv::AttentionResult run(const Qkv& x, AttentionOptions opt) {
  opt.backend = qkv::Backend::reference;
  opt.return_lse = true;
  opt.return_probs = true;
  return qkv::attention(x.q, x.k, x.v, opt);
}

// Expects out[b, q_begin + i, h, c] = sum_j P_ij Z_ij / (1 - p) v[b, k_begin + j, h / group, c]
// for the rows of one sequence s, with P from `probs` and Z from
// dropout_keep. Both sides sum at most Nk terms of size <= r = 1 / (1 - p)
// in double, so they agree to Nk r u ~ 1e-15; 1e-14 leaves room.
void expect_documented_dropout(const Qkv& x, const qkv::AttentionResult& r,
                               const AttentionOptions& opt, std::int64_t s, std::int64_t b,
                               std::int64_t q_begin, std::int64_t nq, std::int64_t k_begin,
                               std::int64_t nk) {
  const std::int64_t hq = x.q.size(2);
  const std::int64_t group = hq / x.k.size(2);
  const double scale = 1.0 / (1.0 - opt.dropout_p);
  for (std::int64_t h = 0; h < hq; ++h)
    for (std::int64_t i = 0; i < nq; ++i)
      for (std::int64_t c = 0; c < x.v.size(3); ++c) {
        double want = 0.0;
        for (std::int64_t j = 0; j < nk; ++j) {
          if (!qkv::dropout_keep(opt.dropout_seed, opt.dropout_offset, opt.dropout_p, hq, s, h, i,
                                 j)) {
            continue;
          }
          want += r.probs.get({b, h, q_begin + i, k_begin + j}) * scale *
                  x.v.get({b, k_begin + j, h / group, c});
        }
        EXPECT_NEAR(r.out.get({b, q_begin + i, h, c}), want, 1e-14)
            << "s=" << s << " h=" << h << " i=" << i << " c=" << c;
      }
}

TEST(Dropout, ForwardAppliesTheDocumentedMask) {
  AttentionOptions opt;
  opt.dropout_p = 0.4;
  opt.dropout_seed = 0xfeedfacecafebeefULL;
  opt.dropout_offset = 12;
  opt.causal = true;
  // Dense batch, grouped-query heads, Nk not a multiple of 4.
  const Qkv x = random_qkv(2, 6, 11, 4, 2, 8, 5, 1);
  const auto with = run(x, opt);
  for (std::int64_t b = 0; b < 2; ++b) expect_documented_dropout(x, with, opt, b, b, 0, 6, 0, 11);
  // lse and probs are those of the softmax before dropout.
  AttentionOptions without = opt;
  without.dropout_p = 0.0;
  const auto plain = run(x, without);
  EXPECT_EQ(max_abs_diff(with.lse, plain.lse), 0.0);
  EXPECT_EQ(max_abs_diff(with.probs, plain.probs), 0.0);
  EXPECT_GT(max_abs_diff(with.out, plain.out), 0.1);

  // Packed sequences: b is the sequence, i and j positions inside it.
  const std::int64_t cu_q[] = {0, 3, 3, 8};
  const std::int64_t cu_k[] = {0, 5, 7, 13};
  const Qkv y = random_qkv(1, 8, 13, 4, 1, 8, 5, 2);
  AttentionOptions packed = opt;
  packed.cu_seqlens_q = cu_q;
  packed.cu_seqlens_k = cu_k;
  const auto r = run(y, packed);
  for (std::int64_t s = 0; s < 3; ++s) {
    expect_documented_dropout(y, r, packed, s, 0, cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s],
                              cu_k[s + 1] - cu_k[s]);
  }
}

TEST(Dropout, ZeroProbabilityIsExactlyNoDropout) {
  const Qkv x = random_qkv(2, 5, 7, 4, 2, 8, 6, 3);
  AttentionOptions opt;
  opt.causal = true;
  AttentionOptions zero = opt;
  zero.dropout_p = 0.0;
  zero.dropout_seed = 1234;
  zero.dropout_offset = 9;
  EXPECT_EQ(max_abs_diff(run(x, opt).out, run(x, zero).out), 0.0);
}

TEST(Dropout, ExpectationOverSeedsIsTheUndroppedOutput) {
  // E[Z_ij / (1 - p)] = 1, so E[out_i] = sum_j P_ij v_j, the output without
  // dropout. Its variance is sum_j P_ij^2 v_jc^2 Var(Z_ij) / (1 - p)^2 =
  // sum_j P_ij^2 v_jc^2 p / (1 - p); the mean of S seeds has that over S, and
  // by the central limit theorem lies within 5 of its standard deviations of
  // the expectation except with probability below 1e-6 per element.
  const Qkv x = random_qkv(1, 4, 6, 2, 1, 4, 3, 4);
  const auto plain = run(x, {});
  const double p = 0.5;
  const int seeds = 400;
  Tensor mean(DType::f64, {1, 4, 2, 3});
  AttentionOptions opt;
  opt.dropout_p = p;
  opt.dropout_offset = 3;
  for (int seed = 0; seed < seeds; ++seed) {
    opt.dropout_seed = static_cast<std::uint64_t>(seed);
    const auto r = run(x, opt);
    qkv::detail::for_each_index(mean.sizes(), 4, [&](const qkv::Shape& i) {
      mean.set({i[0], i[1], i[2], i[3]},
               mean.get({i[0], i[1], i[2], i[3]}) + r.out.get({i[0], i[1], i[2], i[3]}) / seeds);
    });
  }
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 4; ++i)
      for (std::int64_t c = 0; c < 3; ++c) {
        double variance = 0.0;
        for (std::int64_t j = 0; j < 6; ++j) {
          const double pv = plain.probs.get({0, h, i, j}) * x.v.get({0, j, 0, c});
          variance += pv * pv * p / (1.0 - p);
        }
        EXPECT_NEAR(mean.get({0, i, h, c}), plain.out.get({0, i, h, c}),
                    5.0 * std::sqrt(variance / seeds))
            << "h=" << h << " i=" << i << " c=" << c;
      }
}

TEST(Dropout, NaiveAttentionAppliesTheSameMask) {
  // q = 0 makes every score 0 and every weight exactly 1/4 over 4 keys; with
  // p = 0.5 the kept weights are exactly 1/2 and values are multiples of 1/8,
  // so out = (1/2) sum of kept v_j is exact in every precision of the naive
  // computation, and must equal the documented formula exactly.
  const std::int64_t b = 2, nq = 3, nk = 4, hq = 2, d = 4, dv = 3;
  Tensor q(DType::f32, {b, nq, hq, d});
  const Tensor k = random_tensor(DType::f32, {b, nk, 1, d}, 5);
  Tensor v(DType::f32, {b, nk, 1, dv});
  qkv::detail::for_each_index(v.sizes(), 4, [&](const qkv::Shape& i) {
    v.set({i[0], i[1], i[2], i[3]}, double((i[0] * 5 + i[1] * 3 + i[3] * 7) % 11 - 5) / 8.0);
  });
  AttentionOptions opt;
  opt.dropout_p = 0.5;
  opt.dropout_seed = 31337;
  opt.dropout_offset = 2;
  const qkv::detail::AttentionProblem problem = qkv::detail::check_attention_inputs(q, k, v, opt);
  for (DType precision : {DType::f32, DType::f16, DType::bf16}) {
    Tensor out(DType::f32, {b, nq, hq, dv});
    qkv::reference::naive_attention(problem, q, k, v, {out, {}, {}}, opt, precision);
    for (std::int64_t s = 0; s < b; ++s)
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t i = 0; i < nq; ++i)
          for (std::int64_t c = 0; c < dv; ++c) {
            double want = 0.0;
            for (std::int64_t j = 0; j < nk; ++j) {
              if (qkv::dropout_keep(opt.dropout_seed, opt.dropout_offset, opt.dropout_p, hq, s, h,
                                    i, j)) {
                want += 0.5 * v.get({s, j, 0, c});
              }
            }
            EXPECT_EQ(out.get({s, i, h, c}), want)
                << qkv::dtype_name(precision) << " s=" << s << " h=" << h << " i=" << i;
          }
  }
}

TEST(Dropout, InvalidProbabilityNamesTheOption) {
  const Qkv x = random_qkv(1, 2, 3, 1, 1, 4, 4, 6);
  const auto fwd = run(x, {});
  for (double p : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    AttentionOptions opt;
    opt.backend = qkv::Backend::reference;
    opt.dropout_p = p;
    for (bool backward : {false, true}) {
      try {
        if (backward) {
          qkv::attention_backward(x.q, x.k, x.v, fwd.out, fwd.out, fwd.lse, opt);
        } else {
          qkv::attention(x.q, x.k, x.v, opt);
        }
        ADD_FAILURE() << "dropout_p = " << p << " was accepted";
      } catch (const qkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find("options.dropout_p"), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
