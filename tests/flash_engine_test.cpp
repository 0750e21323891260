// The fused forward on bf16 engines (cpu/flash_engine-inl.h), run through
// each engine's portable emulation (and the instruction where this CPU has
// it): the packing of Q, K and V in pairs, the blocking, the tails of odd
// head dims, blocks starting at odd keys, the per-block packing, GQA, Dk !=
// Dv, masks, windows, softcap, ALiBi, sinks and dropout.
//
// Error model: the engine path computes what the f32 path computes on the
// same bf16 operands, except that each weight P is rounded to bf16 before
// P V (FlashAttention's rounding) and the f32 sums run in another order. So
// per output element, |engine - f32 path| <= 2^-8 sum_j p_j |v_j| (half a
// bf16 ulp per weight) <= 2^-8 max|v|, plus the outputs' own rounding
// (half an ulp of the output dtype each), plus f32 terms of the scores'
// sums: bounded by 2 dk u32 scale sum|q||k| e-fold in the weights, within
// 1% of the first term at these sizes and ranges.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/select.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::DType;
using qkv::Tensor;
using qkv::cpu::engines::Bf16Engine;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

struct Case {
  std::string name;
  std::int64_t b, nq, nk, hq, hkv, dk, dv;
  AttentionOptions options;
};

std::vector<float> slopes(std::int64_t hq) {
  std::vector<float> s;
  for (std::int64_t h = 0; h < hq; ++h) s.push_back(std::ldexp(1.0f, -static_cast<int>(h + 1)));
  return s;
}

const std::vector<float> kSlopes = slopes(4);
const std::vector<float> kSinks = {0.5f, -1.0f, 2.0f, 0.0f};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"gqa", 2, 37, 70, 4, 2, 64, 64, {}});
  AttentionOptions causal;
  causal.causal = true;
  c.push_back({"causal odd dk", 1, 150, 150, 2, 1, 33, 32, causal});
  AttentionOptions window;
  window.window_left = 17;
  window.window_right = 3;
  c.push_back({"window (blocks at odd keys)", 1, 130, 130, 2, 2, 32, 48, window});
  c.push_back({"dk != dv", 1, 20, 45, 2, 1, 48, 80, {}});
  AttentionOptions mods;
  mods.softcap = 5.0;
  mods.alibi_slopes = kSlopes;
  mods.sinks = kSinks;
  c.push_back({"softcap alibi sinks", 1, 40, 90, 4, 2, 64, 64, mods});
  AttentionOptions dropout;
  dropout.dropout_p = 0.2;
  dropout.dropout_seed = 7;
  c.push_back({"dropout", 1, 30, 60, 2, 1, 32, 32, dropout});
  return c;
}

struct Outputs {
  Tensor out, lse;
};

Outputs run(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o,
            std::optional<Bf16Engine> engine) {
  qkv::cpu::engines::set_bf16_engine_for_test(engine);
  AttentionOptions options = o;
  options.return_lse = true;
  auto r = qkv::attention(q, k, v, options);
  qkv::cpu::engines::reset_bf16_engine_for_test();
  return {std::move(r.out), std::move(r.lse)};
}

// The engine's result against the f32 path's on the same operands, within
// the header's model; and the engine ran (the weights' rounding shows).
void expect_within_model(const Case& c, DType dtype, Bf16Engine engine, std::uint32_t seed,
                         const AttentionOptions& options) {
  SCOPED_TRACE(c.name + " " + qkv::cpu::engines::engine_name(engine) + " " +
               std::string(qkv::dtype_name(dtype)));
  const Tensor q = random_tensor(dtype, {c.b, c.nq, c.hq, c.dk}, seed, -2.0, 2.0);
  const Tensor k = random_tensor(dtype, {c.b, c.nk, c.hkv, c.dk}, seed + 1, -2.0, 2.0);
  const Tensor v = random_tensor(dtype, {c.b, c.nk, c.hkv, c.dv}, seed + 2);
  const Outputs got = run(q, k, v, options, engine);
  // The f32 path on the same bf16 operands: for f32 inputs under medium,
  // the inputs rounded to bf16 first (and kept in f32) at highest.
  AttentionOptions highest = options;
  highest.matmul_precision = qkv::MatmulPrecision::highest;
  const auto to_bf16_values = [](const Tensor& t) {
    return qkv::to_dtype(qkv::to_dtype(t, DType::bf16), t.dtype());
  };
  const Outputs want = dtype == DType::bf16 ? run(q, k, v, highest, std::nullopt)
                                            : run(to_bf16_values(q), to_bf16_values(k),
                                                  to_bf16_values(v), highest, std::nullopt);
  const double u_out = dtype == DType::bf16 ? std::ldexp(1.0, -8) : 0.0;
  const double bound = std::ldexp(1.0, -8) * max_abs(v) * 1.01 + 2 * u_out * max_abs(want.out) +
                       64 * std::ldexp(1.0, -24);
  const double diff = max_abs_diff(got.out, want.out);
  std::printf("[ engine ] %-28s %-22s %s: |diff| %.3g (bound %.3g)\n", c.name.c_str(),
              qkv::cpu::engines::engine_name(engine), std::string(qkv::dtype_name(dtype)).c_str(),
              diff, bound);
  EXPECT_LE(diff, bound);
  EXPECT_GT(diff, 0.0) << "the engine did not run";
  // lse comes from f32 scores of the same operands: sums in another order.
  EXPECT_LE(max_abs_diff(got.lse, want.lse), 1e-4);
}

constexpr Bf16Engine kEmulations[] = {Bf16Engine::emulate_avx512_bf16,
                                      Bf16Engine::emulate_amx_bf16};

TEST(FlashEngine, Bf16InputsWithinTheModel) {
  std::uint32_t seed = 10;
  for (const Bf16Engine e : kEmulations) {
    for (const Case& c : cases()) expect_within_model(c, DType::bf16, e, seed += 3, c.options);
  }
}

TEST(FlashEngine, MediumPrecisionRoundsF32AndF16Inputs) {
  std::uint32_t seed = 50;
  for (const DType dtype : {DType::f32, DType::f16}) {
    for (const Case& c : cases()) {
      AttentionOptions medium = c.options;
      medium.matmul_precision = qkv::MatmulPrecision::medium;
      expect_within_model(c, dtype, Bf16Engine::emulate_amx_bf16, seed += 3, medium);
    }
  }
}

TEST(FlashEngine, PackingPerBlockEqualsPackingPerTask) {
  // A budget of one byte: every block packs its own keys, pairs from the
  // block's first key; the result is the same bit for bit.
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Tensor q = random_tensor(DType::bf16, {c.b, c.nq, c.hq, c.dk}, 3);
    const Tensor k = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dk}, 4);
    const Tensor v = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dv}, 5);
    const Outputs task = run(q, k, v, c.options, Bf16Engine::emulate_avx512_bf16);
    ASSERT_EQ(setenv("QKV_FLASH_PACKED_KEYS_BYTES", "1", 1), 0);
    const Outputs block = run(q, k, v, c.options, Bf16Engine::emulate_avx512_bf16);
    ASSERT_EQ(unsetenv("QKV_FLASH_PACKED_KEYS_BYTES"), 0);
    // Same pairs of keys except where a block starts at an odd key: there
    // the per-task pairs hold a zero-weighted neighbour, which adds zero.
    EXPECT_EQ(max_abs_diff(task.out, block.out), 0.0);
  }
}

TEST(FlashEngine, BitwiseTheSameOnAnyThreadCount) {
  const Case c = cases()[1];
  const Tensor q = random_tensor(DType::bf16, {c.b, c.nq, c.hq, c.dk}, 8);
  const Tensor k = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dk}, 9);
  const Tensor v = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dv}, 10);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs one = run(q, k, v, c.options, Bf16Engine::emulate_amx_bf16);
  omp_set_num_threads(3);
  const Outputs three = run(q, k, v, c.options, Bf16Engine::emulate_amx_bf16);
  omp_set_num_threads(threads);
  EXPECT_EQ(max_abs_diff(one.out, three.out), 0.0);
  EXPECT_EQ(max_abs_diff(one.lse, three.lse), 0.0);
}

// The backward's error model against the f32 backward on the same
// operands: rounding P to bf16 moves dV_j by at most 2^-8 sum_r P_rj |dO_r|
// <= 2^-8 C max|dO|, C the largest column sum of P over the rows and heads
// sharing the key (times 1 / (1 - p) with dropout); rounding dS moves dK_j
// by at most scale 2^-8 sum_r |dS_rj| |Q_r|, with |dS_rj| <= P_rj (|dP_rj| +
// |D_r|) <= 2 P_rj Dv max|dO| max|V|, and dQ_r likewise with sum_j P_rj = 1
// and |K_j|; each bf16 gradient adds its own rounding (half an ulp) on both
// sides.
void expect_backward_within_model(const Case& c, DType dtype, Bf16Engine engine, std::uint32_t seed,
                                  const AttentionOptions& options) {
  SCOPED_TRACE(c.name + " " + qkv::cpu::engines::engine_name(engine) + " " +
               std::string(qkv::dtype_name(dtype)));
  const auto rounded = [&](const Tensor& t) {
    return dtype == DType::bf16 ? qkv::to_dtype(t, DType::bf16)
                                : qkv::to_dtype(qkv::to_dtype(t, DType::bf16), dtype);
  };
  const Tensor q = rounded(random_tensor(DType::f32, {c.b, c.nq, c.hq, c.dk}, seed, -2.0, 2.0));
  const Tensor k =
      rounded(random_tensor(DType::f32, {c.b, c.nk, c.hkv, c.dk}, seed + 1, -2.0, 2.0));
  const Tensor v = rounded(random_tensor(DType::f32, {c.b, c.nk, c.hkv, c.dv}, seed + 2));
  const Tensor dout = rounded(random_tensor(DType::f32, {c.b, c.nq, c.hq, c.dv}, seed + 3));
  AttentionOptions highest = options;
  highest.matmul_precision = qkv::MatmulPrecision::highest;
  highest.return_lse = true;
  highest.return_probs = true;
  qkv::cpu::engines::set_bf16_engine_for_test(std::nullopt);
  const auto fwd = qkv::attention(q, k, v, highest);
  const auto want = qkv::attention_backward(q, k, v, fwd.out, dout, fwd.lse, highest);
  qkv::cpu::engines::set_bf16_engine_for_test(engine);
  const auto got = qkv::attention_backward(q, k, v, fwd.out, dout, fwd.lse, options);
  qkv::cpu::engines::reset_bf16_engine_for_test();

  // C: the largest sum of P over the rows and heads that see one key.
  const Tensor probs = qkv::to_dtype(fwd.probs, DType::f64);
  const double* pr = probs.data<double>();
  const std::int64_t group = c.hq / c.hkv;
  double col_sum = 0.0;
  for (std::int64_t b = 0; b < c.b; ++b) {
    for (std::int64_t hk = 0; hk < c.hkv; ++hk) {
      for (std::int64_t j = 0; j < c.nk; ++j) {
        double sum = 0.0;
        for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          for (std::int64_t i = 0; i < c.nq; ++i) sum += pr[((b * c.hq + h) * c.nq + i) * c.nk + j];
        }
        col_sum = std::max(col_sum, sum);
      }
    }
  }
  const double keep = options.dropout_p > 0 ? 1.0 / (1.0 - options.dropout_p) : 1.0;
  const double u8 = std::ldexp(1.0, -8);
  const double u_out =
      dtype == DType::bf16 ? u8 : (dtype == DType::f16 ? std::ldexp(1.0, -11) : 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  const double ds_max = 2.0 * keep * c.dv * max_abs(dout) * max_abs(v);
  const double slack = 1.05;
  const double f32 = 256 * std::ldexp(1.0, -24);
  const double dv_bound =
      slack * u8 * keep * col_sum * max_abs(dout) + 2 * u_out * max_abs(want.dv) + f32;
  const double dk_bound = slack * scale * u8 * ds_max * col_sum * max_abs(q) +
                          2 * u_out * max_abs(want.dk) + f32 * max_abs(want.dk);
  const double dq_bound = slack * scale * u8 * ds_max * max_abs(k) + 2 * u_out * max_abs(want.dq) +
                          f32 * max_abs(want.dq);
  const double ddv = max_abs_diff(got.dv, want.dv), ddk = max_abs_diff(got.dk, want.dk),
               ddq = max_abs_diff(got.dq, want.dq);
  std::printf("[ engine ] backward %-28s %s: dv %.3g (%.3g) dk %.3g (%.3g) dq %.3g (%.3g)\n",
              c.name.c_str(), std::string(qkv::dtype_name(dtype)).c_str(), ddv, dv_bound, ddk,
              dk_bound, ddq, dq_bound);
  EXPECT_LE(ddv, dv_bound);
  EXPECT_LE(ddk, dk_bound);
  EXPECT_LE(ddq, dq_bound);
  EXPECT_GT(ddv + ddk + ddq, 0.0) << "the engine did not run";
}

TEST(FlashEngine, BackwardWithinTheModel) {
  std::uint32_t seed = 200;
  for (const Bf16Engine e : kEmulations) {
    for (const Case& c : cases()) {
      expect_backward_within_model(c, DType::bf16, e, seed += 5, c.options);
    }
  }
  for (const Case& c : cases()) {
    AttentionOptions medium = c.options;
    medium.matmul_precision = qkv::MatmulPrecision::medium;
    expect_backward_within_model(c, DType::f32, Bf16Engine::emulate_avx512_bf16, seed += 5, medium);
  }
}

// Cosine similarity of two tensors' values, in double.
double cosine(const Tensor& a, const Tensor& b) {
  const Tensor x = qkv::to_dtype(a, DType::f64), y = qkv::to_dtype(b, DType::f64);
  double xy = 0, xx = 0, yy = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    xy += x.data<double>()[i] * y.data<double>()[i];
    xx += x.data<double>()[i] * x.data<double>()[i];
    yy += y.data<double>()[i] * y.data<double>()[i];
  }
  return xy / std::sqrt(xx * yy);
}

// MatmulPrecision::int8 (the emulated int8 engine with the emulated bf16
// one) against the reference in f64: random inputs, and keys whose
// channels carry large offsets shared by every key (which smoothing K by
// its mean removes) and a few large entries. SageAttention's measure:
// cosine similarity of the outputs, here >= 0.999.
TEST(FlashEngine, Int8ScoresAgainstF64) {
  struct Keys {
    const char* name;
    double offset;   // added to channel 3 of every key
    double outlier;  // a few entries this large
  };
  for (const Keys keys : {Keys{"random", 0.0, 0.0}, Keys{"channel offsets", 20.0, 0.0},
                          Keys{"outlier entries", 0.0, 8.0}}) {
    for (const Case& c : cases()) {
      if (c.options.dropout_p > 0) continue;  // compared with the reference, which draws alike
      SCOPED_TRACE(std::string(keys.name) + " " + c.name);
      const Tensor q = random_tensor(DType::f32, {c.b, c.nq, c.hq, c.dk}, 31, -2.0, 2.0);
      Tensor k = random_tensor(DType::f32, {c.b, c.nk, c.hkv, c.dk}, 32, -2.0, 2.0);
      const Tensor v = random_tensor(DType::f32, {c.b, c.nk, c.hkv, c.dv}, 33);
      float* kd = k.data<float>();
      for (std::int64_t i = 0; i < k.numel(); ++i) {
        if (i % c.dk == 3) kd[i] += static_cast<float>(keys.offset);
        if (i % 997 == 5) kd[i] = static_cast<float>(keys.outlier != 0 ? keys.outlier : kd[i]);
      }
      AttentionOptions int8 = c.options;
      int8.matmul_precision = qkv::MatmulPrecision::int8;
      qkv::cpu::engines::set_bf16_engine_for_test(Bf16Engine::emulate_amx_bf16);
      qkv::cpu::engines::set_int8_engine_for_test(qkv::cpu::engines::Int8Engine::emulate);
      const Tensor got = qkv::attention(q, k, v, int8).out;
      AttentionOptions medium = c.options;
      medium.matmul_precision = qkv::MatmulPrecision::medium;
      const Tensor bf16 = qkv::attention(q, k, v, medium).out;
      qkv::cpu::engines::reset_bf16_engine_for_test();
      AttentionOptions reference = c.options;
      reference.backend = qkv::Backend::reference;
      const Tensor exact =
          qkv::attention(qkv::to_dtype(q, DType::f64), qkv::to_dtype(k, DType::f64),
                         qkv::to_dtype(v, DType::f64), reference)
              .out;
      const double cos = cosine(got, exact);
      std::printf("[ int8 ] %-16s %-28s cosine %.6f, max|err| %.3g (medium: %.6f, %.3g)\n",
                  keys.name, c.name.c_str(), cos, max_abs_diff(got, exact), cosine(bf16, exact),
                  max_abs_diff(bf16, exact));
      EXPECT_GE(cos, 0.999);
      EXPECT_GT(max_abs_diff(got, bf16), 0.0) << "the int8 scores did not run";
    }
  }
}

// A NaN key spoils only the scores of the rows that see it, as on the f32
// path: causal rows before it stay finite (a fuzzer found the NaN reaching
// the int8 conversion, undefined behaviour, and the task's mean key).
TEST(FlashEngine, Int8NonFiniteKeySpoilsOnlyItsRows) {
  const std::int64_t n = 40, bad = 30;
  const Tensor q = random_tensor(DType::f32, {1, n, 2, 32}, 51);
  Tensor k = random_tensor(DType::f32, {1, n, 1, 32}, 52);
  const Tensor v = random_tensor(DType::f32, {1, n, 1, 32}, 53);
  k.data<float>()[bad * 32 + 5] = std::numeric_limits<float>::quiet_NaN();
  AttentionOptions o;
  o.causal = true;
  o.backend = qkv::Backend::fast;
  o.matmul_precision = qkv::MatmulPrecision::int8;
  qkv::cpu::engines::set_bf16_engine_for_test(Bf16Engine::emulate_amx_bf16);
  qkv::cpu::engines::set_int8_engine_for_test(qkv::cpu::engines::Int8Engine::emulate);
  const Tensor out = qkv::attention(q, k, v, o).out;
  qkv::cpu::engines::reset_bf16_engine_for_test();
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t x = 0; x < 2 * 32; ++x) {
      const float y = out.data<float>()[i * 2 * 32 + x];
      ASSERT_EQ(std::isfinite(y), i < bad) << "row " << i;
    }
  }
}

// Without an int8 engine, int8 is medium bit for bit.
TEST(FlashEngine, Int8WithoutItsEngineIsMedium) {
  const Case c = cases()[0];
  const Tensor q = random_tensor(DType::bf16, {c.b, c.nq, c.hq, c.dk}, 41);
  const Tensor k = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dk}, 42);
  const Tensor v = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dv}, 43);
  AttentionOptions int8;
  int8.matmul_precision = qkv::MatmulPrecision::int8;
  qkv::cpu::engines::set_bf16_engine_for_test(Bf16Engine::emulate_avx512_bf16);
  qkv::cpu::engines::set_int8_engine_for_test(std::nullopt);
  const Tensor a = qkv::attention(q, k, v, int8).out;
  const Tensor b = qkv::attention(q, k, v).out;
  qkv::cpu::engines::reset_bf16_engine_for_test();
  EXPECT_EQ(max_abs_diff(a, b), 0.0);
}

// Where this CPU has an engine, the instruction gives its emulation's
// result (AVX512-BF16 bit for bit; AMX within the model, whose order of a
// pair's products the hardware may not keep).
TEST(FlashEngine, InstructionsMatchTheirEmulations) {
  const std::pair<Bf16Engine, Bf16Engine> engines[] = {
      {Bf16Engine::avx512_bf16, Bf16Engine::emulate_avx512_bf16},
      {Bf16Engine::amx_bf16, Bf16Engine::emulate_amx_bf16}};
  int ran = 0;
  for (const auto& [hardware, emulation] : engines) {
    if (!qkv::cpu::engines::engine_available(hardware)) continue;
    ++ran;
    for (const Case& c : cases()) {
      SCOPED_TRACE(c.name);
      const Tensor q = random_tensor(DType::bf16, {c.b, c.nq, c.hq, c.dk}, 11);
      const Tensor k = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dk}, 12);
      const Tensor v = random_tensor(DType::bf16, {c.b, c.nk, c.hkv, c.dv}, 13);
      const Outputs hw = run(q, k, v, c.options, hardware);
      const Outputs em = run(q, k, v, c.options, emulation);
      if (hardware == Bf16Engine::avx512_bf16) {
        EXPECT_EQ(max_abs_diff(hw.out, em.out), 0.0);
      } else {
        EXPECT_LE(max_abs_diff(hw.out, em.out), std::ldexp(1.0, -7) * max_abs(em.out) + 1e-6);
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no bf16 engine on this CPU: the emulations ran above";
}

}  // namespace
