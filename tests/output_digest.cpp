// qkv_output_digest: one hash per case of the fused kernels' outputs (forward
// out, lse and probabilities, backward gradients, decode, linear attention,
// RoPE) over a fixed set of problems and options, from the public API only.
//
// A refactoring that must not change results runs it before and after, on the
// same machine and build type, and compares the two outputs line by line (see
// docs/architecture.md, "Checking a refactoring"):
//
//   build/release/tests/qkv_output_digest > before.txt   # old build
//   build/release/tests/qkv_output_digest > after.txt    # new build
//   diff before.txt after.txt
//
// Hashes depend on the Highway target the kernels dispatch to, so digests are
// compared on one machine, never stored. Inputs come from a fixed integer
// generator; results do not depend on the thread count.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;

// Calls f(index) for every element of a tensor of rank 1 to 4, row-major.
void for_each_element(const ConstTensorView& v,
                      const std::function<void(std::initializer_list<std::int64_t>)>& f) {
  const int r = v.rank();
  const std::int64_t n0 = v.size(0), n1 = r > 1 ? v.size(1) : 1, n2 = r > 2 ? v.size(2) : 1,
                     n3 = r > 3 ? v.size(3) : 1;
  for (std::int64_t a = 0; a < n0; ++a)
    for (std::int64_t b = 0; b < n1; ++b)
      for (std::int64_t c = 0; c < n2; ++c)
        for (std::int64_t d = 0; d < n3; ++d) {
          if (r == 1) f({a});
          if (r == 2) f({a, b});
          if (r == 3) f({a, b, c});
          if (r == 4) f({a, b, c, d});
        }
}

// FNV-1a over the bytes of every element of a tensor (as a double: exact
// for every dtype the kernels write).
class Digest {
 public:
  void add(const Tensor& t) {
    if (!t.defined()) return;
    for_each_element(t.view(), [&](std::initializer_list<std::int64_t> i) {
      const double x = t.get(i);
      unsigned char bytes[sizeof x];
      std::memcpy(bytes, &x, sizeof x);
      for (const unsigned char b : bytes) hash_ = (hash_ ^ b) * 1099511628211ull;
    });
  }
  unsigned long long value() const { return hash_; }

 private:
  unsigned long long hash_ = 1469598103934665603ull;
};

// Values in [-2, 2) from a 64-bit LCG: the same on every platform.
Tensor filled(DType dtype, std::initializer_list<std::int64_t> sizes, std::uint64_t seed) {
  Tensor t(dtype, sizes);
  std::uint64_t state = seed * 6364136223846793005ull + 1442695040888963407ull;
  for_each_element(t.view(), [&](std::initializer_list<std::int64_t> i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    t.set(i, static_cast<double>(state >> 40) / static_cast<double>(1 << 22) - 2.0);
  });
  return t;
}

// "name dtype" (appended, not concatenated: GCC 12 -O3 warns about the latter).
std::string label(const char* name, DType dtype) {
  std::string s = name;
  s += ' ';
  s.append(qkv::dtype_name(dtype));
  return s;
}

void print(const std::string& name, const Digest& d) {
  std::printf("%-44s %016llx\n", name.c_str(), d.value());
}

struct Shape {
  std::int64_t b, nq, nk, hq, hkv, d;
};

// Forward (out, lse, and probabilities when small) and backward of one case.
void attention_case(const std::string& name, Shape s, DType dtype, AttentionOptions o,
                    std::uint64_t seed) {
  const Tensor q = filled(dtype, {s.b, s.nq, s.hq, s.d}, seed);
  const Tensor k = filled(dtype, {s.b, s.nk, s.hkv, s.d}, seed + 1);
  const Tensor v = filled(dtype, {s.b, s.nk, s.hkv, s.d}, seed + 2);
  o.backend = qkv::Backend::fast;
  o.return_lse = true;
  o.return_probs = s.nq * s.nk <= 1 << 16;
  const qkv::AttentionResult r = qkv::attention(q, k, v, o);
  Digest forward;
  forward.add(r.out);
  forward.add(r.lse);
  forward.add(r.probs);
  print(name + " forward", forward);
  // score_mod has no backward.
  if (o.score_mod) return;
  const Tensor dout = filled(dtype, {s.b, s.nq, s.hq, s.d}, seed + 3);
  const qkv::AttentionGradients g = qkv::attention_backward(q, k, v, r.out, dout, r.lse, o);
  Digest backward;
  backward.add(g.dq);
  backward.add(g.dk);
  backward.add(g.dv);
  backward.add(g.d_relative_bias);
  for (const Tensor* t :
       {&g.d_additive_w_q, &g.d_additive_w_k, &g.d_additive_v, &g.d_additive_bias}) {
    backward.add(*t);
  }
  print(name + " backward", backward);
}

void attention_cases() {
  const Shape self{2, 77, 77, 4, 2, 40};
  const Shape cross{1, 33, 300, 8, 8, 64};
  const Shape tiny{1, 16, 16, 8, 8, 64};
  const Shape long_keys{1, 130, 700, 2, 1, 128};
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    attention_case(label("plain self", dtype), self, dtype, {}, 1);
    attention_case(label("plain cross", dtype), cross, dtype, {}, 2);
    AttentionOptions causal;
    causal.causal = true;
    attention_case(label("causal bottom-right", dtype), cross, dtype, causal, 3);
    causal.align = qkv::Align::top_left;
    attention_case(label("causal top-left", dtype), long_keys, dtype, causal, 4);
  }
  const DType f32 = DType::f32;
  attention_case("tiny", tiny, f32, {}, 5);

  AttentionOptions window;
  window.window_left = 20;
  window.window_right = 3;
  attention_case("window", long_keys, f32, window, 7);

  AttentionOptions softcap;
  softcap.softcap = 3.0;
  softcap.causal = true;
  attention_case("softcap causal", self, f32, softcap, 8);

  const std::vector<float> slopes = qkv::alibi_slopes(self.hq);
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes;
  alibi.causal = true;
  attention_case("alibi causal", self, f32, alibi, 9);

  const std::int64_t lengths[] = {50, 3};
  AttentionOptions key_lengths;
  key_lengths.key_lengths = lengths;
  attention_case("key lengths", self, f32, key_lengths, 10);

  const std::int64_t cu_q[] = {0, 5, 5, 70, 77};
  const std::int64_t cu_k[] = {0, 30, 31, 60, 77};
  AttentionOptions varlen;
  varlen.cu_seqlens_q = cu_q;
  varlen.cu_seqlens_k = cu_k;
  varlen.causal = true;
  attention_case("varlen causal", {1, 77, 77, 4, 2, 40}, f32, varlen, 11);

  Tensor bool_mask(DType::boolean, {2, 1, 77, 77});
  std::int64_t element = 0;
  for_each_element(bool_mask.view(), [&](std::initializer_list<std::int64_t> i) {
    bool_mask.set(i, (element++ * 7) % 5 != 0 ? 1.0 : 0.0);
  });
  AttentionOptions masked;
  masked.mask = bool_mask;
  attention_case("bool mask", self, f32, masked, 12);

  const Tensor float_mask = filled(f32, {1, 4, 77, 77}, 13);
  AttentionOptions biased;
  biased.mask = float_mask;
  attention_case("float mask", self, f32, biased, 14);

  const Tensor table = filled(f32, {4, 32}, 15);
  AttentionOptions relative;
  relative.relative_bias = {table, 64, true};
  attention_case("relative bias", self, f32, relative, 16);

  AttentionOptions dropout;
  dropout.dropout_p = 0.2;
  dropout.dropout_seed = 17;
  dropout.dropout_offset = 3;
  attention_case("dropout", self, f32, dropout, 17);

  AttentionOptions sparse;
  sparse.sparse = qkv::SparsePattern::window(16, 0) | qkv::SparsePattern::global_tokens({0, 1});
  attention_case("sparse window + global", long_keys, f32, sparse, 18);
  qkv::BigBirdConfig bigbird;
  bigbird.heads = 2;
  bigbird.nq = 130;
  bigbird.nk = 700;
  bigbird.block_size = 32;
  bigbird.seed = 19;
  AttentionOptions block_sparse;
  block_sparse.sparse = qkv::SparsePattern::block_sparse(qkv::bigbird_layout(bigbird));
  attention_case("sparse bigbird", long_keys, f32, block_sparse, 19);

  AttentionOptions flex;
  flex.score_mod = [](double s, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
    return s + 0.01 * static_cast<double>((h + 1) * (i - j));
  };
  flex.mask_mod = [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
    return (i + j) % 3 != 0;
  };
  attention_case("score_mod and mask_mod", self, f32, flex, 20);
  flex.score_mod = nullptr;
  attention_case("mask_mod", self, f32, flex, 26);

  const Tensor w_q = filled(f32, {24, 40}, 21), w_k = filled(f32, {24, 40}, 22),
               av = filled(f32, {24}, 23), ab = filled(f32, {24}, 24);
  AttentionOptions additive;
  additive.score = qkv::Score::additive;
  additive.additive = {w_q, w_k, av, ab};
  additive.causal = true;
  attention_case("additive causal", self, f32, additive, 25);
}

void decode_cases() {
  for (const std::int64_t page_size : {0, 16}) {
    for (const DType storage : {DType::f32, DType::bf16}) {
      qkv::KvCacheConfig c;
      c.batch = 2;
      c.kv_heads = 2;
      c.head_dim = 64;
      c.capacity = 600;
      c.dtype = storage;
      c.page_size = page_size;
      qkv::KvCache cache(c);
      const std::int64_t counts[] = {600, 37};
      qkv::RopeConfig rope;
      cache.append(filled(DType::f32, {2, 600, 2, 64}, 31), filled(DType::f32, {2, 600, 2, 64}, 32),
                   counts, &rope);
      const Tensor q = filled(DType::f32, {2, 1, 8, 64}, 33);
      AttentionOptions o;
      o.return_lse = true;
      o.softcap = 20.0;
      const qkv::AttentionResult r = qkv::decode_attention(q, cache, o);
      Digest d;
      d.add(r.out);
      d.add(r.lse);
      print(label(page_size > 0 ? "decode paged" : "decode contiguous", storage), d);
    }
  }
}

void linear_and_rope_cases() {
  const Tensor q = filled(DType::f32, {2, 130, 4, 32}, 41),
               k = filled(DType::f32, {2, 130, 2, 32}, 42),
               v = filled(DType::f32, {2, 130, 2, 24}, 43),
               dout = filled(DType::f32, {2, 130, 4, 24}, 44);
  for (const bool causal : {false, true}) {
    qkv::LinearAttentionOptions o;
    o.causal = causal;
    o.backend = qkv::Backend::fast;
    Digest d;
    d.add(qkv::linear_attention(q, k, v, o).out);
    const qkv::LinearAttentionGradients g = qkv::linear_attention_backward(q, k, v, dout, o);
    d.add(g.dq);
    d.add(g.dk);
    d.add(g.dv);
    print(std::string("linear ") + (causal ? "causal" : "full"), d);
  }
  Tensor x = filled(DType::f32, {2, 40, 4, 32}, 45);
  const std::int64_t starts[] = {0, 100};
  qkv::RopeConfig rope;
  rope.interleaved = true;
  qkv::apply_rope(x.view(), starts, rope);
  Digest d;
  d.add(x);
  print("rope interleaved", d);
}

}  // namespace

int main() {
  try {
    attention_cases();
    decode_cases();
    linear_and_rope_cases();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv_output_digest: %s\n", e.what());
    return 1;
  }
  return 0;
}
