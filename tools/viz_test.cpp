// Heatmap pictures: heatmap_png's output decoded (stb_image) and checked
// pixel by pixel where the layout is known (cell colours, white background,
// label text), its argument errors; and `qkv viz` end to end: the binary
// (qkv::test::kCli) on .npy files written here, its pictures decoded, and its
// errors: one line, exit status 2, no file written.
#include <gtest/gtest.h>
#include <stb_image.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cli_path.hpp"
#include "picture.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"

namespace qkv::tools {
namespace {

namespace fs = std::filesystem;

struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;
  bool at(int x, int y, std::uint8_t r, std::uint8_t g, std::uint8_t b) const {
    const std::uint8_t* p = &rgb[(static_cast<std::size_t>(y) * width + x) * 3];
    return p[0] == r && p[1] == g && p[2] == b;
  }
  bool dark(int x, int y) const {
    const std::uint8_t* p = &rgb[(static_cast<std::size_t>(y) * width + x) * 3];
    return p[0] < 80 && p[1] < 80 && p[2] < 80;
  }
};

// PNG bytes decoded to RGB; an empty image if they do not decode.
Image decode(const std::vector<std::uint8_t>& png, int* channels_in_file = nullptr) {
  Image image;
  int channels = 0;
  unsigned char* pixels = stbi_load_from_memory(png.data(), static_cast<int>(png.size()),
                                                &image.width, &image.height, &channels, 3);
  if (pixels == nullptr) return {};
  image.rgb.assign(pixels, pixels + static_cast<std::size_t>(image.width) * image.height * 3);
  stbi_image_free(pixels);
  if (channels_in_file != nullptr) *channels_in_file = channels;
  return image;
}

std::vector<std::uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string read_text(const fs::path& p) {
  const std::vector<std::uint8_t> bytes = read_bytes(p);
  return {bytes.begin(), bytes.end()};
}

// The colour map's ends (matplotlib's viridis).
constexpr std::uint8_t kTop[3] = {253, 231, 37};
constexpr std::uint8_t kBottom[3] = {68, 1, 84};

HeatmapPanel panel(std::int64_t rows, std::int64_t cols, std::uint32_t seed = 1) {
  HeatmapPanel p;
  p.rows = rows;
  p.cols = cols;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (std::int64_t i = 0; i < rows * cols; ++i) p.values.push_back(uniform(rng));
  return p;
}

// The message of the qkv::Error `f` throws ("" if none).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(HeatmapPng, DecodesToItsSizeWithTheMapsColoursAndText) {
  // The identity: 3 cells of the largest value (the map's top colour), 6 of 0.
  HeatmapPanel p;
  p.title = "identity";
  p.rows = p.cols = 3;
  p.values = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  p.row_labels = p.col_labels = {"the", "cat", "sat"};
  ImageSize size;
  int channels = 0;
  const Image image = decode(heatmap_png({p}, "a caption under the picture", &size), &channels);
  ASSERT_FALSE(image.rgb.empty());
  EXPECT_EQ(image.width, size.width);
  EXPECT_EQ(image.height, size.height);
  EXPECT_EQ(channels, 3);
  EXPECT_GE(size.width, 200);
  EXPECT_GE(size.height, 150);

  // The grid's top left corner: the first pixel of the top colour.
  int top = 0, bottom = 0, gx = image.width, gy = image.height;
  for (int y = 0; y < image.height; ++y) {
    for (int x = 0; x < image.width; ++x) {
      if (image.at(x, y, kTop[0], kTop[1], kTop[2])) {
        ++top;
        gx = std::min(gx, x);
        gy = std::min(gy, y);
      }
      if (image.at(x, y, kBottom[0], kBottom[1], kBottom[2])) ++bottom;
    }
  }
  // 3 and 6 cells of at least 20 x 20 px (the colour bar adds a row or two).
  EXPECT_GE(top, 3 * 20 * 20);
  EXPECT_GE(bottom, 6 * 20 * 20);
  ASSERT_LT(gx, image.width);
  // The cell right of the top left one (value 0) has the bottom colour,
  // the one below right of it (value 1) the top colour.
  int cell = 0;
  while (image.at(gx + cell, gy, kTop[0], kTop[1], kTop[2])) ++cell;
  EXPECT_GE(cell, 20);
  EXPECT_TRUE(image.at(gx + cell + cell / 2, gy + cell / 2, kBottom[0], kBottom[1], kBottom[2]));
  EXPECT_TRUE(image.at(gx + cell + cell / 2, gy + cell + cell / 2, kTop[0], kTop[1], kTop[2]));
  // White corners.
  EXPECT_TRUE(image.at(0, 0, 255, 255, 255));
  EXPECT_TRUE(image.at(image.width - 1, image.height - 1, 255, 255, 255));
  // Dark text left of the grid (row labels), below it (column labels),
  // above it (the title) and at the bottom (the caption).
  const auto dark_in = [&](int x0, int y0, int x1, int y1) {
    int n = 0;
    for (int y = std::max(y0, 0); y < std::min(y1, image.height); ++y) {
      for (int x = std::max(x0, 0); x < std::min(x1, image.width); ++x) n += image.dark(x, y);
    }
    return n;
  };
  EXPECT_GT(dark_in(0, gy, gx - 2, gy + 3 * cell), 20);
  EXPECT_GT(dark_in(gx, gy + 3 * cell + 2, gx + 3 * cell, gy + 3 * cell + 60), 20);
  EXPECT_GT(dark_in(0, 0, image.width, gy - 2), 20);
  EXPECT_GT(dark_in(0, image.height - 40, image.width, image.height), 20);
}

TEST(HeatmapPng, PanelsInAGridOfUpToFourColumns) {
  ImageSize one, four, five;
  heatmap_png({panel(5, 7)}, "", &one);
  heatmap_png(std::vector<HeatmapPanel>(4, panel(5, 7)), "", &four);
  heatmap_png(std::vector<HeatmapPanel>(5, panel(5, 7)), "", &five);
  EXPECT_GT(four.width, 3 * one.width / 2);
  EXPECT_EQ(four.height, one.height);
  EXPECT_EQ(five.width, four.width);
  EXPECT_GT(five.height, four.height + 5 * 20);
}

TEST(HeatmapPng, ManyTokensGetSmallerCells) {
  HeatmapPanel p = panel(200, 300);
  for (int i = 0; i < 200; ++i) p.row_labels.push_back("query" + std::to_string(i));
  for (int i = 0; i < 300; ++i) p.col_labels.push_back("key " + std::to_string(i));
  ImageSize size;
  const Image image = decode(heatmap_png({p}, std::string(3000, 'x'), &size));
  ASSERT_FALSE(image.rgb.empty());
  EXPECT_EQ(image.width, size.width);
  EXPECT_EQ(image.height, size.height);
  EXPECT_LE(size.width, 1200);
  EXPECT_LE(size.height, 1200);
}

TEST(HeatmapPng, AllZeroValuesAndOddLabelsDraw) {
  HeatmapPanel p;
  p.rows = 1;
  p.cols = 2;
  p.values = {0, 0};
  p.col_labels = {"\xe2\x96\x81word", std::string(40, 'a')};  // UTF-8, long
  ImageSize size;
  EXPECT_FALSE(decode(heatmap_png({p}, "", &size)).rgb.empty());
}

TEST(HeatmapPng, BadInputIsAnError) {
  EXPECT_NE(error_of([] { heatmap_png({}, ""); }).find("panels: expected at least one panel"),
            std::string::npos);
  HeatmapPanel p = panel(2, 3);
  p.values.pop_back();
  EXPECT_NE(error_of([&] {
              heatmap_png({panel(2, 3), p}, "");
            }).find("panels[1].values: expected rows * cols = 2 * 3 = 6 values, got 5"),
            std::string::npos);
  p = panel(2, 3);
  p.row_labels = {"a", "b", "c"};
  EXPECT_NE(error_of([&] {
              heatmap_png({p}, "");
            }).find("panels[0].row_labels: expected rows = 2 labels (or none), got 3"),
            std::string::npos);
  p = panel(2, 3);
  p.col_labels = {"a"};
  EXPECT_NE(error_of([&] {
              heatmap_png({p}, "");
            }).find("panels[0].col_labels: expected cols = 3 labels (or none), got 1"),
            std::string::npos);
  p = panel(2, 3);
  p.values[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(error_of([&] {
              heatmap_png({p}, "");
            }).find("panels[0].values[4] (row 1, column 1): expected a finite value >= 0"),
            std::string::npos);
  p.values[4] = -0.5f;
  EXPECT_NE(error_of([&] { heatmap_png({p}, ""); }).find("got -0.5"), std::string::npos);
  p = panel(0, 3);
  EXPECT_NE(error_of([&] { heatmap_png({p}, ""); }).find("panels[0].rows: expected 1 to 8192"),
            std::string::npos);
  // One row of 8192 keys: 1 px cells, wider than the limit with the margins.
  EXPECT_NE(error_of([] {
              heatmap_png({panel(1, 8192)}, "");
            }).find("expected a picture at most 8192 px on each side"),
            std::string::npos);
  const fs::path nowhere = fs::temp_directory_path() / "qkv_viz_no_such_folder" / "map.png";
  EXPECT_NE(error_of([&] { write_heatmap_png(nowhere.string(), {panel(2, 2)}, ""); }), "");
  EXPECT_FALSE(fs::exists(nowhere));
}

TEST(HeatmapPng, WriteHeatmapPngWritesTheSameBytes) {
  const fs::path path = fs::temp_directory_path() / "qkv_viz_write_test.png";
  const std::vector<HeatmapPanel> panels = {panel(4, 4)};
  ImageSize size;
  const std::vector<std::uint8_t> png = heatmap_png(panels, "caption", &size);
  const ImageSize written = write_heatmap_png(path.string(), panels, "caption");
  EXPECT_EQ(written.width, size.width);
  EXPECT_EQ(written.height, size.height);
  EXPECT_EQ(read_bytes(path), png);
  fs::remove(path);
}

// Probabilities: each row of the last axis a softmax of random scores.
Tensor random_probs(std::initializer_list<std::int64_t> sizes, std::uint32_t seed) {
  Tensor t(DType::f32, sizes);
  const std::int64_t nk = *(sizes.end() - 1);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  float* p = t.data<float>();
  for (std::int64_t row = 0; row < t.numel() / nk; ++row) {
    float sum = 0.0f;
    for (std::int64_t k = 0; k < nk; ++k) sum += p[row * nk + k] = std::exp(2.0f * normal(rng));
    for (std::int64_t k = 0; k < nk; ++k) p[row * nk + k] /= sum;
  }
  return t;
}

class Viz : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::temp_directory_path() /
        ("qkv_viz_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write_lines(const std::string& name, int n, const std::string& stem) {
    std::ofstream out(path(name));
    for (int i = 0; i < n; ++i) out << stem << i << "\n";
  }

  // Runs `qkv viz ARGS` in the test's folder; returns the exit status, with
  // stdout in out_ and stderr in err_.
  int run(const std::string& args) {
    const std::string cmd = "cd '" + dir_.string() + "' && '" + qkv::test::kCli + "' viz " + args +
                            " 2>stderr.txt >stdout.txt";
    const int status = std::system(cmd.c_str());
    err_ = read_text(dir_ / "stderr.txt");
    out_ = read_text(dir_ / "stdout.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // The picture `name`, decoded; its size as printed on stdout checked.
  Image picture(const std::string& name) {
    const Image image = decode(read_bytes(dir_ / name));
    EXPECT_FALSE(image.rgb.empty()) << name;
    EXPECT_EQ(out_, name + ": " + std::to_string(image.width) + " x " +
                        std::to_string(image.height) + " px\n");
    return image;
  }

  // An error: exit status 2, one line on stderr naming `what`, `name` not
  // written.
  void expect_error(const std::string& args, const std::string& what,
                    const std::string& name = "map.png") {
    EXPECT_EQ(run(args), 2) << args;
    EXPECT_EQ(err_.rfind("qkv viz: error: ", 0), 0u) << err_;
    EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 1) << err_;
    EXPECT_NE(err_.find(what), std::string::npos) << err_;
    EXPECT_EQ(out_, "");
    EXPECT_FALSE(fs::exists(dir_ / name)) << args;
  }

  fs::path dir_;
  std::string err_, out_;
};

TEST_F(Viz, OneMapWithTokens) {
  save_npy(path("p.npy"), random_probs({5, 5}, 1));
  write_lines("tokens.txt", 5, "tok");
  ASSERT_EQ(run("p.npy --tokens tokens.txt -o map.png"), 0) << err_;
  EXPECT_EQ(err_, "");
  const Image image = picture("map.png");
  EXPECT_GE(image.width, 300);

  // The default labels (positions), a caption of one's own.
  ASSERT_EQ(run("p.npy -o map2.png --caption 'five queries'"), 0) << err_;
  picture("map2.png");
}

TEST_F(Viz, HeadsInAGridOrOne) {
  save_npy(path("p.npy"), random_probs({3, 6, 6}, 2));
  // No caption: it would widen the single head's picture.
  ASSERT_EQ(run("p.npy -o all.png --caption ''"), 0) << err_;
  const Image all = picture("all.png");
  ASSERT_EQ(run("p.npy -o one.png --head 2 --caption ''"), 0) << err_;
  const Image one = picture("one.png");
  EXPECT_GT(all.width, 2 * one.width);
}

TEST_F(Viz, BatchEntryAndHeadOfARank4Array) {
  Tensor probs = random_probs({2, 2, 4, 7}, 3);
  save_npy(path("p.npy"), probs);
  write_lines("keys.txt", 7, "key");
  write_lines("queries.txt", 4, "query");
  ASSERT_EQ(run("p.npy --tokens keys.txt --query-tokens queries.txt --head 1 --batch 1 -o b.png "
                "--caption ''"),
            0)
      << err_;
  const Image one = picture("b.png");
  ASSERT_EQ(run("p.npy --tokens keys.txt -o both.png --caption ''"), 0) << err_;
  const Image both = picture("both.png");
  EXPECT_GT(both.width, one.width);

  // f64 probabilities read the same.
  save_npy(path("p64.npy"), to_dtype(probs, DType::f64));
  ASSERT_EQ(run("p64.npy --head 0 -o c.png"), 0) << err_;
  picture("c.png");
}

TEST_F(Viz, ErrorsAreOneLineAndWriteNothing) {
  save_npy(path("p2.npy"), random_probs({4, 4}, 4));
  save_npy(path("p3.npy"), random_probs({2, 4, 4}, 5));
  save_npy(path("p1.npy"), random_probs({4}, 6));
  write_lines("three.txt", 3, "t");
  expect_error("missing.npy -o map.png", "missing.npy");
  expect_error("p1.npy -o map.png", "expected probabilities [Nq, Nk], [H, Nq, Nk] or");
  expect_error("p2.npy --tokens three.txt -o map.png",
               "--tokens: expected Nk = 4 tokens (one a line), got 3");
  expect_error("p2.npy --query-tokens three.txt -o map.png",
               "--query-tokens: expected Nq = 4 tokens (one a line), got 3");
  expect_error("p2.npy --tokens missing.txt -o map.png", "--tokens: cannot read 'missing.txt'");
  expect_error("p3.npy --head 2 -o map.png", "--head: expected 0 to 1 (H = 2");
  expect_error("p3.npy --head -1 -o map.png", "--head: expected 0 to 1");
  expect_error("p2.npy --head 0 -o map.png", "--head: expected a 3-D or 4-D array");
  expect_error("p3.npy --batch 1 -o map.png", "--batch: expected a 4-D array");
  Tensor nan = random_probs({2, 3, 4}, 7);
  nan.data<float>()[1 * 12 + 2 * 4 + 3] = std::numeric_limits<float>::quiet_NaN();
  save_npy(path("nan.npy"), nan);
  expect_error("nan.npy -o map.png",
               "'nan.npy': expected probabilities (finite, >= 0), got nan at [1, 2, 3]");
  expect_error("p3.npy -o p3.npy", "is also an input", "unused.png");
  expect_error("p3.npy -o no/such/folder/map.png", "cannot write into folder", "no");
  expect_error("p3.npy", "-o");  // CLI11: a required option

  // An existing picture is left as it was.
  std::ofstream(path("map.png")) << "old";
  EXPECT_EQ(run("p3.npy --head 7 -o map.png"), 2);
  EXPECT_EQ(read_text(dir_ / "map.png"), "old");
}

}  // namespace
}  // namespace qkv::tools
