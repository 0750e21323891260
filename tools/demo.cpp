// `qkv demo`: built-in examples of qkv::attention on built-in data, each
// followed by checks of its result against the semantics in qkv/attention.hpp;
// then small transformers trained with the qkv::nn modules' backward passes
// (train.hpp), with checks of what they learned and pictures of their
// attention.
#include "demo.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "picture.hpp"
#include "qkv/npy.hpp"
#include "qkv/qkv.hpp"
#include "train.hpp"

namespace qkv::tools {
namespace {

constexpr std::int64_t kDim = 16;  // model dimension of every example
// Word vectors are longer than sinusoidal ones (norm sqrt(8)), so that the
// word, more than the position, decides which tokens look alike.
constexpr double kWordNorm = 4.0;
// Padding is filled with this so that any leak into valid rows shows.
constexpr double kGarbage = 1e6;
// The demo recomputes in double what the library returns in f32: f32 rounding
// (even of a fused kernel) stays far below this, a real bug far above.
constexpr double kTolerance = 1e-5;

using Vector = std::array<double, kDim>;
using Matrix = std::vector<std::vector<double>>;
using Words = std::span<const std::string_view>;

constexpr std::array<std::string_view, 10> kSentence = {"the", "cat",     "sat", "on",  "the",
                                                        "mat", "because", "it",  "was", "tired"};

// Largest of a and b, NaN if either is, so that a NaN error fails its check.
double worst(double a, double b) { return std::isnan(b) || b > a ? b : a; }

std::string scientific(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2e", x);
  return text;
}

std::string fixed(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", x);
  return text;
}

// A pseudo-random vector of norm kWordNorm, seeded by the word's FNV-1a hash
// and drawn with splitmix64, so equal words get equal vectors on every run.
Vector word_vector(std::string_view word) {
  std::uint64_t state = 14695981039346656037ull;
  for (const char c : word) state = (state ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  Vector x{};
  double norm2 = 0.0;
  for (double& value : x) {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    value = static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;  // uniform in [-1, 1)
    norm2 += value * value;
  }
  for (double& value : x) value *= kWordNorm / std::sqrt(norm2);
  return x;
}

// Row `position` of qkv::sinusoidal_positions.
Vector position_vector(std::int64_t position) {
  const Tensor pe = sinusoidal_positions(position + 1, kDim);
  Vector x{};
  for (std::int64_t c = 0; c < kDim; ++c) x[c] = pe.get({position, c});
  return x;
}

Vector plus(const Vector& a, const Vector& b) {
  Vector x{};
  for (std::int64_t c = 0; c < kDim; ++c) x[c] = a[c] + b[c];
  return x;
}

void set_row(Tensor& t, std::int64_t b, std::int64_t i, std::int64_t h, const Vector& x) {
  for (std::int64_t c = 0; c < kDim; ++c) t.set({b, i, h, c}, x[c]);
}

// [1, n, 1, kDim]: each word's vector plus its sinusoidal position.
Tensor sentence_tokens(Words words) {
  const auto n = static_cast<std::int64_t>(words.size());
  Tensor x(DType::f32, {1, n, 1, kDim});
  for (std::int64_t i = 0; i < n; ++i) {
    set_row(x, 0, i, 0, plus(word_vector(words[i]), position_vector(i)));
  }
  return x;
}

// Rows [0, n) of head h of sequence b of a [B, N, H, D] tensor, in double.
Matrix rows_of(ConstTensorView t, std::int64_t b, std::int64_t h, std::int64_t n) {
  Matrix m(n, std::vector<double>(t.size(3)));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t c = 0; c < t.size(3); ++c) m[i][c] = t.get({b, i, h, c});
  }
  return m;
}

// The [nq, Nk] weights of sequence b and head h from probs [B, H, Nq, Nk].
Matrix weights_of(const Tensor& probs, std::int64_t b, std::int64_t h, std::int64_t nq) {
  Matrix w(nq, std::vector<double>(probs.size(3)));
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t j = 0; j < probs.size(3); ++j) w[i][j] = probs.get({b, h, i, j});
  }
  return w;
}

// softmax(Q K^T / sqrt(D)) in double, independently of the library; `causal`
// drops keys after the query (Nq == Nk here, so both alignments agree).
Matrix reference_weights(const Matrix& q, const Matrix& k, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q[0].size()));
  Matrix w(q.size(), std::vector<double>(k.size(), 0.0));
  for (std::size_t i = 0; i < q.size(); ++i) {
    const std::size_t keys = causal ? i + 1 : k.size();
    double row_max = -std::numeric_limits<double>::infinity();
    for (std::size_t j = 0; j < keys; ++j) {
      double s = 0.0;
      for (std::size_t c = 0; c < q[i].size(); ++c) s += q[i][c] * k[j][c];
      w[i][j] = s * scale;
      row_max = std::max(row_max, w[i][j]);
    }
    double sum = 0.0;
    for (std::size_t j = 0; j < keys; ++j) sum += w[i][j] = std::exp(w[i][j] - row_max);
    for (std::size_t j = 0; j < keys; ++j) w[i][j] /= sum;
  }
  return w;
}

Matrix matmul(const Matrix& a, const Matrix& b) {
  Matrix c(a.size(), std::vector<double>(b[0].size(), 0.0));
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (std::size_t j = 0; j < b.size(); ++j) {
      for (std::size_t t = 0; t < b[j].size(); ++t) c[i][t] += a[i][j] * b[j][t];
    }
  }
  return c;
}

double max_abs_diff(const Matrix& a, const Matrix& b) {
  double d = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (std::size_t j = 0; j < a[i].size(); ++j) d = worst(d, std::abs(a[i][j] - b[i][j]));
  }
  return d;
}

double max_row_sum_error(const Matrix& w) {
  double d = 0.0;
  for (const std::vector<double>& row : w) {
    double sum = 0.0;
    for (const double x : row) sum += x;
    d = worst(d, std::abs(sum - 1.0));
  }
  return d;
}

std::size_t argmax(const std::vector<double>& row) {
  return static_cast<std::size_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// 0 for a weight of exactly 0 (so masked keys stay blank), else 1..9 in
// steps of 1/9.
int shade_level(double w) {
  if (!(w > 0.0)) return 0;
  return std::min(9, static_cast<int>(std::ceil(w * 9.0)));
}

std::string cell(int level, bool color) {
  if (!color) return std::string(3, " .:-=+*#%@"[level]);
  if (level == 0) return "   ";
  // Grey ramp of the 256-colour palette, 236 (dark) to 255 (white).
  return "\x1b[48;5;" + std::to_string(236 + (level - 1) * 19 / 8) + "m   \x1b[0m";
}

class Demo {
 public:
  Demo(std::ostream& os, bool color) : os_(os), color_(color) {}

  std::ostream& out() { return os_; }

  void check(bool ok, const std::string& text) {
    os_ << (ok ? "  [ok] " : "  [FAIL] ") << text << "\n";
    ++(ok ? passed_ : failed_);
  }

  // Passes when `error` <= `tolerance`; NaN fails.
  void check_small(const std::string& what, const std::string& measure, double error,
                   double tolerance) {
    const bool ok = error <= tolerance;
    check(ok, what + " (" + measure + " = " + scientific(error) +
                  (ok ? "" : " > " + scientific(tolerance)) + ")");
  }

  // Checks that every weight w[i][j] with dropped(i, j) is exactly 0.
  template <class Dropped>
  void check_zero(const std::string& what, const Matrix& w, Dropped dropped) {
    int count = 0;
    double largest = 0.0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      for (std::size_t j = 0; j < w[i].size(); ++j) {
        if (!dropped(i, j)) continue;
        ++count;
        largest = worst(largest, std::abs(w[i][j]));
      }
    }
    check(largest == 0.0, "all " + std::to_string(count) + " weights " + what +
                              " are exactly 0 (largest |w| = " + scientific(largest) + ")");
  }

  // Rows are queries, columns keys; key labels run downwards, a letter a line.
  void heatmap(const Matrix& w, Words rows, Words cols) {
    std::size_t label_width = 0;
    for (const std::string_view r : rows) label_width = std::max(label_width, r.size());
    std::size_t height = 0;
    for (const std::string_view c : cols) height = std::max(height, c.size());
    for (std::size_t line = 0; line < height; ++line) {
      std::string text(4 + label_width, ' ');
      for (const std::string_view c : cols) {
        text += ' ';
        text += line < c.size() ? c[line] : ' ';
        text += ' ';
      }
      os_ << text.substr(0, text.find_last_not_of(' ') + 1) << "\n";
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::string text = "   " + std::string(rows[i]);
      text.resize(4 + label_width, ' ');
      for (const double x : w[i]) text += cell(shade_level(x), color_);
      os_ << text.substr(0, text.find_last_not_of(' ') + 1) << "\n";
    }
    os_ << "   blank = weight 0; ";
    for (int level = 1; level <= 9; ++level) {
      os_ << (color_ ? cell(level, true) : cell(level, false).substr(0, 1));
    }
    os_ << " = weight up to 1/9, 2/9, ..., 1\n";
  }

  bool summary() {
    os_ << "\ndemo: " << passed_ << " checks passed, " << failed_ << " failed\n";
    return failed_ == 0;
  }

 private:
  std::ostream& os_;
  bool color_;
  int passed_ = 0;
  int failed_ = 0;
};

void self_attention(Demo& d) {
  d.out() << "1. Self-attention over a sentence, one head, no projections:\n"
             "   Q = K = V = X = word vector + sinusoidal position (d = 16),\n"
             "   weights = softmax(X X^T / 4). Both \"the\" share a word vector.\n\n";
  const Tensor x = sentence_tokens(kSentence);
  AttentionOptions opt;
  opt.return_probs = true;
  const AttentionResult r = attention(x, x, x, opt);
  const std::int64_t n = kSentence.size();
  const Matrix xs = rows_of(x, 0, 0, n);
  const Matrix w = weights_of(r.probs, 0, 0, n);
  d.heatmap(w, kSentence, kSentence);
  d.check_small("rows sum to 1", "max |sum - 1|", max_row_sum_error(w), kTolerance);
  d.check_small("weights match softmax(X X^T / 4) in double", "max abs diff",
                max_abs_diff(w, reference_weights(xs, xs, false)), kTolerance);
  d.check_small("output equals weights x V", "max abs diff",
                max_abs_diff(rows_of(r.out, 0, 0, n), matmul(w, xs)), kTolerance);
}

void cross_attention(Demo& d) {
  d.out() << "\n2. Cross-attention, 3 queries over 6 keys (Nq != Nk), 2 heads:\n"
             "   keys = values = \"the cat sat on the mat\", head 0 holding word vectors\n"
             "   and head 1 sinusoidal positions. Each query asks head 0 for a word and\n"
             "   head 1 for a position, so each head's argmax should be what it asked.\n";
  constexpr std::array<std::string_view, 6> keys = {"the", "cat", "sat", "on", "the", "mat"};
  struct Query {
    std::string_view word;
    std::int64_t position;
  };
  constexpr std::array<Query, 3> queries = {{{"mat", 1}, {"cat", 3}, {"on", 4}}};
  Tensor k(DType::f32, {1, keys.size(), 2, kDim});
  for (std::size_t j = 0; j < keys.size(); ++j) {
    set_row(k, 0, j, 0, word_vector(keys[j]));
    set_row(k, 0, j, 1, position_vector(j));
  }
  Tensor q(DType::f32, {1, queries.size(), 2, kDim});
  for (std::size_t i = 0; i < queries.size(); ++i) {
    set_row(q, 0, i, 0, word_vector(queries[i].word));
    set_row(q, 0, i, 1, position_vector(queries[i].position));
  }
  AttentionOptions opt;
  opt.return_probs = true;
  const AttentionResult r = attention(q, k, k, opt);

  double sum_error = 0.0;
  double value_error = 0.0;
  bool found = true;
  for (std::int64_t h = 0; h < 2; ++h) {
    const Matrix w = weights_of(r.probs, 0, h, queries.size());
    std::string header = h == 0 ? "   head 0 (words)" : "   head 1 (positions)";
    header.resize(21, ' ');
    for (const std::string_view key : keys) header += std::string(6 - key.size(), ' ') += key;
    d.out() << "\n" << header << "   argmax\n";
    for (std::size_t i = 0; i < queries.size(); ++i) {
      const std::size_t best = argmax(w[i]);
      std::string line =
          "     " + std::string(queries[i].word) + " @ " + std::to_string(queries[i].position);
      line.resize(21, ' ');
      for (const double x : w[i]) line += "  " + fixed(x);
      d.out() << line << "   " << keys[best] << " @ " << best << "\n";
      found = found && (h == 0 ? keys[best] == queries[i].word
                               : static_cast<std::int64_t>(best) == queries[i].position);
    }
    sum_error = worst(sum_error, max_row_sum_error(w));
    value_error = worst(value_error, max_abs_diff(rows_of(r.out, 0, h, queries.size()),
                                                  matmul(w, rows_of(k, 0, h, keys.size()))));
  }
  d.out() << "\n";
  d.check_small("rows sum to 1 in both heads", "max |sum - 1|", sum_error, kTolerance);
  d.check(found, "head 0 finds each query's word, head 1 its position");
  d.check_small("output equals weights x V in both heads", "max abs diff", value_error, kTolerance);
}

void causal_attention(Demo& d) {
  d.out() << "\n3. Causal self-attention (options.causal = true) on the same sentence:\n"
             "   each token attends to itself and the tokens before it.\n\n";
  const Tensor x = sentence_tokens(kSentence);
  AttentionOptions opt;
  opt.causal = true;
  opt.return_probs = true;
  const AttentionResult r = attention(x, x, x, opt);
  const std::int64_t n = kSentence.size();
  const Matrix xs = rows_of(x, 0, 0, n);
  const Matrix w = weights_of(r.probs, 0, 0, n);
  d.heatmap(w, kSentence, kSentence);
  d.check_zero("above the diagonal", w, [](std::size_t i, std::size_t j) { return j > i; });
  d.check_small("rows sum to 1", "max |sum - 1|", max_row_sum_error(w), kTolerance);
  d.check_small("weights match a causal softmax in double", "max abs diff",
                max_abs_diff(w, reference_weights(xs, xs, true)), kTolerance);
}

void padded_batch(Demo& d) {
  constexpr std::array<std::string_view, 7> longer = {"the", "cat",  "sat", "on",
                                                      "the", "warm", "mat"};
  constexpr std::array<std::string_view, 4> shorter = {"it", "was", "very", "tired"};
  constexpr std::array<std::int64_t, 2> lengths = {longer.size(), shorter.size()};
  constexpr std::int64_t n = longer.size();
  d.out() << "\n4. Padded batch: B = 2 padded to 7 tokens, options.key_lengths = {7, 4}:\n"
             "   sequence 0: \"the cat sat on the warm mat\"\n"
             "   sequence 1: \"it was very tired\" + 3 rows of padding set to 1e6.\n"
             "   Weights of sequence 1's real queries:\n\n";
  const Tensor first = sentence_tokens(longer);
  const Tensor second = sentence_tokens(shorter);
  Tensor x(DType::f32, {2, n, 1, kDim});
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t c = 0; c < kDim; ++c) {
      x.set({0, i, 0, c}, first.get({0, i, 0, c}));
      x.set({1, i, 0, c}, i < lengths[1] ? second.get({0, i, 0, c}) : kGarbage);
    }
  }
  AttentionOptions opt;
  opt.key_lengths = lengths;
  opt.return_probs = true;
  const AttentionResult r = attention(x, x, x, opt);
  const AttentionResult alone = attention(second, second, second);

  const Matrix w = weights_of(r.probs, 1, 0, n);
  constexpr std::array<std::string_view, 7> columns = {"it",  "was", "very", "tired",
                                                       "pad", "pad", "pad"};
  d.heatmap(Matrix(w.begin(), w.begin() + lengths[1]), shorter, columns);
  d.check_zero("on padded keys", w, [&](std::size_t, std::size_t j) {
    return static_cast<std::int64_t>(j) >= lengths[1];
  });
  d.check_small("rows sum to 1 in both sequences", "max |sum - 1|",
                worst(max_row_sum_error(weights_of(r.probs, 0, 0, n)), max_row_sum_error(w)),
                kTolerance);
  d.check_small(
      "same output as sequence 1 run alone, unpadded", "max abs diff",
      max_abs_diff(rows_of(r.out, 1, 0, lengths[1]), rows_of(alone.out, 0, 0, lengths[1])),
      kTolerance);
}

// One head's [rows, cols] block of a [heads, rows, cols] map, as a Matrix.
Matrix head_map(const std::vector<float>& maps, std::int64_t head) {
  Matrix m(kWindow, std::vector<double>(kWindow));
  for (std::int64_t i = 0; i < kWindow; ++i) {
    for (std::int64_t j = 0; j < kWindow; ++j) m[i][j] = maps[(head * kWindow + i) * kWindow + j];
  }
  return m;
}

std::string percent(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * x);
  return text;
}

std::string joined(const std::vector<std::string>& labels) {
  std::string text;
  for (const std::string& l : labels) text += (text.empty() ? "" : " ") + l;
  return text;
}

// The picture's panels: one per head of the held-out example's map.
std::vector<HeatmapPanel> panels_of(const TrainResult& r, const std::string& prefix) {
  std::vector<HeatmapPanel> panels;
  for (std::int64_t h = 0; h < r.heads; ++h) {
    HeatmapPanel p;
    p.title = prefix + (r.heads > 1 ? "head " + std::to_string(h) : "");
    p.values.assign(r.example_maps.begin() + h * kWindow * kWindow,
                    r.example_maps.begin() + (h + 1) * kWindow * kWindow);
    p.rows = kWindow;
    p.cols = kWindow;
    p.row_labels = r.row_labels;
    p.col_labels = r.col_labels;
    panels.push_back(std::move(p));
  }
  return panels;
}

std::string axes_caption(const TrainResult& r, const std::string& note) {
  return "Rows: output slots, labelled with the digit each outputs; columns: input slots (" +
         joined(r.col_labels) + ", _ = padding). Expected: " + r.expected + " (" + note + ").";
}

std::string note_of(const TrainResult& r) {
  return r.kind == TaskKind::reverse_additive
             ? "the decoder runs one step per digit: rows past them stay empty"
             : "rows that output padding need no particular slot";
}

void write_text(const std::filesystem::path& path, const std::vector<std::string>& lines) {
  std::ofstream out(path);
  for (const std::string& l : lines) out << l << "\n";
  if (!out) throw Error("cannot write " + path.string());
}

// Writes <stem>.png, <stem>.npy (the example's weights [heads, 12, 12]),
// <stem>_mean.npy (averaged over the held-out set) and the example's tokens
// (<stem>_keys.txt, <stem>_queries.txt, for `qkv viz --tokens`); returns the
// picture's path.
std::string write_task_files(const TrainResult& r, const std::filesystem::path& dir) {
  const std::filesystem::path png = dir / (r.file_stem + ".png");
  std::string caption =
      "Learned attention, " + r.title + ", on a held-out sequence. " + axes_caption(r, note_of(r));
  write_heatmap_png(png.string(), panels_of(r, ""), caption);
  Tensor example(DType::f32, {r.heads, kWindow, kWindow});
  std::copy(r.example_maps.begin(), r.example_maps.end(), example.data<float>());
  save_npy((dir / (r.file_stem + ".npy")).string(), example);
  Tensor mean(DType::f32, {r.heads, kWindow, kWindow});
  std::copy(r.mean_maps.begin(), r.mean_maps.end(), mean.data<float>());
  save_npy((dir / (r.file_stem + "_mean.npy")).string(), mean);
  write_text(dir / (r.file_stem + "_keys.txt"), r.col_labels);
  write_text(dir / (r.file_stem + "_queries.txt"), r.row_labels);
  return png.string();
}

// The two reversals side by side: dot-product self-attention and the additive
// decoder's alignment, on the same held-out sequence.
std::string write_comparison(const TrainResult& dot, const TrainResult& additive,
                             const std::filesystem::path& dir) {
  const std::filesystem::path png = dir / "reversal_compare.png";
  std::vector<HeatmapPanel> panels = panels_of(dot, "dot-product self-attention");
  for (HeatmapPanel& p : panels_of(additive, "additive (Bahdanau) decoder")) {
    panels.push_back(std::move(p));
  }
  write_heatmap_png(
      png.string(), panels,
      "Two models trained with qkv's backward passes to reverse 8 to 12 digits, on "
      "the same held-out sequence. " +
          axes_caption(dot,
                       "left: rows that output padding need no particular slot; right: "
                       "the decoder runs one step per digit"));
  return png.string();
}

TrainResult train_and_check(Demo& d, TaskKind kind, const DemoOptions& options,
                            const std::string& number, const std::string& what) {
  d.out() << "\n" << number << what;
  TrainOptions o;
  o.steps = options.steps;
  o.seed = options.seed;
  o.threads = options.threads;
  o.progress = &d.out();
  o.live = options.live;
  const TrainResult r = train_task(kind, o);
  char line[200];
  std::snprintf(line, sizeof line,
                "   %lld steps in %.1f s: held-out sequences right %s (slots %s)\n"
                "   mean weight on the expected input slot:",
                static_cast<long long>(r.steps_run), r.seconds, percent(r.accuracy).c_str(),
                percent(r.token_accuracy).c_str());
  d.out() << line;
  for (std::int64_t h = 0; h < r.heads; ++h) {
    d.out() << (r.heads > 1 ? (h > 0 ? ", head " : " head ") + std::to_string(h) : "") << " "
            << percent(r.head_mass[h]);
  }
  d.out() << "\n\n";
  std::vector<std::string_view> rows(r.row_labels.begin(), r.row_labels.end());
  std::vector<std::string_view> cols(r.col_labels.begin(), r.col_labels.end());
  for (std::int64_t h = 0; h < r.heads; ++h) {
    if (r.heads > 1) d.out() << "   head " << h << ":\n";
    d.heatmap(head_map(r.example_maps, h), rows, cols);
  }
  d.check(r.accuracy >= 0.99, "held-out sequence accuracy " + percent(r.accuracy) + " >= 99%");
  std::int64_t best = 0;
  for (std::int64_t h = 1; h < r.heads; ++h) best = r.head_mass[h] > r.head_mass[best] ? h : best;
  const std::string who = r.heads > 1 ? "head " + std::to_string(best) + "'s " : "";
  d.check(r.head_mass[best] >= 0.9, who + "mean weight on the expected input slot " +
                                        percent(r.head_mass[best]) + " >= 90% (" + r.expected +
                                        ")");
  return r;
}

void training(Demo& d, const DemoOptions& options) {
  // The output folder first, so that a bad --out fails before the training.
  const std::filesystem::path dir(options.out);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error)
    throw Error("cannot create the folder " + options.out + " (--out): " + error.message());
  const std::string budget = options.steps > 0 ? std::to_string(options.steps)
                                               : std::to_string(default_steps(TaskKind::reverse));
  d.out() << "\nTraining: small transformers built from qkv::nn modules (token embedding +\n"
             "sinusoidal positions -> attention -> layer norm -> Linear), trained with the\n"
             "modules' backward passes, softmax cross-entropy and Adam on fresh random\n"
             "sequences of 8 to 12 digits in a window of 12 slots (_ = padding).\nSeed "
          << options.seed << ", " << options.threads
          << (options.threads == 1 ? " thread" : " threads") << ", at most " << budget
          << " steps a task.\n"
             "Accuracy is measured on 1000 held-out sequences never trained on. In the maps,\n"
             "rows are output slots (labelled with the digit each outputs), columns input\n"
             "slots; rows that output padding need no particular slot.\n";
  const TrainResult reverse = train_and_check(
      d, TaskKind::reverse, options, "5. ",
      "Reversal, self-attention (1 head): the digits sit right-aligned in the input\n"
      "   and are read out left-aligned, so output slot i must read input slot 11 - i\n"
      "   whatever the length: the map should be the anti-diagonal.\n");
  const TrainResult rotate = train_and_check(
      d, TaskKind::rotate, options, "6. ",
      "Rotation by 6, self-attention (2 heads): digits left-aligned, output slot i\n"
      "   = input slot (i + 6) mod 12 (the window's halves exchanged): two diagonals.\n"
      "   One head usually learns the whole map while the other idles on padding.\n");
  const TrainResult additive = train_and_check(
      d, TaskKind::reverse_additive, options, "7. ",
      "Reversal again, decoded one output slot at a time by qkv::nn::AdditiveAttention\n"
      "   (Bahdanau: score v . tanh(W_e enc_s + W_h dec_i)), as a seq2seq decoder: step\n"
      "   i < n holds a learned vector and attends over the n encoded digits (padding\n"
      "   masked); its alignment should be the anti-diagonal too.\n");

  d.out() << "\nPictures (rows = output slots, columns = input slots, on one held-out sequence)"
             " and .npy weights:\n";
  for (const TrainResult* r : {&reverse, &rotate, &additive}) {
    d.out() << "   " << write_task_files(*r, dir) << "\n";
  }
  d.out() << "   " << write_comparison(reverse, additive, dir) << "\n";
}

}  // namespace

bool run_demo(std::ostream& os, const DemoOptions& options) {
  Demo d(os, options.color);
  self_attention(d);
  cross_attention(d);
  causal_attention(d);
  padded_batch(d);
  if (options.train) training(d, options);
  return d.summary();
}

}  // namespace qkv::tools
