// Small sequence models trained with the qkv::nn modules' backward passes
// (see train.hpp). The parts the library does not have (token embedding,
// layer norm, softmax cross-entropy, Adam) are written out here, in plain
// single-threaded loops, so that they add nothing thread-dependent.
#include "train.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <unordered_set>

#include "qkv/modules/additive.hpp"
#include "qkv/modules/linear.hpp"
#include "qkv/modules/multihead_attention.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/positional.hpp"

namespace qkv::tools {
namespace {

using nn::NamedParameters;
using nn::Parameter;

constexpr std::int32_t kPad = 10;  // tokens 0..9 are digits
constexpr std::int64_t kVocab = 11;
constexpr std::int64_t kHeldOut = 1000;    // sequences the accuracy is measured on
constexpr std::int64_t kEvalEvery = 100;   // steps between held-out evaluations
constexpr double kStopAccuracy = 0.998;    // training stops early at this accuracy
constexpr std::int64_t kPlainEvery = 200;  // steps between plain progress lines
constexpr std::uint64_t kHeldOutSalt = 0x5eed0fdeadbeefull;

// An integer in [0, n), from the high 32 bits of one draw (the same on
// every platform, unlike std::uniform_int_distribution).
std::int64_t draw(std::mt19937_64& rng, std::int64_t n) {
  return static_cast<std::int64_t>(((rng() >> 32) * static_cast<std::uint64_t>(n)) >> 32);
}

// A float in [-1, 1).
float draw_symmetric(std::mt19937_64& rng) {
  return static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
}

// Sinusoidal positions [kWindow, dim] with base 100 (its frequencies, 1 to
// 1/100 radian per slot, resolve 12 slots, where base 10000's mostly do not),
// times 4, so that positions outweigh the token vectors (norm about 3) in
// the scores from the start and the attention sharpens within a few hundred
// steps.
Tensor scaled_positions(std::int64_t dim) {
  Tensor p = sinusoidal_positions(kWindow, dim, 100.0);
  float* d = p.data<float>();
  for (std::int64_t i = 0; i < p.numel(); ++i) d[i] *= 4.0f;
  return p;
}

std::int64_t expected_key(TaskKind kind, std::int64_t i) {
  return kind == TaskKind::rotate ? (i + kWindow / 2) % kWindow : kWindow - 1 - i;
}

// Inputs and targets of `count` sequences, kWindow tokens each.
struct Batch {
  std::int64_t count = 0;
  std::vector<std::int32_t> input, target;
  std::vector<std::int64_t> digits;  // per sequence
};

// One sequence of `n` digits into the input window, and its target.
void place(TaskKind kind, const std::vector<std::int32_t>& digits, std::int32_t* input,
           std::int32_t* target) {
  const auto n = static_cast<std::int64_t>(digits.size());
  const std::int64_t first = kind == TaskKind::rotate ? 0 : kWindow - n;
  for (std::int64_t i = 0; i < kWindow; ++i) input[i] = kPad;
  for (std::int64_t i = 0; i < n; ++i) input[first + i] = digits[i];
  for (std::int64_t i = 0; i < kWindow; ++i) target[i] = input[expected_key(kind, i)];
}

std::uint64_t sequence_key(const std::int32_t* input) {
  std::uint64_t key = 0;
  for (std::int64_t i = 0; i < kWindow; ++i)
    key = key * kVocab + static_cast<std::uint64_t>(input[i]);
  return key;
}

class Data {
 public:
  Data(TaskKind kind, std::uint64_t seed) : kind_(kind), rng_(seed) {
    std::mt19937_64 held_rng(seed ^ kHeldOutSalt);
    held_out_ = make(held_rng, kHeldOut, nullptr);
    for (std::int64_t b = 0; b < kHeldOut; ++b) {
      held_keys_.insert(sequence_key(&held_out_.input[b * kWindow]));
    }
  }
  const Batch& held_out() const { return held_out_; }
  Batch next(std::int64_t count) { return make(rng_, count, &held_keys_); }

 private:
  Batch make(std::mt19937_64& rng, std::int64_t count,
             const std::unordered_set<std::uint64_t>* excluded) {
    Batch batch;
    batch.count = count;
    batch.input.resize(count * kWindow);
    batch.target.resize(count * kWindow);
    batch.digits.resize(count);
    for (std::int64_t b = 0; b < count; ++b) {
      std::int32_t* input = &batch.input[b * kWindow];
      std::int32_t* target = &batch.target[b * kWindow];
      do {
        const std::int64_t n = kMinDigits + draw(rng, kMaxDigits - kMinDigits + 1);
        std::vector<std::int32_t> digits(n);
        for (std::int32_t& d : digits) d = static_cast<std::int32_t>(draw(rng, 10));
        place(kind_, digits, input, target);
        batch.digits[b] = n;
      } while (excluded != nullptr && excluded->count(sequence_key(input)) != 0);
    }
    return batch;
  }

  TaskKind kind_;
  std::mt19937_64 rng_;
  Batch held_out_;
  std::unordered_set<std::uint64_t> held_keys_;
};

Tensor zeros_like(const Tensor& t) { return Tensor(DType::f32, t.view().size_span()); }

void ensure_grad(Parameter& p) {
  if (!p.grad.defined()) p.grad = zeros_like(p.value);
}

// A table of `rows` learned vectors (token or step embedding).
struct Embedding {
  Parameter weight;  // [rows, dim]

  Embedding(std::int64_t rows, std::int64_t dim, std::mt19937_64& rng)
      : weight(nn::make_parameter(DType::f32, {rows, dim})) {
    float* w = weight.value.data<float>();
    for (std::int64_t i = 0; i < rows * dim; ++i) w[i] = draw_symmetric(rng);
  }
  std::int64_t dim() const { return weight.value.size(1); }
  const float* row(std::int64_t i) const { return weight.value.data<float>() + i * dim(); }
  // Adds `dy` (dim floats) to the gradient of row i.
  void accumulate(std::int64_t i, const float* dy) {
    ensure_grad(weight);
    float* g = weight.grad.data<float>() + i * dim();
    for (std::int64_t c = 0; c < dim(); ++c) g[c] += dy[c];
  }
};

// Layer norm over the last dimension with a learned gain and bias.
struct LayerNorm {
  Parameter gain, bias;  // [dim]
  Tensor xhat;           // saved: the normalized input [rows, dim]
  std::vector<float> rstd;

  explicit LayerNorm(std::int64_t dim)
      : gain(nn::make_parameter(DType::f32, {dim})), bias(nn::make_parameter(DType::f32, {dim})) {
    float* g = gain.value.data<float>();
    for (std::int64_t c = 0; c < dim; ++c) g[c] = 1.0f;
  }

  // x [..., dim] (contiguous); returns the same shape.
  Tensor forward(const Tensor& x) {
    const std::int64_t dim = gain.value.size(0);
    const std::int64_t rows = x.numel() / dim;
    Tensor y = zeros_like(x);
    xhat = zeros_like(x);
    rstd.assign(rows, 0.0f);
    const float* in = x.data<float>();
    const float* g = gain.value.data<float>();
    const float* b = bias.value.data<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = in + r * dim;
      float mean = 0.0f;
      for (std::int64_t c = 0; c < dim; ++c) mean += xr[c];
      mean /= static_cast<float>(dim);
      float var = 0.0f;
      for (std::int64_t c = 0; c < dim; ++c) var += (xr[c] - mean) * (xr[c] - mean);
      rstd[r] = 1.0f / std::sqrt(var / static_cast<float>(dim) + 1e-5f);
      float* h = xhat.data<float>() + r * dim;
      float* yr = y.data<float>() + r * dim;
      for (std::int64_t c = 0; c < dim; ++c) {
        h[c] = (xr[c] - mean) * rstd[r];
        yr[c] = g[c] * h[c] + b[c];
      }
    }
    return y;
  }

  // dy like the forward's output; returns dx and accumulates gain and bias.
  Tensor backward(const Tensor& dy) {
    const std::int64_t dim = gain.value.size(0);
    const std::int64_t rows = dy.numel() / dim;
    ensure_grad(gain);
    ensure_grad(bias);
    Tensor dx = zeros_like(dy);
    const float* g = gain.value.data<float>();
    float* dg = gain.grad.data<float>();
    float* db = bias.grad.data<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* d = dy.data<float>() + r * dim;
      const float* h = xhat.data<float>() + r * dim;
      float mean_d = 0.0f, mean_dh = 0.0f;
      for (std::int64_t c = 0; c < dim; ++c) {
        dg[c] += d[c] * h[c];
        db[c] += d[c];
        mean_d += d[c] * g[c];
        mean_dh += d[c] * g[c] * h[c];
      }
      mean_d /= static_cast<float>(dim);
      mean_dh /= static_cast<float>(dim);
      float* out = dx.data<float>() + r * dim;
      for (std::int64_t c = 0; c < dim; ++c) {
        out[c] = rstd[r] * (d[c] * g[c] - mean_d - h[c] * mean_dh);
      }
    }
    return dx;
  }

  NamedParameters named_parameters(const std::string& prefix) {
    return {{prefix + "weight", &gain}, {prefix + "bias", &bias}};
  }
};

// Mean softmax cross-entropy of logits [rows, kVocab] against targets (a
// target of -1: a row not decoded, left out and counted as right); fills
// dlogits (same shape, zero where left out) and marks the right argmaxes.
double cross_entropy(const Tensor& logits, const std::vector<std::int32_t>& targets,
                     Tensor* dlogits, std::vector<char>& right) {
  const auto rows = static_cast<std::int64_t>(targets.size());
  const auto counted = static_cast<double>(
      std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; }));
  const float* z = logits.data<float>();
  right.assign(rows, 1);
  double loss = 0.0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    const float* zr = z + r * kVocab;
    const std::int64_t best = std::max_element(zr, zr + kVocab) - zr;
    right[r] = best == targets[r];
    double sum = 0.0;
    for (std::int64_t v = 0; v < kVocab; ++v) {
      sum += std::exp(static_cast<double>(zr[v] - zr[best]));
    }
    const double log_sum = std::log(sum) + zr[best];
    loss += log_sum - zr[targets[r]];
    if (dlogits != nullptr) {
      float* d = dlogits->data<float>() + r * kVocab;
      for (std::int64_t v = 0; v < kVocab; ++v) {
        const double p = std::exp(static_cast<double>(zr[v]) - log_sum);
        d[v] = static_cast<float>((p - (v == targets[r] ? 1.0 : 0.0)) / counted);
      }
    }
  }
  return loss / counted;
}

// Adam (Kingma and Ba) with bias correction, over every parameter.
class Adam {
 public:
  Adam(NamedParameters params, double lr) : params_(std::move(params)), lr_(lr) {
    for (const nn::NamedParameter& p : params_) {
      m_.emplace_back(p.parameter->value.numel(), 0.0f);
      v_.emplace_back(p.parameter->value.numel(), 0.0f);
    }
  }
  void step(double lr_scale) {
    ++t_;
    const double c1 = 1.0 - std::pow(kBeta1, static_cast<double>(t_));
    const double c2 = 1.0 - std::pow(kBeta2, static_cast<double>(t_));
    const auto lr = static_cast<float>(lr_ * lr_scale * std::sqrt(c2) / c1);
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Parameter& p = *params_[k].parameter;
      if (!p.grad.defined()) continue;
      float* w = p.value.data<float>();
      const float* g = p.grad.data<float>();
      for (std::size_t i = 0; i < m_[k].size(); ++i) {
        m_[k][i] = kBeta1 * m_[k][i] + (1.0f - kBeta1) * g[i];
        v_[k][i] = kBeta2 * v_[k][i] + (1.0f - kBeta2) * g[i] * g[i];
        w[i] -= lr * m_[k][i] / (std::sqrt(v_[k][i]) + 1e-8f);
      }
    }
  }
  const NamedParameters& parameters() const { return params_; }

 private:
  static constexpr float kBeta1 = 0.9f;
  static constexpr float kBeta2 = 0.98f;
  NamedParameters params_;
  double lr_;
  std::int64_t t_ = 0;
  std::vector<std::vector<float>> m_, v_;
};

std::uint64_t parameter_hash(const NamedParameters& params) {
  std::uint64_t h = 14695981039346656037ull;
  for (const nn::NamedParameter& p : params) {
    const Tensor& t = p.parameter->value;
    const auto* bytes = static_cast<const unsigned char*>(t.view().data());
    const auto n = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype());
    for (std::size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

// What a forward pass gives the training loop and the evaluation.
struct Pass {
  double loss = 0.0;
  std::vector<char> right;  // per output slot
  Tensor weights;           // [B, heads, kWindow, kWindow]
};

nn::MultiHeadAttentionConfig attention_config(std::int64_t dim, std::int64_t heads) {
  nn::MultiHeadAttentionConfig config;
  config.embed_dim = dim;
  config.num_heads = heads;
  return config;
}

// Embedding + positions -> self-attention with a residual -> layer norm ->
// output projection.
class SelfAttentionModel {
 public:
  SelfAttentionModel(std::int64_t dim, std::int64_t heads, std::uint64_t seed)
      : rng_(seed),
        embed_(kVocab, dim, rng_),
        attention_(attention_config(dim, heads)),
        norm_(dim),
        out_(dim, kVocab),
        positions_(scaled_positions(dim)) {
    NamedParameters modules = attention_.named_parameters("attn.");
    for (nn::NamedParameter& p : out_.named_parameters("out.")) modules.push_back(p);
    nn::init_uniform(modules, seed);
    params_ = {{"embed.weight", &embed_.weight}};
    for (nn::NamedParameter& p : modules) params_.push_back(p);
    for (nn::NamedParameter& p : norm_.named_parameters("norm.")) params_.push_back(p);
  }

  NamedParameters parameters() const { return params_; }

  Pass run(const Batch& batch, bool train) {
    const std::int64_t dim = embed_.dim();
    const std::int64_t rows = batch.count * kWindow;
    Tensor x(DType::f32, {batch.count, kWindow, dim});
    float* xd = x.data<float>();
    const float* pe = positions_.data<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* e = embed_.row(batch.input[r]);
      for (std::int64_t c = 0; c < dim; ++c) xd[r * dim + c] = e[c] + pe[(r % kWindow) * dim + c];
    }
    nn::MultiHeadAttentionOptions opt;
    opt.need_weights = true;
    opt.average_attn_weights = false;
    opt.save_for_backward = train;
    nn::MultiHeadAttentionResult a = attention_.forward(x, x, x, opt);
    Tensor y = a.out;  // y = x + attention(x)
    float* yd = y.data<float>();
    for (std::int64_t i = 0; i < rows * dim; ++i) yd[i] += xd[i];
    const Tensor h = norm_.forward(y);
    const Tensor logits = out_.forward(h);
    Pass pass;
    Tensor dlogits = train ? zeros_like(logits) : Tensor();
    pass.loss = cross_entropy(logits, batch.target, train ? &dlogits : nullptr, pass.right);
    pass.weights = std::move(a.weights);
    if (!train) return pass;

    nn::zero_grad(params_);
    const Tensor dh = out_.backward(h, dlogits);
    Tensor dy = norm_.backward(dh);
    const nn::MultiHeadAttentionGradients g = attention_.backward(x, x, x, a.saved, dy, opt);
    float* dyd = dy.data<float>();  // the residual's gradient plus the three inputs'
    const float* gq = g.dquery.data<float>();
    const float* gk = g.dkey.data<float>();
    const float* gv = g.dvalue.data<float>();
    for (std::int64_t i = 0; i < rows * dim; ++i) dyd[i] += gq[i] + gk[i] + gv[i];
    for (std::int64_t r = 0; r < rows; ++r) embed_.accumulate(batch.input[r], dyd + r * dim);
    return pass;
  }

 private:
  std::mt19937_64 rng_;
  Embedding embed_;
  nn::MultiHeadAttention attention_;
  LayerNorm norm_;
  nn::Linear out_;
  Tensor positions_;  // [kWindow, dim]
  NamedParameters params_;
};

// The encoder: the n digits of a sequence, each its token vector plus the
// position of its slot in the right-aligned window (its distance from the
// sequence's end), packed first and padded to kWindow rows, the padding
// masked with source_lengths = n. Decoder step i (i < n; the decoder runs as
// many steps as the sequence has digits): a learned vector per step (its
// hidden state) attending to the encoder outputs with the additive score;
// the context goes through a layer norm and the output projection. Maps are
// reported in window slots, so the expected alignment is the anti-diagonal.
class AdditiveModel {
 public:
  AdditiveModel(std::int64_t dim, std::uint64_t seed)
      : rng_(seed),
        embed_(kVocab, dim, rng_),
        steps_(kWindow, dim, rng_),
        attention_(dim),
        norm_(dim),
        out_(dim, kVocab),
        positions_(scaled_positions(dim)) {
    NamedParameters modules = attention_.named_parameters("attn.");
    for (nn::NamedParameter& p : out_.named_parameters("out.")) modules.push_back(p);
    nn::init_uniform(modules, seed);
    params_ = {{"embed.weight", &embed_.weight}, {"steps.weight", &steps_.weight}};
    for (nn::NamedParameter& p : modules) params_.push_back(p);
    for (nn::NamedParameter& p : norm_.named_parameters("norm.")) params_.push_back(p);
  }

  NamedParameters parameters() const { return params_; }

  Pass run(const Batch& batch, bool train) {
    const std::int64_t dim = embed_.dim();
    const std::int64_t rows = batch.count * kWindow;  // one decoder step per output slot
    // Every step of sequence b reads the same encoder outputs; each step is
    // a batch row of its own: hidden [rows, dim], encoder [rows, kWindow, dim].
    Tensor hidden(DType::f32, {rows, dim});
    Tensor encoder(DType::f32, {rows, kWindow, dim});
    std::vector<std::int64_t> lengths(rows);
    std::vector<std::int32_t> targets = batch.target;
    const float* pe = positions_.data<float>();
    for (std::int64_t b = 0; b < batch.count; ++b) {
      const std::int64_t n = batch.digits[b];
      for (std::int64_t t = 0; t < kWindow; ++t) {
        const std::int64_t r = b * kWindow + t;
        lengths[r] = n;
        if (t >= n) targets[r] = -1;
        std::memcpy(hidden.data<float>() + r * dim, steps_.row(t), dim * sizeof(float));
        for (std::int64_t s = 0; s < n; ++s) {
          const std::int64_t slot = kWindow - n + s;
          const float* e = embed_.row(batch.input[b * kWindow + slot]);
          float* dst = encoder.data<float>() + (r * kWindow + s) * dim;
          for (std::int64_t c = 0; c < dim; ++c) dst[c] = e[c] + pe[slot * dim + c];
        }
      }
    }
    nn::AdditiveAttentionOutput a = attention_.forward(hidden, encoder, lengths);
    const Tensor h = norm_.forward(a.context);
    const Tensor logits = out_.forward(h);
    Pass pass;
    Tensor dlogits = train ? zeros_like(logits) : Tensor();
    pass.loss = cross_entropy(logits, targets, train ? &dlogits : nullptr, pass.right);
    // The weights in window slots; steps not decoded stay 0.
    pass.weights = Tensor(DType::f32, {batch.count, 1, kWindow, kWindow});
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = lengths[r];
      if (r % kWindow >= n) continue;
      for (std::int64_t s = 0; s < n; ++s) {
        pass.weights.data<float>()[r * kWindow + kWindow - n + s] =
            a.weights.data<float>()[r * kWindow + s];
      }
    }
    if (!train) return pass;

    nn::zero_grad(params_);
    const Tensor dh = out_.backward(h, dlogits);
    const Tensor dcontext = norm_.backward(dh);
    const nn::AdditiveAttentionGradients g =
        attention_.backward(hidden, encoder, lengths, dcontext);
    const float* dhidden = g.d_decoder_hidden.data<float>();
    const float* dencoder = g.d_encoder_outputs.data<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = lengths[r];
      if (r % kWindow >= n) continue;
      steps_.accumulate(r % kWindow, dhidden + r * dim);
      const std::int64_t b = r / kWindow;
      for (std::int64_t s = 0; s < n; ++s) {
        embed_.accumulate(batch.input[b * kWindow + kWindow - n + s],
                          dencoder + (r * kWindow + s) * dim);
      }
    }
    return pass;
  }

 private:
  std::mt19937_64 rng_;
  Embedding embed_;
  Embedding steps_;
  nn::AdditiveAttention attention_;
  LayerNorm norm_;
  nn::Linear out_;
  Tensor positions_;
  NamedParameters params_;
};

struct TaskSetup {
  const char* title;
  const char* expected;
  const char* file_stem;
  std::int64_t heads, dim, batch;
  double lr;
};

TaskSetup setup_of(TaskKind kind) {
  switch (kind) {
    case TaskKind::reverse:
      return {"reversal: dot-product self-attention, 1 head",
              "output slot i reads input slot 11 - i: the anti-diagonal",
              "reversal",
              1,
              32,
              64,
              1e-2};
    case TaskKind::rotate:
      return {"rotation by 6 slots: dot-product self-attention, 2 heads",
              "output slot i reads input slot (i + 6) mod 12: two diagonals, in one head or "
              "shared by both",
              "rotation",
              2,
              32,
              64,
              1e-2};
    case TaskKind::reverse_additive:
      break;
  }
  return {"reversal: additive (Bahdanau) decoder attention",
          "output step i reads input slot 11 - i: the anti-diagonal",
          "reversal_additive",
          1,
          32,
          32,
          1e-2};
}

std::string token_label(std::int32_t t) { return t == kPad ? "_" : std::to_string(t); }

void print_progress(const TrainOptions& o, std::int64_t step, std::int64_t steps, double loss,
                    double accuracy, bool last) {
  if (o.progress == nullptr) return;
  char held[16] = "    -";  // before the first evaluation
  if (accuracy >= 0.0) std::snprintf(held, sizeof held, "%5.1f%%", 100.0 * accuracy);
  char text[160];
  if (o.live) {
    constexpr int kBar = 24;
    const auto filled = static_cast<int>(kBar * step / std::max<std::int64_t>(steps, 1));
    std::snprintf(text, sizeof text, "\r  [%s%s] step %5lld/%lld  loss %.4f  held-out %s",
                  std::string(filled, '#').c_str(), std::string(kBar - filled, '.').c_str(),
                  static_cast<long long>(step), static_cast<long long>(steps), loss, held);
    *o.progress << text << (last ? "\n" : "") << std::flush;
  } else {
    std::snprintf(text, sizeof text, "  step %5lld/%lld  loss %.4f  held-out %s\n",
                  static_cast<long long>(step), static_cast<long long>(steps), loss, held);
    *o.progress << text << std::flush;
  }
}

template <class Model>
TrainResult train(TaskKind kind, Model& model, const TaskSetup& setup, const TrainOptions& o) {
  TrainResult result;
  result.kind = kind;
  result.title = setup.title;
  result.expected = setup.expected;
  result.file_stem = setup.file_stem;
  result.heads = setup.heads;
  const std::int64_t steps = o.steps > 0 ? o.steps : default_steps(kind);
  Data data(kind, o.seed);
  Adam adam(model.parameters(), setup.lr);
  const auto start = std::chrono::steady_clock::now();

  auto evaluate = [&](bool keep) {
    const Batch& held = data.held_out();
    Pass pass = model.run(held, false);
    std::int64_t right_sequences = 0, right_slots = 0, slots = 0;
    for (std::int64_t b = 0; b < held.count; ++b) {
      bool all = true;
      for (std::int64_t i = 0; i < kWindow; ++i) {
        // The additive decoder runs one step per digit.
        if (kind == TaskKind::reverse_additive && i >= held.digits[b]) continue;
        ++slots;
        right_slots += pass.right[b * kWindow + i];
        all = all && pass.right[b * kWindow + i] != 0;
      }
      right_sequences += all;
    }
    result.accuracy = static_cast<double>(right_sequences) / static_cast<double>(held.count);
    result.token_accuracy = static_cast<double>(right_slots) / static_cast<double>(slots);
    if (keep) {
      // Weight on the expected key, over the output slots that hold digits
      // (padding slots may read any padding key).
      const std::int64_t heads = pass.weights.size(1);
      const float* w = pass.weights.data<float>();
      result.head_mass.assign(heads, 0.0);
      result.mean_maps.assign(heads * kWindow * kWindow, 0.0f);
      std::int64_t counted = 0;
      for (std::int64_t b = 0; b < held.count; ++b) {
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t i = 0; i < kWindow; ++i) {
            const float* row = w + ((b * heads + h) * kWindow + i) * kWindow;
            for (std::int64_t j = 0; j < kWindow; ++j) {
              result.mean_maps[(h * kWindow + i) * kWindow + j] +=
                  row[j] / static_cast<float>(held.count);
            }
            if (held.target[b * kWindow + i] == kPad) continue;
            result.head_mass[h] += row[expected_key(kind, i)];
            if (h == 0) ++counted;
          }
        }
      }
      result.pattern_mass = 0.0;
      for (double& m : result.head_mass) {
        m /= static_cast<double>(counted);
        result.pattern_mass += m / static_cast<double>(heads);
      }
      // The example: the first held-out sequence with fewer digits than
      // slots, so the picture shows padding too.
      std::int64_t e = 0;
      while (e + 1 < held.count && held.digits[e] == kMaxDigits) ++e;
      result.example_maps.assign(w + e * heads * kWindow * kWindow,
                                 w + (e + 1) * heads * kWindow * kWindow);
      result.row_labels.clear();
      result.col_labels.clear();
      result.expected_key.clear();
      for (std::int64_t i = 0; i < kWindow; ++i) {
        result.row_labels.push_back(token_label(held.target[e * kWindow + i]));
        result.col_labels.push_back(token_label(held.input[e * kWindow + i]));
        result.expected_key.push_back(expected_key(kind, i));
      }
    }
  };

  std::int64_t step = 0;
  double recent = 0.0;
  while (step < steps) {
    // Linear warm-up over the first 100 steps.
    const double warm = std::min(1.0, static_cast<double>(step + 1) / 100.0);
    const Pass pass = model.run(data.next(setup.batch), true);
    adam.step(warm);
    result.losses.push_back(static_cast<float>(pass.loss));
    ++step;
    recent = step == 1 ? pass.loss : 0.9 * recent + 0.1 * pass.loss;
    const bool eval_now = step % kEvalEvery == 0 || step == steps;
    if (eval_now) evaluate(false);
    const bool done = step == steps || (eval_now && result.accuracy >= kStopAccuracy);
    if (o.live ? (step % 10 == 0 || done) : (step % kPlainEvery == 0 || done)) {
      print_progress(o, step, steps, recent, step >= kEvalEvery ? result.accuracy : -1.0, done);
    }
    if (done) break;
  }
  result.steps_run = step;
  evaluate(true);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.parameter_hash = parameter_hash(model.parameters());
  return result;
}

}  // namespace

std::int64_t default_steps(TaskKind /*kind*/) { return 2000; }

TrainResult train_task(TaskKind kind, const TrainOptions& options) {
  if (options.threads > 0) omp_set_num_threads(static_cast<int>(options.threads));
  const TaskSetup setup = setup_of(kind);
  if (kind == TaskKind::reverse_additive) {
    AdditiveModel model(setup.dim, options.seed);
    return train(kind, model, setup, options);
  }
  SelfAttentionModel model(setup.dim, setup.heads, options.seed);
  return train(kind, model, setup, options);
}

}  // namespace qkv::tools
