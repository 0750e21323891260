// Fuzzes qkv::dist (ring_attention, ring_attention_backward,
// ulysses_attention, ulysses_attention_backward) in one MPI process (the
// singleton world: one rank): fuzzed shapes, dtypes, strided and broadcast
// views, every option the functions support, sometimes bad ones (an
// unsupported option, a set shard, an unknown layout, malformed views, odd
// rows for zigzag, key lengths beyond the sequence).
//
// Checks: only qkv::Error escapes; a call the fuzzer made bad is rejected;
// the backward accepts the forward's own outputs; on finite inputs the
// forward equals one qkv::attention call on the same inputs within the
// error model of docs/distributed.md (twice the single call's distance to
// the f64 reference plus 4 u M per merged part, M = max|v| / (1 - p), the
// largest a part's output can be, which its rounding is relative to, plus
// M (e^(2 parts u32 L) - 1) for the parts' lse rounded to f32, L =
// max|lse|: the weights' exponents are off by up to u32 |lse| each); on
// finite inputs with a finite forward, the gradients are finite. (The
// gradients' values are checked against single-process ones in
// tests/dist, on moderate inputs: with scores of 1e7 and more the
// gradient is ill-conditioned in out and lse, which the merge rounds.)
#include <mpi.h>

#include "fuzz_common.hpp"
#include "qkv/distributed.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::fuzz::Arg;
using qkv::fuzz::Input;
using qkv::fuzz::require;

double max_diff(ConstTensorView a, ConstTensorView b) {
  double worst = 0;
  qkv::detail::for_each_index(a.sizes(), a.rank(), [&](const qkv::Shape& idx) {
    const double x =
        qkv::detail::load(a.data(), a.dtype(), qkv::detail::offset(idx, a.strides(), a.rank()));
    const double y =
        qkv::detail::load(b.data(), b.dtype(), qkv::detail::offset(idx, b.strides(), b.rank()));
    if (x != y) worst = std::max(worst, std::isnan(x - y) ? qkv::fuzz::kInf : std::abs(x - y));
  });
  return worst;
}

double max_finite(ConstTensorView a) {
  double m = 0;
  qkv::detail::for_each_index(a.sizes(), a.rank(), [&](const qkv::Shape& idx) {
    const double x =
        qkv::detail::load(a.data(), a.dtype(), qkv::detail::offset(idx, a.strides(), a.rank()));
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  });
  return m;
}

// The error model: `got` (distributed) and `single` (one call) against
// `exact` (f64 reference) on the same inputs; `magnitude` bounds the
// values each merged part holds.
void check_model(const char* what, ConstTensorView got, ConstTensorView single,
                 ConstTensorView exact, double parts, DType dtype, double magnitude,
                 double extra = 0) {
  const double bound = 2 * max_diff(single, exact) +
                       4 * parts * qkv::test::unit_roundoff(dtype) * magnitude + extra + 1e-30;
  const double error = max_diff(got, exact);
  require(error <= bound, std::string(what) + ": distance to the reference " +
                              std::to_string(error) + " beyond the model's " +
                              std::to_string(bound));
}

Tensor f64(ConstTensorView t) { return qkv::to_dtype(t, DType::f64); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The singleton world, started once (fuzz_common.hpp owns
  // LLVMFuzzerInitialize); MPI ends with the process.
  static const bool started = [] {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    return true;
  }();
  require(started, "MPI_Init_thread");
  Input in(data, size);
  const int function = static_cast<int>(in.range(0, 3));  // ring, ring bwd, ulysses, ulysses bwd
  const bool ulysses = function >= 2, backward = function % 2 == 1;
  static constexpr DType kDtypes[] = {DType::f32, DType::f32, DType::f64, DType::bf16};
  const DType dtype = in.pick(kDtypes);
  const std::int64_t b = in.range(1, 2), nq = in.size(6, 40), nk = in.size(6, 40);
  const std::int64_t hkv = in.range(1, 2), hq = hkv * in.range(1, 2), d = in.range(1, 9);
  bool bad = false;
  const qkv::fuzz::Values values = qkv::fuzz::values(in, true);
  Arg q = qkv::fuzz::make_input(in, {b, nq, hq, d}, dtype, values);
  Arg k = qkv::fuzz::make_input(in, {b, nk, hkv, d}, dtype, values);
  Arg v = qkv::fuzz::make_input(in, {b, nk, hkv, d}, dtype, values);
  if (in.one_in(16)) {
    qkv::fuzz::make_bad(in, q, qkv::fuzz::bad_view(in));
    bad = bad || !q.view.defined() || q.view.data() == nullptr;
  }

  AttentionOptions o;
  o.causal = in.coin();
  o.align = in.coin() ? qkv::Align::top_left : qkv::Align::bottom_right;
  o.window_left = in.coin() ? -1 : in.param(-1, 12);
  o.window_right = in.coin() ? -1 : in.param(-1, 12);
  bad = bad || o.window_left < -1 || o.window_right < -1;
  std::vector<std::int64_t> lengths;
  if (in.one_in(3)) {
    for (std::int64_t i = 0; i < b; ++i) lengths.push_back(in.param(0, nk));
    o.key_lengths = lengths;
    for (const std::int64_t l : lengths) bad = bad || l < 0 || l > nk;
  }
  std::vector<float> slopes;
  if (in.one_in(3)) {
    for (std::int64_t h = 0; h < hq; ++h) slopes.push_back(static_cast<float>(in.range(0, 8)) / 8);
    o.alibi_slopes = slopes;
  }
  std::vector<float> sinks;
  if (in.one_in(4)) {
    for (std::int64_t h = 0; h < hq; ++h) sinks.push_back(static_cast<float>(in.range(-8, 8)) / 4);
    o.sinks = sinks;
  }
  std::vector<float> scales;
  if (in.one_in(5)) {
    for (std::int64_t h = 0; h < hq; ++h) scales.push_back(static_cast<float>(in.range(-8, 8)) / 4);
    if (in.one_in(10)) {
      scales.push_back(1.0f);  // one scale too many
      bad = true;
    }
    o.score_scale = scales;
    o.score_scale_log_n = in.coin();
  }
  if (in.one_in(4)) o.softcap = static_cast<double>(in.range(1, 20));
  if (in.one_in(4)) {
    o.dropout_p = static_cast<double>(in.range(1, 9)) / 10;
    o.dropout_seed = in.u64();
    o.dropout_offset = static_cast<std::uint32_t>(in.range(0, 1000));
  }
  const Tensor mask(DType::boolean, {nq, nk});
  switch (in.one_in(10) ? in.range(0, 2) : -1) {
    case 0:
      o.mask = mask;
      bad = true;
      break;
    case 1:
      o.shard.key = 1;
      bad = true;
      break;
    case 2:
      o.return_probs = true;
      bad = true;
      break;
    default:
      break;
  }
  auto layout = in.coin() ? qkv::dist::Layout::zigzag : qkv::dist::Layout::contiguous;
  if (in.one_in(20)) {
    layout = static_cast<qkv::dist::Layout>(in.range(2, 255));
    bad = bad || !ulysses;
  }
  bad = bad || nq == 0 || nk == 0;
  if (!ulysses && layout == qkv::dist::Layout::zigzag) bad = bad || nq % 2 != 0 || nk % 2 != 0;
  o.return_lse = true;
  const qkv::dist::RingOptions ring{.layout = layout};

  qkv::AttentionResult got;
  const bool forward_ok = qkv::fuzz::accepted("forward", [&] {
    got = ulysses ? qkv::dist::ulysses_attention(MPI_COMM_WORLD, q, k, v, o)
                  : qkv::dist::ring_attention(MPI_COMM_WORLD, q, k, v, o, ring);
  });
  if (bad) require(!forward_ok, "a bad call was accepted");
  if (!forward_ok) return 0;
  const bool finite = q.finite && k.finite && v.finite;
  const bool small = b * nq * nk * hq * d <= 40000;
  // Parts merged per row: the key chunks of the rank's one shard.
  const double parts = !ulysses && layout == qkv::dist::Layout::zigzag ? 2 : 1;
  AttentionOptions exact_o = o;
  exact_o.backend = qkv::Backend::reference;
  const qkv::AttentionResult single = qkv::attention(q, k, v, o);
  const qkv::AttentionResult exact = qkv::attention(f64(q.view), f64(k.view), f64(v.view), exact_o);
  if (finite && small) {
    const double largest_part = max_finite(v.view) / (1.0 - o.dropout_p);
    const double weights = largest_part * std::expm1(2 * parts * 0x1p-24 * max_finite(exact.lse));
    check_model("out", got.out, single.out, exact.out, parts, dtype, largest_part, weights);
    check_model("lse", got.lse, single.lse, exact.lse, parts, DType::f32, max_finite(exact.lse));
  }
  if (!backward) return 0;
  const Arg dout = qkv::fuzz::make_input(in, {b, nq, hq, d}, dtype, qkv::fuzz::values(in, false));
  qkv::AttentionGradients g;
  const bool backward_ok = qkv::fuzz::accepted("backward", [&] {
    g = ulysses ? qkv::dist::ulysses_attention_backward(MPI_COMM_WORLD, q, k, v, got.out, dout,
                                                        got.lse, o)
                : qkv::dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, got.out, dout,
                                                     got.lse, o, ring);
  });
  require(backward_ok, "the backward rejected the forward's own outputs");
  if (!finite || !qkv::detail::all_finite(got.out) || !qkv::detail::all_finite(got.lse, true)) {
    return 0;
  }
  require(qkv::detail::all_finite(g.dq) && qkv::detail::all_finite(g.dk) &&
              qkv::detail::all_finite(g.dv),
          "finite inputs and forward, non-finite gradients");
  return 0;
}
