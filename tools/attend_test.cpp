// `qkv attend` end to end: the binary (qkv::test::kCli) on .npy files written here,
// its outputs read back and compared bit for bit with the library's own
// results for the same options; and its errors: one line, a non-zero exit,
// no output file created or changed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cli_path.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/npy.hpp"
#include "qkv/positional.hpp"

namespace qkv {
namespace {

namespace fs = std::filesystem;

Tensor random_tensor(std::initializer_list<std::int64_t> sizes, std::uint32_t seed) {
  Tensor t(DType::f32, sizes);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(rng);
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.rank() != b.rank()) return false;
  for (int d = 0; d < a.rank(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  const auto bytes = static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype());
  return std::memcmp(a.view().data(), b.view().data(), bytes) == 0;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class Attend : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("qkv_attend_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    q_ = random_tensor({2, 6, 4, 8}, 1);
    k_ = random_tensor({2, 9, 2, 8}, 2);
    v_ = random_tensor({2, 9, 2, 8}, 3);
    save_npy(path("q.npy"), q_);
    save_npy(path("k.npy"), k_);
    save_npy(path("v.npy"), v_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Runs `qkv attend q.npy k.npy v.npy ARGS` in the test's folder; returns
  // the exit status, with stderr in err_.
  int run(const std::string& args) {
    const std::string cmd = "cd '" + dir_.string() + "' && '" + qkv::test::kCli +
                            "' attend q.npy k.npy v.npy " + args + " 2>stderr.txt >stdout.txt";
    const int status = std::system(cmd.c_str());
    err_ = read_text(dir_ / "stderr.txt");
    out_ = read_text(dir_ / "stdout.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir_;
  Tensor q_, k_, v_;
  std::string err_, out_;
};

TEST_F(Attend, OutputsEqualTheLibrarysBitForBit) {
  const std::vector<std::int64_t> lengths = {9, 5};
  AttentionOptions o;
  o.causal = true;
  o.window_left = 3;
  o.window_right = 0;
  o.key_lengths = lengths;
  o.softcap = 20.0;
  o.return_lse = o.return_probs = true;
  const AttentionResult want = attention(q_, k_, v_, o);
  ASSERT_EQ(run("-o out.npy --causal --window 3,0 --key-lengths 9,5 --softcap 20 --lse lse.npy "
                "--probs p.npy"),
            0)
      << err_;
  EXPECT_TRUE(same_bits(load_npy(path("out.npy")), want.out));
  EXPECT_TRUE(same_bits(load_npy(path("lse.npy")), want.lse));
  EXPECT_TRUE(same_bits(load_npy(path("p.npy")), want.probs));
  EXPECT_NE(err_.find("qkv attend: q [2, 6, 4, 8]"), std::string::npos) << err_;
  EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 1) << err_;
  // The thread count, in the singular for one.
  ASSERT_EQ(run("-o out1.npy --threads 1"), 0) << err_;
  EXPECT_TRUE(err_.ends_with(" ms on 1 thread\n")) << err_;
  ASSERT_EQ(run("-o out2.npy --threads 2"), 0) << err_;
  EXPECT_TRUE(err_.ends_with(" ms on 2 threads\n")) << err_;

  // Key lengths from a text file, the same result.
  std::ofstream(path("lengths.txt")) << "9\n5\n";
  ASSERT_EQ(run("-o out2.npy --causal --window 3,0 --key-lengths lengths.txt --softcap 20"), 0)
      << err_;
  EXPECT_TRUE(same_bits(load_npy(path("out2.npy")), want.out));
}

TEST_F(Attend, MasksBiasesDropoutDtypeAndBackend) {
  Tensor mask(DType::boolean, {6, 9});
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = (i * 7) % 5 != 0;
  save_npy(path("mask.npy"), mask);
  const Tensor slopes = random_tensor({4}, 4);
  save_npy(path("slopes.npy"), slopes);
  AttentionOptions o;
  o.mask = mask;
  const std::vector<float> s(slopes.data<float>(), slopes.data<float>() + 4);
  o.alibi_slopes = s;
  o.dropout_p = 0.25;
  o.dropout_seed = 17;
  o.backend = Backend::reference;
  ASSERT_EQ(run("-o out.npy --mask mask.npy --alibi-slopes slopes.npy --dropout 0.25 --seed 17 "
                "--backend reference"),
            0)
      << err_;
  EXPECT_TRUE(same_bits(load_npy(path("out.npy")), attention(q_, k_, v_, o).out));

  AttentionOptions paper;
  const std::vector<float> alibi = alibi_slopes(4);
  paper.alibi_slopes = alibi;
  paper.score = Score::dot;
  const Tensor qb = to_dtype(q_, DType::bf16), kb = to_dtype(k_, DType::bf16),
               vb = to_dtype(v_, DType::bf16);
  ASSERT_EQ(run("-o out.npy --alibi --score dot --dtype bf16 --json"), 0) << err_;
  const Tensor got = load_npy(path("out.npy"));
  EXPECT_EQ(got.dtype(), DType::bf16);
  EXPECT_TRUE(same_bits(got, attention(qb, kb, vb, paper).out));
  EXPECT_NE(out_.find("\"options\":\"dot scores, ALiBi\""), std::string::npos) << out_;
  // Shapes are arrays of integers.
  EXPECT_EQ(out_.find("{\"q\":[2,6,4,8],\"k\":[2,9,2,8],\"v\":[2,9,2,8],\"layout\":\"bnhd\""), 0u)
      << out_;
  EXPECT_NE(out_.find("\"outputs\":[{\"path\":\"out.npy\",\"shape\":[2,6,4,8]}]"),
            std::string::npos)
      << out_;
}

TEST_F(Attend, PyTorchLayoutAndBackward) {
  // bhnd: the files hold [B, H, N, D]; results come back in that layout.
  const ConstTensorView qt(
      q_.view().data(), DType::f32, std::vector<std::int64_t>{2, 4, 6, 8},
      std::vector<std::int64_t>{q_.view().stride(0), q_.view().stride(2), q_.view().stride(1), 1});
  save_npy(path("qt.npy"), qt);
  const auto transposed = [](const Tensor& t) {
    return ConstTensorView(t.view().data(), t.dtype(),
                           std::vector<std::int64_t>{t.size(0), t.size(2), t.size(1), t.size(3)},
                           std::vector<std::int64_t>{t.view().stride(0), t.view().stride(2),
                                                     t.view().stride(1), t.view().stride(3)});
  };
  save_npy(path("kt.npy"), transposed(k_));
  save_npy(path("vt.npy"), transposed(v_));
  const Tensor dout = random_tensor({2, 6, 4, 8}, 5);
  save_npy(path("dout.npy"), dout);
  AttentionOptions o;
  o.causal = true;
  o.return_lse = true;
  const AttentionResult fwd = attention(q_, k_, v_, o);
  const AttentionGradients g = attention_backward(q_, k_, v_, fwd.out, dout, fwd.lse, o);

  ASSERT_EQ(run("-o out.npy --causal --backward dout.npy --dq dq.npy --dk dk.npy --dv dv.npy"), 0)
      << err_;
  EXPECT_TRUE(same_bits(load_npy(path("out.npy")), fwd.out));
  EXPECT_TRUE(same_bits(load_npy(path("dq.npy")), g.dq));
  EXPECT_TRUE(same_bits(load_npy(path("dk.npy")), g.dk));
  EXPECT_TRUE(same_bits(load_npy(path("dv.npy")), g.dv));

  const std::string cmd = "cd '" + dir_.string() + "' && '" + qkv::test::kCli +
                          "' attend qt.npy kt.npy vt.npy -o outt.npy --layout bhnd --causal "
                          "2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const Tensor outt = load_npy(path("outt.npy"));
  ASSERT_EQ(outt.size(1), 4);  // [B, H, N, D]
  Tensor back(DType::f32, {2, 6, 4, 8});
  copy(transposed(outt), back);
  EXPECT_TRUE(same_bits(back, fwd.out));
}

// The learned per-head parameters from files, forward and backward with
// their gradients, bit for bit the library's: sinks, and logit scales in
// Scalable-Softmax's ln n form.
TEST_F(Attend, LearnedParametersAndTheirGradients) {
  const std::vector<float> values = {0.5f, -1.25f, 2.0f, 0.25f};
  save_npy(path("values.npy"), ConstTensorView(values.data(), DType::f32, {4}));
  const Tensor dout = random_tensor({2, 6, 4, 8}, 7);
  save_npy(path("dout.npy"), dout);
  struct Case {
    std::string flags, described;
    std::function<void(AttentionOptions&)> set;
    Tensor AttentionGradients::*gradient;
  };
  const Case cases[] = {
      {"--sinks values.npy --d-sinks dp.npy", "sinks [4]",
       [&](AttentionOptions& o) { o.sinks = values; }, &AttentionGradients::d_sinks},
      {"--score-scale values.npy --score-scale-log-n --d-score-scale dp.npy", "score_scale [4]",
       [&](AttentionOptions& o) {
         o.score_scale = values;
         o.score_scale_log_n = true;
       },
       &AttentionGradients::d_score_scale},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    AttentionOptions o;
    o.causal = true;
    o.return_lse = true;
    c.set(o);
    const AttentionResult fwd = attention(q_, k_, v_, o);
    const AttentionGradients g = attention_backward(q_, k_, v_, fwd.out, dout, fwd.lse, o);
    ASSERT_EQ(run("-o out.npy --causal --lse lse.npy --backward dout.npy --dq dq.npy " + c.flags),
              0)
        << err_;
    EXPECT_NE(err_.find(c.described), std::string::npos) << err_;
    EXPECT_TRUE(same_bits(load_npy(path("out.npy")), fwd.out));
    EXPECT_TRUE(same_bits(load_npy(path("lse.npy")), fwd.lse));
    EXPECT_TRUE(same_bits(load_npy(path("dq.npy")), g.dq));
    EXPECT_TRUE(same_bits(load_npy(path("dp.npy")), g.*c.gradient));
  }
}

// A float mask's gradient, broadcast over the batch and heads, bit for bit
// the library's.
TEST_F(Attend, FloatMaskGradient) {
  const Tensor mask = random_tensor({6, 9}, 8);
  save_npy(path("mask.npy"), mask);
  const Tensor dout = random_tensor({2, 6, 4, 8}, 9);
  save_npy(path("dout.npy"), dout);
  AttentionOptions o;
  o.mask = mask;
  o.return_lse = true;
  const AttentionResult fwd = attention(q_, k_, v_, o);
  o.mask_requires_grad = true;
  const AttentionGradients g = attention_backward(q_, k_, v_, fwd.out, dout, fwd.lse, o);
  ASSERT_EQ(run("-o out.npy --mask mask.npy --backward dout.npy --dq dq.npy --d-mask dm.npy"), 0)
      << err_;
  EXPECT_TRUE(same_bits(load_npy(path("dq.npy")), g.dq));
  const Tensor d_mask = load_npy(path("dm.npy"));
  ASSERT_EQ(d_mask.rank(), 2);
  EXPECT_TRUE(same_bits(d_mask, g.d_mask));
}

// NaN and infinities in the inputs are computed as docs/semantics.md
// defines them, and one line on stderr names each input that holds any; a
// float mask's -inf drops a key, as meant, and is not noted.
TEST_F(Attend, NonFiniteInputsAreComputedAndNoted) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  Tensor q = q_, v = v_;
  q.set({0, 1, 0, 2}, nan);
  q.set({1, 4, 3, 0}, nan);
  q.set({1, 0, 2, 7}, -inf);
  v.set({0, 3, 1, 5}, nan);
  save_npy(path("q.npy"), q);
  save_npy(path("v.npy"), v);
  Tensor mask(DType::f32, {6, 9});
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask.data<float>()[i] = i % 4 == 0 ? -inf : 0.5f;
  save_npy(path("mask.npy"), mask);
  AttentionOptions o;
  o.mask = mask;
  o.return_lse = true;
  const AttentionResult want = attention(q, k_, v, o);
  ASSERT_EQ(run("-o out.npy --lse lse.npy --mask mask.npy"), 0) << err_;
  EXPECT_TRUE(same_bits(load_npy(path("out.npy")), want.out));
  EXPECT_TRUE(same_bits(load_npy(path("lse.npy")), want.lse));
  EXPECT_EQ(err_.substr(0, err_.find('\n')),
            "qkv attend: note: q (q.npy) holds 2 NaN and 1 inf values, v (v.npy) holds 1 NaN "
            "value; see docs/semantics.md, \"Fully masked rows, NaN and infinities\"");
  EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 2) << err_;  // the note and the summary

  // A NaN and a +inf in the mask, with --json (the note stays on stderr).
  mask.data<float>()[1] = static_cast<float>(nan);
  mask.data<float>()[2] = static_cast<float>(inf);
  save_npy(path("mask.npy"), mask);
  save_npy(path("q.npy"), q_);
  save_npy(path("v.npy"), v_);
  ASSERT_EQ(run("-o out.npy --mask mask.npy --json"), 0) << err_;
  EXPECT_EQ(err_,
            "qkv attend: note: mask (mask.npy) holds 1 NaN and 1 +inf values; see "
            "docs/semantics.md, \"Fully masked rows, NaN and infinities\"\n");
  EXPECT_EQ(out_.front(), '{') << out_;
}

TEST_F(Attend, ErrorsAreOneLineAndLeaveNoFile) {
  std::ofstream(path("existing.npy")) << "old contents";
  const std::vector<float> two = {0.0f, 1.0f};
  save_npy(path("two.npy"), ConstTensorView(two.data(), DType::f32, {2}));
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"-o out.npy --window 3", "--window: expected L,R"},
      {"-o out.npy --window 3,x", "--window: expected an integer, got 'x'"},
      {"-o out.npy --key-lengths 9,5,1",
       "--key-lengths: expected one length per sequence (2), got 3"},
      {"-o out.npy --key-lengths missing.txt", "--key-lengths: cannot read 'missing.txt'"},
      {"-o out.npy --mask missing.npy", "missing.npy: cannot open the file for reading"},
      {"-o out.npy --score additive", "--score: expected scaled or dot"},
      {"-o out.npy --align middle", "--align: expected bottom-right or top-left"},
      {"-o out.npy --layout nhd", "--layout: expected bnhd or bhnd"},
      {"-o out.npy --dtype f8", "--dtype: expected f32, bf16, f16 or f64"},
      {"-o out.npy --backend gpu", "--backend: expected automatic, fast or reference"},
      // The library's reasons about options name the flag that set them.
      {"-o out.npy --dropout 1.5",
       "qkv attend: error: --dropout: expected a probability in [0, 1), got 1.5"},
      {"-o out.npy --window -2,0", "--window L: expected -1 (unbounded) or a size >= 0, got -2"},
      {"-o out.npy --softcap -1", "--softcap: expected 0 (off) or a value in [2^-126, 2^126]"},
      {"-o out.npy --softcap x", "--softcap"},
      {"-o out.npy --alibi --alibi-slopes q.npy", "expected one of them, got both"},
      {"-o out.npy --dq dq.npy", "expected --backward DOUT with them"},
      {"-o out.npy --backward k.npy --d-sinks dq.npy", "--d-sinks: expected --sinks FILE"},
      {"-o out.npy --sinks two.npy", "--sinks: expected Hq = 4 logits, got 2"},
      {"-o out.npy --d-score-scale dss.npy", "--d-score-scale: expected --backward DOUT"},
      {"-o out.npy --backward k.npy --d-score-scale dq.npy",
       "--d-score-scale: expected --score-scale FILE"},
      {"-o out.npy --score-scale two.npy", "--score-scale: expected Hq = 4 scales, got 2"},
      {"-o out.npy --d-mask dm.npy", "--d-mask: expected --backward DOUT"},
      {"-o out.npy --backward k.npy --d-mask dq.npy", "--d-mask: expected --mask FILE"},
      {"-o out.npy --score-scale-log-n", "--score-scale-log-n: scales score_scale, which is empty"},
      {"-o out.npy --lse out.npy", "is also another output"},
      {"-o q.npy", "is also an input"},
      {"-o nowhere/out.npy", "cannot write into folder 'nowhere/'"},
      {"-o existing.npy --key-lengths 99,1", "--key-lengths[0]: expected a length in [0, 9]"},
      {"-o existing.npy --backward k.npy --dq dq.npy", "dout"},
      {"--causal", "--out is required"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    EXPECT_EQ(run(c.args), 2);
    EXPECT_NE(err_.find(c.message), std::string::npos) << err_;
    EXPECT_EQ(std::count(err_.begin(), err_.end(), '\n'), 1) << err_;
    EXPECT_FALSE(fs::exists(dir_ / "out.npy"));
    EXPECT_FALSE(fs::exists(dir_ / "dq.npy"));
    EXPECT_EQ(read_text(dir_ / "existing.npy"), "old contents");
  }
  // A shape mismatch between files.
  save_npy(path("k.npy"), random_tensor({2, 9, 2, 4}, 6));
  EXPECT_EQ(run("-o out.npy"), 2);
  EXPECT_NE(err_.find("qkv attend: error: "), std::string::npos) << err_;
  EXPECT_FALSE(fs::exists(dir_ / "out.npy"));
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 7u);  // q, k, v, two, existing, stderr.txt, stdout.txt: nothing else
}

}  // namespace
}  // namespace qkv
