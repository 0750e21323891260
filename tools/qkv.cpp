// The qkv command line tool.
#include <CLI/CLI.hpp>
#include <iostream>

#include "demo.hpp"
#include "qkv/error.hpp"

int main(int argc, char** argv) {
  // CLI11 does not wrap help text: lines are broken by hand to fit 80 columns.
  CLI::App app{
      "qkv: attention mechanisms for CPUs\n"
      "(scaled-dot, additive, multi-head, masks, position biases).",
      "qkv"};
  app.require_subcommand(1);

  CLI::App* demo = app.add_subcommand("demo", "Run built-in examples and check their results");
  demo->footer(
      "Self-attention over a short sentence with sinusoidal positions,\n"
      "cross-attention, causal attention and a padded batch, on built-in data.\n"
      "Prints each example's checks and a heatmap of its attention weights;\n"
      "exits 1 if a check fails.");
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
