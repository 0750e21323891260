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
  EXPECT_EQ(err,
            "qkv: error: unknown command 'bogus'; expected one of: demo, bench, attend, viz\n");
  EXPECT_EQ(run_qkv("bogus attend q.npy", err), 2);
  EXPECT_EQ(err.find("qkv: error: unknown command 'bogus'"), 0u) << err;
  // A known command's own errors name it.
  EXPECT_EQ(run_qkv("attend", err), 2);
  EXPECT_EQ(err, "qkv attend: error: q is required\n");
}

}  // namespace
