// `qkv demo`'s training (train.hpp) called directly: the accuracy and the
// learned attention patterns within a reduced step budget, bitwise
// reproducibility; and the binary (qkv::test::kCli) end to end: its summary line,
// the pictures and .npy files it writes, its errors for bad flags.
#include <gtest/gtest.h>
#include <stb_image.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cli_path.hpp"
#include "qkv/npy.hpp"
#include "train.hpp"

namespace qkv::tools {
namespace {

namespace fs = std::filesystem;

constexpr std::int64_t kTestSteps = 1000;  // budget; the tasks stop early, at a few hundred

TrainResult train(TaskKind kind, std::uint64_t seed = 1, std::int64_t steps = kTestSteps) {
  TrainOptions o;
  o.steps = steps;
  o.seed = seed;
  o.threads = 1;
  return train_task(kind, o);
}

double best_head_mass(const TrainResult& r) {
  return *std::max_element(r.head_mass.begin(), r.head_mass.end());
}

TEST(DemoTraining, ReversalLearnsTheAntiDiagonal) {
  const TrainResult r = train(TaskKind::reverse);
  EXPECT_GE(r.accuracy, 0.99);
  EXPECT_GE(r.pattern_mass, 0.9);
  ASSERT_EQ(r.example_maps.size(), static_cast<std::size_t>(kWindow * kWindow));
  // The held-out example's map: each digit row's largest weight on 11 - i.
  for (std::int64_t i = 0; i < kWindow; ++i) {
    if (r.row_labels[i] == "_") continue;
    const float* row = &r.example_maps[i * kWindow];
    EXPECT_EQ(std::max_element(row, row + kWindow) - row, kWindow - 1 - i) << "row " << i;
  }
}

TEST(DemoTraining, RotationWithTwoHeads) {
  const TrainResult r = train(TaskKind::rotate);
  EXPECT_EQ(r.heads, 2);
  EXPECT_GE(r.accuracy, 0.99);
  EXPECT_GE(best_head_mass(r), 0.9);
}

TEST(DemoTraining, AdditiveDecoderLearnsTheAntiDiagonal) {
  const TrainResult r = train(TaskKind::reverse_additive);
  EXPECT_GE(r.accuracy, 0.99);
  EXPECT_GE(r.pattern_mass, 0.9);
}

TEST(DemoTraining, BitwiseReproducible) {
  // A fixed budget below the first evaluation's early stop.
  const TrainResult a = train(TaskKind::reverse, 7, 60);
  const TrainResult b = train(TaskKind::reverse, 7, 60);
  ASSERT_EQ(a.losses.size(), 60u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.parameter_hash, b.parameter_hash);
  EXPECT_EQ(a.example_maps, b.example_maps);
  const TrainResult c = train(TaskKind::reverse, 8, 60);
  EXPECT_NE(a.parameter_hash, c.parameter_hash);
  const TrainResult d = train(TaskKind::reverse_additive, 7, 60);
  const TrainResult e = train(TaskKind::reverse_additive, 7, 60);
  EXPECT_EQ(d.losses, e.losses);
  EXPECT_EQ(d.parameter_hash, e.parameter_hash);
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class DemoCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("qkv_demo_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `qkv demo ARGS` in the test's folder; returns the exit status.
  int run(const std::string& args) {
    const std::string cmd = "cd '" + dir_.string() + "' && '" + qkv::test::kCli + "' demo " + args +
                            " 2>stderr.txt >stdout.txt";
    const int status = std::system(cmd.c_str());
    err_ = read_text(dir_ / "stderr.txt");
    out_ = read_text(dir_ / "stdout.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir_;
  std::string err_, out_;
};

TEST_F(DemoCli, TrainsAndWritesPictures) {
  ASSERT_EQ(run("--out pics --steps " + std::to_string(kTestSteps)), 0) << out_ << err_;
  EXPECT_NE(out_.find("0 failed\n"), std::string::npos) << out_;
  EXPECT_NE(out_.find("held-out sequence accuracy"), std::string::npos);
  // Not a terminal: plain progress lines, no carriage returns.
  EXPECT_EQ(out_.find('\r'), std::string::npos);
  struct Picture {
    const char* name;
    int panels;
  };
  int single_width = 0;
  for (const Picture p : {Picture{"reversal", 1}, Picture{"rotation", 2},
                          Picture{"reversal_additive", 1}, Picture{"reversal_compare", 2}}) {
    const fs::path png = dir_ / "pics" / (std::string(p.name) + ".png");
    EXPECT_NE(out_.find(png.filename().string()), std::string::npos) << p.name;
    int width = 0, height = 0, channels = 0;
    ASSERT_EQ(stbi_info(png.c_str(), &width, &height, &channels), 1) << png;
    EXPECT_EQ(channels, 3) << p.name;
    // 12 x 12 cells of 28 px a panel, plus labels, colour bar and caption;
    // one panel's picture at least as wide as its caption's lines.
    EXPECT_GE(width, p.panels * 12 * 28) << p.name;
    EXPECT_GE(height, 12 * 28) << p.name;
    if (p.panels == 1 && single_width == 0) single_width = width;
    if (p.panels == 2) {
      EXPECT_GT(width, single_width) << p.name;
    }
  }
  const Tensor reversal = load_npy((dir_ / "pics" / "reversal.npy").string());
  ASSERT_EQ(reversal.rank(), 3);
  EXPECT_EQ(reversal.size(0), 1);
  EXPECT_EQ(reversal.size(1), kWindow);
  EXPECT_EQ(reversal.size(2), kWindow);
  EXPECT_EQ(load_npy((dir_ / "pics" / "rotation_mean.npy").string()).size(0), 2);
  EXPECT_TRUE(fs::exists(dir_ / "pics" / "reversal_keys.txt"));
}

TEST_F(DemoCli, NoTrainSkipsTraining) {
  ASSERT_EQ(run("--no-train"), 0) << out_ << err_;
  EXPECT_NE(out_.find("checks passed, 0 failed"), std::string::npos);
  EXPECT_EQ(out_.find("Training"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "qkv-demo"));
}

TEST_F(DemoCli, UnwritableOutFailsBeforeTraining) {
  std::ofstream(dir_ / "file") << "not a folder";
  EXPECT_EQ(run("--out file/pics"), 2);
  EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 1) << err_;
  EXPECT_NE(err_.find("file/pics"), std::string::npos) << err_;
  EXPECT_EQ(out_.find("steps in"), std::string::npos);
}

TEST_F(DemoCli, BadFlagsGiveOneLineAndStatus2) {
  for (const char* args : {"--steps 0", "--steps x", "--threads 0", "--seed -1", "--bogus"}) {
    EXPECT_EQ(run(args), 2) << args;
    EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 1) << args << ": " << err_;
    EXPECT_EQ(err_.rfind("qkv demo: error:", 0), 0u) << args << ": " << err_;
  }
}

}  // namespace
}  // namespace qkv::tools
