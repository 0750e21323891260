// Fuzzes the modules of qkv/modules: MultiHeadAttention (configurations,
// forward with padding and attention masks, backward from saved tensors,
// forward_step against a KvCache), AdditiveAttention, SqueezeExcitation,
// Cbam, Linear, LearnedPositionalEmbedding and RelativePositionBias, with
// fuzzed configurations, shapes, dtypes, layouts and values.
//
// Checks: only qkv::Error escapes (constructors included); inputs are never
// written; a rejected forward_step leaves the cache unchanged and a
// rejected backward leaves every parameter gradient unchanged; with
// parameters from init_uniform, finite inputs of moderate size give finite
// outputs and gradients; every result is bitwise the same on another thread
// count. (Module numerics against PyTorch and finite differences are the
// unit tests' job: tests/*module*_test.cpp.)
#include "fuzz_common.hpp"
#include "qkv/modules/additive.hpp"
#include "qkv/modules/linear.hpp"
#include "qkv/modules/multihead_attention.hpp"
#include "qkv/modules/positional.hpp"
#include "qkv/modules/vision.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::fuzz::Arg;
using qkv::fuzz::finding;
using qkv::fuzz::Input;
using qkv::fuzz::require;
namespace nn = qkv::nn;

// The gradients a module holds, to show that a rejected backward added
// nothing.
class GradSnapshot {
 public:
  explicit GradSnapshot(const nn::NamedParameters& params) : params_(params) {
    for (const nn::NamedParameter& p : params) grads_.push_back(p.parameter->grad);
  }
  bool unchanged() const {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Tensor& now = params_[i].parameter->grad;
      if (now.defined() != grads_[i].defined()) return false;
      if (now.defined() && !qkv::fuzz::same_values(now, grads_[i])) return false;
    }
    return true;
  }

 private:
  nn::NamedParameters params_;
  std::vector<Tensor> grads_;
};

bool grads_finite(const nn::NamedParameters& params) {
  for (const nn::NamedParameter& p : params) {
    if (p.parameter->grad.defined() && !qkv::fuzz::all_finite(p.parameter->grad)) return false;
  }
  return true;
}

// A size: mostly in [lo, hi], sometimes one that is invalid or whose
// products overflow int64. Never one that is merely huge: allocating that is
// valid, and only slow.
std::int64_t dim(Input& in, std::int64_t lo, std::int64_t hi) {
  static constexpr std::int64_t kBad[] = {0,
                                          -1,
                                          -2,
                                          std::numeric_limits<std::int64_t>::min(),
                                          qkv::fuzz::kMax64,
                                          qkv::fuzz::kMax64 / 2,
                                          std::int64_t{1} << 62};
  return in.one_in(10) ? in.pick(kBad) : in.range(lo, hi);
}

// A width ratio: mostly moderate, sometimes invalid or so large that the
// width overflows int64 (never merely huge, as dim()).
double ratio(Input& in) {
  static constexpr double kBad[] = {
      0.0, -0.0, -1.0, qkv::fuzz::kNaN, qkv::fuzz::kInf, -qkv::fuzz::kInf, 1e30, 1e300, 1e-300};
  return in.one_in(8) ? in.pick(kBad) : 0.25;
}

DType parameter_dtype(Input& in) {
  static constexpr DType kTypes[] = {DType::f32, DType::f32, DType::f64, DType::bf16, DType::f16};
  return in.one_in(30) ? qkv::fuzz::any_dtype(in) : in.pick(kTypes);
}

// Constructs a module; false when the constructor rejected its arguments.
template <class Make>
bool construct(const char* what, Make&& make) {
  return qkv::fuzz::accepted(what, std::forward<Make>(make));
}

// Runs forward (allocating) twice on different thread counts: bitwise equal.
template <class F>
Tensor forward_twice(Input& in, const char* what, F&& f, bool& ok) {
  Tensor y;
  ok = qkv::fuzz::accepted(what, [&] { y = f(); });
  if (!ok) return y;
  qkv::fuzz::fuzz_threads(in);
  const Tensor y2 = f();
  require(qkv::fuzz::same_values(y, y2), std::string(what) + " differs for another thread count");
  return y;
}

// A backward: a rejected one leaves the gradients as they were; an accepted
// one from finite inputs leaves them finite.
template <class F>
bool backward_checked(const char* what, const nn::NamedParameters& params, bool finite, F&& f) {
  const GradSnapshot before(params);
  const bool ok = qkv::fuzz::accepted(what, std::forward<F>(f));
  if (!ok) {
    require(before.unchanged(), std::string(what) + " threw but changed parameter gradients");
    return false;
  }
  if (finite) require(grads_finite(params), std::string(what) + ": non-finite parameter gradient");
  return true;
}

void fuzz_mha(Input& in) {
  nn::MultiHeadAttentionConfig cfg;
  const std::int64_t heads = in.range(1, 4);
  cfg.num_heads = in.one_in(12) ? dim(in, 0, 4) : heads;
  cfg.embed_dim = heads * in.range(1, 8) + (in.one_in(12) ? 1 : 0);
  cfg.num_kv_heads = in.coin() ? 0 : dim(in, 0, 4);
  cfg.kdim = in.coin() ? 0 : dim(in, 0, 12);
  cfg.vdim = in.coin() ? 0 : dim(in, 0, 12);
  cfg.bias = in.coin();
  cfg.dropout = in.one_in(4) ? (in.one_in(4) ? in.extreme_real() : 0.25) : 0.0;
  cfg.position = static_cast<nn::Position>(in.range(0, in.one_in(20) ? 9 : 3));
  cfg.rope.rotary_dim = in.coin() ? 0 : in.param(0, 8);
  cfg.num_buckets = dim(in, 2, 16);
  cfg.max_distance = in.param(1, 64);
  cfg.bidirectional = in.coin();
  cfg.dtype = parameter_dtype(in);
  std::unique_ptr<nn::MultiHeadAttention> m;
  if (!construct("MultiHeadAttention",
                 [&] { m = std::make_unique<nn::MultiHeadAttention>(cfg); })) {
    return;
  }
  const nn::NamedParameters params = m->named_parameters();
  nn::init_uniform(params, in.u64());
  const std::int64_t e = cfg.embed_dim;
  const std::int64_t kdim = cfg.kdim == 0 ? e : cfg.kdim, vdim = cfg.vdim == 0 ? e : cfg.vdim;
  const std::int64_t b = in.size(2, 3), nq = in.size(8, 24);
  const bool self = kdim == e && vdim == e && in.coin();
  const std::int64_t nk = self ? nq : in.size(8, 24);
  const DType dtype = in.one_in(8) ? qkv::fuzz::floating_dtype(in) : cfg.dtype;
  const qkv::fuzz::Values vals = qkv::fuzz::values(in, true, 30.0);
  const Arg query = qkv::fuzz::make_input(in, {b, nq, e}, dtype, vals);
  const Arg key = self ? query : qkv::fuzz::make_input(in, {b, nk, kdim}, dtype, vals);
  const Arg value = self ? query : qkv::fuzz::make_input(in, {b, nk, vdim}, dtype, vals);
  // In f16, projections of inputs of 30 reach scores of 1e5 and gradients
  // past 65504 legitimately; moderate inputs stay inside.
  const bool half = dtype == DType::f16 || cfg.dtype == DType::f16;
  bool finite = query.finite && key.finite && value.finite && vals.magnitude <= (half ? 3.0 : 30.0);
  const std::string text =
      std::string(qkv::dtype_name(dtype)) + " params " + std::string(qkv::dtype_name(cfg.dtype)) +
      " E=" + std::to_string(e) + " H=" + std::to_string(cfg.num_heads) +
      " Hkv=" + std::to_string(cfg.num_kv_heads) + " kdim=" + std::to_string(kdim) +
      " vdim=" + std::to_string(vdim) + " B=" + std::to_string(b) + " Nq=" + std::to_string(nq) +
      " Nk=" + std::to_string(nk) + " position=" + std::to_string(static_cast<int>(cfg.position)) +
      " dropout=" + std::to_string(cfg.dropout) + " magnitude=" + std::to_string(vals.magnitude);

  nn::MultiHeadAttentionOptions opt;
  Arg padding, attn_mask;
  if (in.one_in(4)) {
    const bool boolean = in.coin();
    padding =
        qkv::fuzz::make_input(in, {b, in.one_in(16) ? nk + 1 : nk},
                              boolean ? DType::boolean : dtype, qkv::fuzz::values(in, !boolean));
    opt.key_padding_mask = padding.view;
    finite = finite && padding.finite;
  }
  if (in.one_in(4)) {
    const bool boolean = in.coin();
    attn_mask = in.coin() ? qkv::fuzz::make_input(in, {nq, nk}, boolean ? DType::boolean : dtype,
                                                  qkv::fuzz::values(in, !boolean))
                          : qkv::fuzz::make_input(in, {b * cfg.num_heads, nq, nk},
                                                  boolean ? DType::boolean : dtype,
                                                  qkv::fuzz::values(in, !boolean));
    opt.attn_mask = attn_mask.view;
    finite = finite && attn_mask.finite;
  }
  opt.causal = in.coin();
  opt.need_weights = in.coin();
  opt.average_attn_weights = in.coin();
  opt.training = in.coin();
  opt.dropout_seed = in.u64();
  opt.save_for_backward = true;
  const qkv::fuzz::Snapshot inputs{&query, &key, &value, &padding, &attn_mask};

  if (in.one_in(4)) {
    // Decoding through a cache.
    qkv::KvCacheConfig cc;
    cc.batch = b;
    cc.kv_heads = cfg.num_kv_heads == 0 ? cfg.num_heads : cfg.num_kv_heads;
    cc.head_dim = in.one_in(16) ? m->head_dim() + 1 : m->head_dim();
    cc.capacity = in.range(1, 24);
    cc.dtype = in.coin() ? DType::f32 : DType::bf16;
    cc.page_size = in.coin() ? 0 : in.range(1, 4);
    std::unique_ptr<qkv::KvCache> cache;
    if (!qkv::fuzz::accepted("KvCache", [&] { cache = std::make_unique<qkv::KvCache>(cc); }))
      return;
    for (int step = 0; step < 4; ++step) {
      const std::int64_t n = in.one_in(10) ? in.range(0, 20) : in.range(1, 4);
      const Arg x = qkv::fuzz::make_input(in, {b, n, e}, dtype, vals);
      std::vector<std::int64_t> lengths_before(cache->lengths().begin(), cache->lengths().end());
      Tensor y;
      const bool ok = qkv::fuzz::accepted("MultiHeadAttention::forward_step",
                                          [&] { y = m->forward_step(x, *cache); });
      if (!ok) {
        require(std::equal(lengths_before.begin(), lengths_before.end(), cache->lengths().begin()),
                "a rejected forward_step changed the cache");
        continue;
      }
      if (finite && x.finite) qkv::fuzz::require_finite(y, "forward_step out");
    }
    return;
  }

  nn::MultiHeadAttentionResult r;
  bool ok = false;
  r.out = forward_twice(
      in, "MultiHeadAttention::forward",
      [&] {
        nn::MultiHeadAttentionResult x = m->forward(query, key, value, opt);
        Tensor out = x.out;
        r = std::move(x);
        return out;
      },
      ok);
  inputs.require_unchanged("MultiHeadAttention::forward (inputs)");
  if (!ok) return;
  if (finite) {
    qkv::fuzz::require_finite(r.out, "MultiHeadAttention out: " + text);
    qkv::fuzz::require_finite(r.weights, "MultiHeadAttention weights");
  }
  const Arg dout = qkv::fuzz::make_input(in, {b, nq, in.one_in(16) ? e + 1 : e}, dtype,
                                         qkv::fuzz::values(in, true));
  nn::MultiHeadAttentionGradients g;
  if (backward_checked("MultiHeadAttention::backward", params, finite && dout.finite,
                       [&] { g = m->backward(query, key, value, r.saved, dout, opt); })) {
    if (finite && dout.finite) {
      qkv::fuzz::require_finite(g.dquery, "MultiHeadAttention dquery: " + text);
      qkv::fuzz::require_finite(g.dkey, "MultiHeadAttention dkey: " + text);
      qkv::fuzz::require_finite(g.dvalue, "MultiHeadAttention dvalue: " + text);
    }
  }
  inputs.require_unchanged("MultiHeadAttention::backward (inputs)");
}

void fuzz_additive(Input& in) {
  const std::int64_t h = dim(in, 1, 12);
  std::unique_ptr<nn::AdditiveAttention> m;
  if (!construct("AdditiveAttention",
                 [&] { m = std::make_unique<nn::AdditiveAttention>(h, parameter_dtype(in)); })) {
    return;
  }
  const nn::NamedParameters params = m->named_parameters();
  nn::init_uniform(params, in.u64());
  const std::int64_t b = in.size(3, 4), s = in.size(8, 24);
  const DType dtype = qkv::fuzz::floating_dtype(in);
  const qkv::fuzz::Values vals = qkv::fuzz::values(in, true, 30.0);
  const Arg dec = qkv::fuzz::make_input(in, {b, in.one_in(16) ? h + 1 : h}, dtype, vals);
  const Arg enc = qkv::fuzz::make_input(in, {b, s, h}, dtype, vals);
  std::vector<std::int64_t> lengths;
  if (in.coin()) {
    for (std::int64_t i = 0; i < b; ++i)
      lengths.push_back(in.one_in(10) ? in.extreme_int() : in.range(0, s));
  }
  const bool finite = dec.finite && enc.finite;
  const qkv::fuzz::Snapshot inputs{&dec, &enc};
  nn::AdditiveAttentionOutput y;
  bool ok = false;
  forward_twice(
      in, "AdditiveAttention::forward",
      [&] {
        y = m->forward(dec, enc, lengths);
        return y.context;
      },
      ok);
  inputs.require_unchanged("AdditiveAttention::forward (inputs)");
  if (!ok) return;
  if (finite) {
    qkv::fuzz::require_finite(y.context, "AdditiveAttention context");
    qkv::fuzz::require_finite(y.weights, "AdditiveAttention weights");
  }
  const Arg dc = qkv::fuzz::make_input(in, {b, h}, dtype, qkv::fuzz::values(in, false));
  const Arg dw = in.coin() ? qkv::fuzz::make_input(in, {b, in.one_in(16) ? s + 1 : s}, dtype,
                                                   qkv::fuzz::values(in, false))
                           : Arg();
  nn::AdditiveAttentionGradients g;
  if (backward_checked("AdditiveAttention::backward", params, finite,
                       [&] { g = m->backward(dec, enc, lengths, dc, dw); }) &&
      finite) {
    qkv::fuzz::require_finite(g.d_decoder_hidden, "AdditiveAttention d_decoder_hidden");
    qkv::fuzz::require_finite(g.d_encoder_outputs, "AdditiveAttention d_encoder_outputs");
  }
}

// SqueezeExcitation and Cbam share their call shapes.
template <class Module>
void fuzz_vision(Input& in, std::unique_ptr<Module>& m, std::int64_t channels, const char* name) {
  const nn::NamedParameters params = m->named_parameters();
  nn::init_uniform(params, in.u64());
  const nn::ImageLayout layout = in.one_in(20)
                                     ? static_cast<nn::ImageLayout>(in.range(2, 255))
                                     : (in.coin() ? nn::ImageLayout::nchw : nn::ImageLayout::nhwc);
  const std::int64_t b = in.size(2, 3), hh = in.size(6, 12), ww = in.size(6, 12);
  const std::int64_t c = in.one_in(16) ? channels + 1 : channels;
  const DType dtype = qkv::fuzz::floating_dtype(in);
  const qkv::fuzz::Values vals = qkv::fuzz::values(in, true, 30.0);
  const Arg x = layout == nn::ImageLayout::nhwc
                    ? qkv::fuzz::make_input(in, {b, hh, ww, c}, dtype, vals)
                    : qkv::fuzz::make_input(in, {b, c, hh, ww}, dtype, vals);
  const qkv::fuzz::Snapshot inputs{&x};
  bool ok = false;
  const Tensor y = forward_twice(
      in, name, [&] { return m->forward(x, layout); }, ok);
  inputs.require_unchanged(std::string(name) + " (inputs)");
  if (!ok) return;
  require(layout == nn::ImageLayout::nchw || layout == nn::ImageLayout::nhwc,
          std::string(name) + " accepted an out-of-range ImageLayout");
  if (x.finite) qkv::fuzz::require_finite(y, name);
  const Arg dy = qkv::fuzz::make_input(in, x.view.size_span(), dtype, qkv::fuzz::values(in, false));
  Tensor dx;
  if (backward_checked(name, params, x.finite, [&] { dx = m->backward(x, dy, layout); }) &&
      x.finite) {
    if (dtype == DType::f16) {
      // The gradient in f16 is rounded once from f32: where the exact value is
      // beyond f16's largest (65504) it is rightly infinite. The same call in
      // f32 says where (up to a few f32 roundings of a different order).
      const Tensor d32 = m->backward(qkv::to_dtype(x.cview(), DType::f32),
                                     qkv::to_dtype(dy.cview(), DType::f32), layout);
      for (std::int64_t i = 0; i < dx.numel(); ++i) {
        const double got = qkv::to_float(dx.data<qkv::f16>()[i]);
        if (!std::isfinite(got) && std::fabs(d32.data<float>()[i]) < 0.999 * 65504.0) {
          qkv::fuzz::finding(std::string(name) +
                             ": NaN or infinity from finite inputs and options (f32: " +
                             std::to_string(d32.data<float>()[i]) + ")");
        }
      }
    } else {
      qkv::fuzz::require_finite(dx, name);
    }
  }
}

void fuzz_se(Input& in) {
  const std::int64_t c = dim(in, 1, 24);
  nn::SqueezeExcitationOptions o;
  o.rd_ratio = ratio(in);
  o.rd_channels = in.coin() ? 0 : dim(in, 0, 8);
  o.rd_divisor = dim(in, 1, 8);
  o.bias = in.coin();
  o.dtype = parameter_dtype(in);
  std::unique_ptr<nn::SqueezeExcitation> m;
  if (construct("SqueezeExcitation", [&] { m = std::make_unique<nn::SqueezeExcitation>(c, o); })) {
    fuzz_vision(in, m, c, "SqueezeExcitation");
  }
}

void fuzz_cbam(Input& in) {
  const std::int64_t c = dim(in, 1, 24);
  nn::CbamOptions o;
  o.rd_ratio = ratio(in);
  o.rd_channels = in.coin() ? 0 : dim(in, 0, 8);
  o.rd_divisor = dim(in, 1, 4);
  o.mlp_bias = in.coin();
  o.spatial_kernel_size = dim(in, 1, 7);
  o.bn_eps = in.one_in(8) ? in.extreme_real() : 1e-5;
  o.dtype = parameter_dtype(in);
  std::unique_ptr<nn::Cbam> m;
  if (construct("Cbam", [&] { m = std::make_unique<nn::Cbam>(c, o); })) {
    fuzz_vision(in, m, c, "Cbam");
  }
}

void fuzz_linear(Input& in) {
  const std::int64_t fin = dim(in, 1, 16), fout = dim(in, 1, 16);
  std::unique_ptr<nn::Linear> m;
  if (!construct("Linear", [&] {
        m = std::make_unique<nn::Linear>(fin, fout, in.coin(), parameter_dtype(in));
      })) {
    return;
  }
  const nn::NamedParameters params = m->named_parameters();
  nn::init_uniform(params, in.u64());
  std::vector<std::int64_t> sizes;
  for (std::int64_t d = in.range(0, 2); d > 0; --d) sizes.push_back(in.size(4, 8));
  sizes.push_back(in.one_in(16) ? fin + 1 : fin);
  const DType dtype = qkv::fuzz::floating_dtype(in);
  const Arg x = qkv::fuzz::make_input(in, sizes, dtype, qkv::fuzz::values(in, true, 30.0));
  bool ok = false;
  const Tensor y = forward_twice(
      in, "Linear::forward", [&] { return m->forward(x); }, ok);
  if (!ok) return;
  if (x.finite) qkv::fuzz::require_finite(y, "Linear out");
  sizes.back() = in.one_in(16) ? fout + 1 : fout;
  const Arg dy = qkv::fuzz::make_input(in, sizes, dtype, qkv::fuzz::values(in, false));
  Tensor dx;
  if (backward_checked("Linear::backward", params, x.finite, [&] { dx = m->backward(x, dy); }) &&
      x.finite) {
    qkv::fuzz::require_finite(dx, "Linear dx");
  }
}

void fuzz_positional(Input& in) {
  if (in.coin()) {
    const std::int64_t positions = dim(in, 1, 32), width = dim(in, 1, 8);
    std::unique_ptr<nn::LearnedPositionalEmbedding> m;
    if (!construct("LearnedPositionalEmbedding", [&] {
          m = std::make_unique<nn::LearnedPositionalEmbedding>(positions, width,
                                                               parameter_dtype(in));
        })) {
      return;
    }
    const nn::NamedParameters params = m->named_parameters();
    nn::init_uniform(params, in.u64());
    const std::int64_t start = in.param(0, 32);
    const DType dtype = qkv::fuzz::floating_dtype(in);
    const Arg x = qkv::fuzz::make_input(in, {in.size(2, 3), in.size(8, 40), width}, dtype,
                                        qkv::fuzz::values(in, true));
    bool ok = false;
    const Tensor y = forward_twice(
        in, "LearnedPositionalEmbedding::forward", [&] { return m->forward(x, start); }, ok);
    if (!ok) return;
    if (x.finite) qkv::fuzz::require_finite(y, "LearnedPositionalEmbedding out");
    backward_checked("LearnedPositionalEmbedding::backward", params, x.finite,
                     [&] { (void)m->backward(x, x, in.one_in(8) ? start + 1 : start); });
    return;
  }
  const std::int64_t heads = dim(in, 1, 4), buckets = dim(in, 2, 16), distance = in.param(1, 64);
  std::unique_ptr<nn::RelativePositionBias> m;
  if (!construct("RelativePositionBias", [&] {
        m = std::make_unique<nn::RelativePositionBias>(heads, buckets, distance, in.coin(),
                                                       parameter_dtype(in));
      })) {
    return;
  }
  const nn::NamedParameters params = m->named_parameters();
  nn::init_uniform(params, in.u64());
  const std::int64_t nq = dim(in, 0, 24), nk = dim(in, 0, 24);
  bool ok = false;
  const Tensor bias = forward_twice(
      in, "RelativePositionBias::bias", [&] { return m->bias(nq, nk); }, ok);
  if (ok) qkv::fuzz::require_finite(bias, "RelativePositionBias bias");
  const DType dtype = qkv::fuzz::floating_dtype(in);
  const Arg d_table = qkv::fuzz::make_input(in, {in.one_in(8) ? heads + 1 : heads, buckets}, dtype,
                                            qkv::fuzz::values(in, false));
  backward_checked("RelativePositionBias::backward", params, d_table.finite,
                   [&] { m->backward(d_table); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  qkv::fuzz::fuzz_threads(in);
  switch (in.range(0, 6)) {
    case 0:
      fuzz_mha(in);
      break;
    case 1:
      fuzz_additive(in);
      break;
    case 2:
      fuzz_se(in);
      break;
    case 3:
      fuzz_cbam(in);
      break;
    case 4:
      fuzz_linear(in);
      break;
    default:
      fuzz_positional(in);
      break;
  }
  return 0;
}
