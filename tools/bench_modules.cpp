// `qkv bench --suite modules`: the layers of qkv::nn at the shapes models use
// them: a BERT-base self-attention block, one decode step of a grouped-query
// decoder block against a KV cache, one step of a seq2seq decoder's additive
// attention, and squeeze-and-excitation and CBAM on a 64 x 56 x 56 feature
// map. bench/compare_torch.py times the PyTorch (and
// timm) equivalents of the same records.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "bench.hpp"
#include "bench_common.hpp"
#include "peak_probe.hpp"
#include "qkv/modules/additive.hpp"
#include "qkv/modules/multihead_attention.hpp"
#include "qkv/modules/vision.hpp"

namespace qkv::tools {
namespace {

constexpr std::uint32_t kSeed = 20240503;

enum class Module : std::uint8_t {
  mha,
  mha_backward,
  gqa_decode,
  additive,
  additive_backward,
  se,
  cbam
};

struct ModuleCase {
  std::string name;
  Module module;
  std::int64_t b = 1;
  std::int64_t n = 0;      // mha: sequence length; gqa_decode: cache length L; additive: S
  std::int64_t e = 0;      // embedding (mha, gqa_decode, additive) or channels (se, cbam)
  std::int64_t heads = 0;  // query heads
  std::int64_t kv_heads = 0;
  std::int64_t h = 0, w = 0;  // feature map (se, cbam)
  double flops = 0.0;         // multiply-adds x 2 of the dense work (0: not counted)
};

std::vector<ModuleCase> module_cases(int shrink) {
  const std::int64_t n = std::max(1, 512 / shrink), l = std::max(1, 4096 / shrink);
  const std::int64_t hw = std::max(1, 56 / shrink);
  std::vector<ModuleCase> cases;
  // BERT-base: B = 8, N = 512, E = 768, 12 heads. Four E x E projections
  // (2 B N E^2 flops each) and the attention (4 B N^2 E); backward doubles
  // the projections (dX and dW) and counts the attention 2.5x.
  const double proj = 8.0 * 8.0 * n * 768.0 * 768.0, attn = 4.0 * 8.0 * n * n * 768.0;
  const std::string bert = "mod/mha/B8/N" + std::to_string(n) + "/E768/H12";
  cases.push_back({bert + "/forward", Module::mha, 8, n, 768, 12, 12, 0, 0, proj + attn});
  cases.push_back(
      {bert + "/backward", Module::mha_backward, 8, n, 768, 12, 12, 0, 0, 2.0 * proj + 2.5 * attn});
  // One token through a 2048-wide decoder block with 32 query and 8 KV heads
  // (Dh = 64) against L cached tokens.
  const double step = 2.0 * 2048.0 * (2048.0 + 2.0 * 512.0 + 2048.0) + 4.0 * 32.0 * l * 64.0;
  cases.push_back({"mod/gqa_decode/B1/E2048/Hq32/Hkv8/L" + std::to_string(l), Module::gqa_decode, 1,
                   l, 2048, 32, 8, 0, 0, step});
  // One decoder step of Bahdanau attention: B = 32 hidden states of H = 512
  // against S = 64 encoder outputs. The encoder projection (2 B S H^2 flops)
  // dominates; the backward recomputes it and adds its two products.
  const std::int64_t s = std::max(1, 64 / shrink);
  const double energy = 2.0 * 32.0 * s * 512.0 * 512.0;
  const std::string additive = "mod/additive/B32/S" + std::to_string(s) + "/H512";
  cases.push_back({additive + "/forward", Module::additive, 32, s, 512, 0, 0, 0, 0, energy});
  cases.push_back(
      {additive + "/backward", Module::additive_backward, 32, s, 512, 0, 0, 0, 0, 3.0 * energy});
  const std::string map = "/B1/C64/H" + std::to_string(hw) + "/W" + std::to_string(hw);
  cases.push_back({"mod/se" + map + "/nchw", Module::se, 1, 0, 64, 0, 0, hw, hw, 0.0});
  cases.push_back({"mod/cbam" + map + "/nchw", Module::cbam, 1, 0, 64, 0, 0, hw, hw, 0.0});
  return cases;
}

}  // namespace

int run_modules_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options) {
  if (options.shrink < 1) {
    throw Error("bench: --shrink must be at least 1, got " + std::to_string(options.shrink));
  }
  const std::regex filter(options.filter);
  std::vector<ModuleCase> cases;
  for (ModuleCase& c : module_cases(options.shrink)) {
    if (std::regex_search(c.name, filter)) cases.push_back(std::move(c));
  }
  if (cases.empty()) {
    progress << "qkv bench: no case matches --filter '" << options.filter << "'\n";
    return 1;
  }
  if (options.list) {
    for (const ModuleCase& c : cases) out << c.name << "\n";
    return 0;
  }
  omp_set_num_threads(options.threads);
  const PeakProbe peak = probe_fma_peak(options.threads);
  char line[768];
  std::snprintf(line, sizeof line, "%-44s  %10s  %9s  %9s", "name", "ms", "GFLOP/s", "% of peak");
  out << probe_line(peak, options, line) << std::endl;
  ProbeBracket peak_bracket([&] { return probe_fma_peak(options.threads).gflops; }, peak.gflops);

  std::size_t run = 0;
  for (const ModuleCase& c : cases) {
    ++run;
    report_progress(progress, options, run, cases.size(), c.name);
    std::mt19937 rng(kSeed);
    std::function<void()> call;
    // Owners of the case's state, kept alive while `call` runs.
    std::shared_ptr<void> state;
    switch (c.module) {
      case Module::mha:
      case Module::mha_backward: {
        nn::MultiHeadAttentionConfig config;
        config.embed_dim = c.e;
        config.num_heads = c.heads;
        auto m = std::make_shared<nn::MultiHeadAttention>(config);
        nn::init_uniform(m->named_parameters(), kSeed);
        auto x = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.n, c.e}, rng));
        if (c.module == Module::mha) {
          call = [m, x] { m->forward(*x, *x, *x); };
        } else {
          nn::MultiHeadAttentionOptions o;
          o.save_for_backward = true;
          auto r = std::make_shared<nn::MultiHeadAttentionResult>(m->forward(*x, *x, *x, o));
          auto dy = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.n, c.e}, rng));
          call = [m, x, r, dy, o] { m->backward(*x, *x, *x, r->saved, *dy, o); };
        }
        state = m;
        break;
      }
      case Module::gqa_decode: {
        nn::MultiHeadAttentionConfig config;
        config.embed_dim = c.e;
        config.num_heads = c.heads;
        config.num_kv_heads = c.kv_heads;
        config.position = nn::Position::rope;
        auto m = std::make_shared<nn::MultiHeadAttention>(config);
        nn::init_uniform(m->named_parameters(), kSeed);
        KvCacheConfig kc;
        kc.batch = c.b;
        kc.kv_heads = c.kv_heads;
        kc.head_dim = c.e / c.heads;
        // Room for the prefill and every timed step.
        kc.capacity = c.n + options.repeats + 2;
        auto cache = std::make_shared<KvCache>(kc);
        const Tensor k = random_tensor(DType::f32, {c.b, c.n, c.kv_heads, kc.head_dim}, rng);
        const Tensor v = random_tensor(DType::f32, {c.b, c.n, c.kv_heads, kc.head_dim}, rng);
        cache->append(k, v);
        auto x = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, 1, c.e}, rng));
        call = [m, cache, x] { m->forward_step(*x, *cache); };
        state = cache;
        break;
      }
      case Module::additive:
      case Module::additive_backward: {
        auto m = std::make_shared<nn::AdditiveAttention>(c.e);
        nn::init_uniform(m->named_parameters(), kSeed);
        auto hidden = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.e}, rng));
        auto enc = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.n, c.e}, rng));
        if (c.module == Module::additive) {
          call = [m, hidden, enc] { m->forward(*hidden, *enc); };
        } else {
          auto dc = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.e}, rng));
          call = [m, hidden, enc, dc] { m->backward(*hidden, *enc, {}, *dc); };
        }
        state = m;
        break;
      }
      case Module::se: {
        auto m = std::make_shared<nn::SqueezeExcitation>(c.e);
        nn::init_uniform(m->named_parameters(), kSeed);
        auto x = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.e, c.h, c.w}, rng));
        call = [m, x] { m->forward(*x); };
        state = m;
        break;
      }
      case Module::cbam: {
        auto m = std::make_shared<nn::Cbam>(c.e);
        nn::init_uniform(m->named_parameters(), kSeed);
        // A variance must be positive: BatchNorm's fresh value.
        m->spatial_bn_running_var.value.set({0}, 1.0);
        auto x = std::make_shared<Tensor>(random_tensor(DType::f32, {c.b, c.e, c.h, c.w}, rng));
        call = [m, x] { m->forward(*x); };
        state = m;
        break;
      }
    }
    const Timing t = measure(call, options.repeats);
    const double gflops = c.flops / t.seconds / 1e9;
    const double peak_gflops = peak_bracket.next();
    if (options.live_progress) progress << "\r\033[K" << std::flush;
    if (options.json) {
      std::snprintf(line, sizeof line,
                    "{\"suite\":\"modules\",\"name\":\"%s\",\"impl\":\"qkv\",\"dtype\":\"f32\","
                    "\"B\":%lld,\"N\":%lld,\"E\":%lld,\"heads\":%lld,\"kv_heads\":%lld,"
                    "\"H\":%lld,\"W\":%lld,\"threads\":%d,\"seconds\":%.6g,\"gflops\":%.6g,"
                    "\"peak_gflops\":%.6g,\"fraction_of_peak\":%.4g,\"extra_bytes\":%lld}",
                    c.name.c_str(), static_cast<long long>(c.b), static_cast<long long>(c.n),
                    static_cast<long long>(c.e), static_cast<long long>(c.heads),
                    static_cast<long long>(c.kv_heads), static_cast<long long>(c.h),
                    static_cast<long long>(c.w), options.threads, t.seconds, gflops, peak_gflops,
                    gflops / peak_gflops, static_cast<long long>(t.extra_bytes));
    } else {
      std::snprintf(line, sizeof line, "%-44s  %10.3f  %9.1f  %9.1f", c.name.c_str(),
                    t.seconds * 1e3, gflops, 100.0 * gflops / peak_gflops);
    }
    out << line << std::endl;
  }
  return 0;
}

}  // namespace qkv::tools
