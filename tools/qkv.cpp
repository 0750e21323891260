// The qkv command line tool.
#include <CLI/CLI.hpp>
#include <iostream>

#include "demo.hpp"
#include "qkv/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "qkv: attention mechanisms for CPUs (scaled-dot, additive, multi-head, masks, "
      "position biases).",
      "qkv"};
  app.require_subcommand(1);

  CLI::App* demo = app.add_subcommand(
      "demo",
      "Run built-in examples (self-attention over a short sentence with sinusoidal positions, "
      "cross-attention, causal, padded batch), print their checks and a heatmap of attention "
      "weights. Exits non-zero if a check fails.");
  bool color = false;
  demo->add_flag("--color", color, "Shade the heatmap with ANSI colours");

  CLI11_PARSE(app, argc, argv);
  try {
    if (demo->parsed()) return qkv::tools::run_demo(std::cout, {color}) ? 0 : 1;
  } catch (const qkv::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
