// The qkv command itself (qkv::test::kCli), before any subcommand runs: its errors
// are one line on stderr and exit status 2.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "cli_path.hpp"

namespace {

namespace fs = std::filesystem;

// Runs `qkv ARGS`; returns the exit status, with stderr in `err`.
int run_qkv(const std::string& args, std::string& err) {
  const fs::path file = fs::temp_directory_path() / "qkv_cli_test_stderr.txt";
  const std::string cmd =
      std::string("'").append(qkv::test::kCli) + "' " + args + " 2>'" + file.string() + "'";
  const int status = std::system(cmd.c_str());
  std::ifstream in(file);
  err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  fs::remove(file);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(Cli, AnUnknownCommandIsNamed) {
  std::string err;
  EXPECT_EQ(run_qkv("bogus", err), 2);
  EXPECT_EQ(
      err,
      "qkv: error: unknown command 'bogus'; expected one of: demo, bench, attend, info, viz\n");
  EXPECT_EQ(run_qkv("bogus attend q.npy", err), 2);
  EXPECT_EQ(err.find("qkv: error: unknown command 'bogus'"), 0u) << err;
  // A known command's own errors name it.
  EXPECT_EQ(run_qkv("attend", err), 2);
  EXPECT_EQ(err, "qkv attend: error: q is required\n");
}

// `qkv info` lists every family and the engine chosen; a QKV_ISA it does not
// know is one line naming the variable.
TEST(Cli, InfoListsTheFamilies) {
  const fs::path file = fs::temp_directory_path() / "qkv_cli_test_info.txt";
  const std::string cmd =
      std::string("'").append(qkv::test::kCli) + "' info --no-probe >'" + file.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(file);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(file);
  for (const char* name : {"avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "bf16 products"}) {
    EXPECT_NE(out.find(name), std::string::npos) << name << " in:\n" << out;
  }
  std::string err;
  EXPECT_EQ(run_qkv("info --json --no-probe", err), 0);
  EXPECT_EQ(err, "");
  EXPECT_EQ(run_qkv("info --no-probe", err), 0);
  ASSERT_EQ(setenv("QKV_ISA", "avx9000", 1), 0);
  EXPECT_EQ(run_qkv("info --no-probe", err), 2);
  ASSERT_EQ(unsetenv("QKV_ISA"), 0);
  EXPECT_EQ(err,
            "qkv: QKV_ISA: expected 'f32', 'avx512_vnni', 'avx512_bf16' or 'amx' (or unset), got "
            "'avx9000'\n");
  ASSERT_EQ(setenv("QKV_EMULATE_ENGINES", "sse", 1), 0);
  EXPECT_EQ(run_qkv("info --no-probe", err), 2);
  ASSERT_EQ(unsetenv("QKV_EMULATE_ENGINES"), 0);
  EXPECT_EQ(err,
            "qkv: QKV_EMULATE_ENGINES: expected 'avx512_bf16' or 'amx' (or unset), got 'sse'\n");
}

}  // namespace
