// Vision-language cross-attention: text tokens (queries) look at image
// patches (keys and values) through qkv::nn::MultiHeadAttention, and the
// program prints which patches each token attends to.
//
// The "image" is an 8 x 8 grid of patch features: a red square in the top
// left, a blue circle in the bottom right, and background elsewhere. Each
// patch's feature holds its content vector in the first 64 channels and its
// 2-D sine-cosine position (qkv::sinusoidal_positions_2d, as in MAE and ViT)
// in the last 64, the two halves a trained patch embedding would learn to
// keep apart. The "text" has four
// tokens: two name an object (their embedding is the object's content
// vector), two name a place (their embedding is the position code of that
// place). One attention head with identity projections makes the scores the
// plain dot products of these features, so what the weights show is what
// attention itself does: content queries find the patches with that content,
// position queries find the patches near that place.
//
//   ./build/release/examples/vision_language_attention
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "qkv/modules/multihead_attention.hpp"
#include "qkv/positional.hpp"

namespace {

constexpr std::int64_t kGrid = 8;  // patches per side
constexpr std::int64_t kPatches = kGrid * kGrid;
constexpr std::int64_t kHalf = 64;        // content channels = position channels
constexpr std::int64_t kDim = 2 * kHalf;  // feature size E
// A low frequency base suits a grid of 8: its slowest channels still vary.
constexpr double kBase = 100.0;

// A random +-1 vector: nearly orthogonal to any other one of its kind.
std::vector<float> content_vector(std::mt19937& rng) {
  std::vector<float> v(kHalf);
  for (float& x : v) x = (rng() & 1) != 0 ? 1.0f : -1.0f;
  return v;
}

}  // namespace

int main() {
  std::mt19937 rng(2024);
  const std::vector<float> red = content_vector(rng), blue = content_vector(rng);
  const std::vector<float> background = content_vector(rng);
  const qkv::Tensor pos = qkv::sinusoidal_positions_2d(kGrid, kGrid, kHalf, kBase);

  // Image patches [1, 64, E]: content, then position.
  qkv::Tensor patches(qkv::DType::f32, {1, kPatches, kDim});
  for (std::int64_t y = 0; y < kGrid; ++y) {
    for (std::int64_t x = 0; x < kGrid; ++x) {
      const bool square = y < 3 && x < 3;
      const bool circle = (y - 5.5) * (y - 5.5) + (x - 5.5) * (x - 5.5) <= 2.5;
      const std::vector<float>& content = square ? red : circle ? blue : background;
      const std::int64_t p = y * kGrid + x;
      for (std::int64_t c = 0; c < kHalf; ++c) {
        patches.set({0, p, c}, content[c]);
        patches.set({0, p, kHalf + c}, pos.get({p, c}));
      }
    }
  }

  // Text tokens [1, 4, E]: content words in the content half, place words
  // in the position half, scaled up to sharpen their focus (as a learned
  // projection would).
  const std::vector<std::string> words = {"red", "circle", "top-right", "bottom-left"};
  qkv::Tensor tokens(qkv::DType::f32, {1, 4, kDim});
  const std::int64_t top_right = 0 * kGrid + 7, bottom_left = 7 * kGrid + 0;
  for (std::int64_t c = 0; c < kHalf; ++c) {
    tokens.set({0, 0, c}, red[c]);
    tokens.set({0, 1, c}, blue[c]);
    tokens.set({0, 2, kHalf + c}, 4.0 * pos.get({top_right, c}));
    tokens.set({0, 3, kHalf + c}, 4.0 * pos.get({bottom_left, c}));
  }

  // One head, identity projections, no biases: scores = <token, patch> / sqrt(E).
  qkv::nn::MultiHeadAttentionConfig config;
  config.embed_dim = kDim;
  config.num_heads = 1;
  config.bias = false;
  qkv::nn::MultiHeadAttention attn(config);
  for (std::int64_t block = 0; block < 3; ++block) {
    for (std::int64_t i = 0; i < kDim; ++i) attn.in_proj_weight.value.set({block * kDim + i, i}, 1);
  }
  for (std::int64_t i = 0; i < kDim; ++i) attn.out_proj.weight.value.set({i, i}, 1);

  qkv::nn::MultiHeadAttentionOptions options;
  options.need_weights = true;
  const qkv::nn::MultiHeadAttentionResult r = attn.forward(tokens, patches, patches, options);
  // r.out [1, 4, E]: each token's summary of the image; r.weights [1, 4, 64].
  // No randomness beyond the seeded content vectors: the output is the same
  // on every run.

  std::printf("Cross-attention of %zu text tokens over %lld image patches (%lldx%lld grid)\n",
              words.size(), static_cast<long long>(kPatches), static_cast<long long>(kGrid),
              static_cast<long long>(kGrid));
  std::printf("(the image: red square at rows 0-2, cols 0-2; blue circle around (5.5, 5.5))\n");
  for (std::size_t t = 0; t < words.size(); ++t) {
    const auto token = static_cast<std::int64_t>(t);
    // The three strongest patches.
    std::vector<std::int64_t> order(kPatches);
    for (std::int64_t p = 0; p < kPatches; ++p) order[p] = p;
    std::partial_sort(order.begin(), order.begin() + 3, order.end(), [&](auto a, auto b) {
      return r.weights.get({0, token, a}) > r.weights.get({0, token, b});
    });
    std::printf("\ntoken \"%s\" attends most to patches", words[t].c_str());
    for (int k = 0; k < 3; ++k) {
      const std::int64_t p = order[k];
      std::printf(" (row %lld, col %lld: %.2f)", static_cast<long long>(p / kGrid),
                  static_cast<long long>(p % kGrid), r.weights.get({0, token, p}));
    }
    std::printf("\n");
    // The weights as a map: '-' < 1%, '.' < 5%, 'o' < 15%, '#' >= 15% of the
    // token's attention.
    for (std::int64_t y = 0; y < kGrid; ++y) {
      std::printf("    ");
      for (std::int64_t x = 0; x < kGrid; ++x) {
        const double w = r.weights.get({0, token, y * kGrid + x});
        std::printf("%c ", w < 0.01 ? '-' : w < 0.05 ? '.' : w < 0.15 ? 'o' : '#');
      }
      std::printf("\n");
    }
  }
  return 0;
}
