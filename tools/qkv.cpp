// The qkv command line tool.
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <limits>
#include <string>
#include <utility>

#include "attend.hpp"
#include "bench.hpp"
#include "demo.hpp"
#include "info.hpp"
#include "qkv/error.hpp"
#include "viz.hpp"

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
      "Then trains three small transformers with the library's backward passes\n"
      "(reversing 8-12 digits with self-attention, rotating them with 2 heads,\n"
      "reversing them with an additive-attention decoder; seconds each) and\n"
      "checks their held-out accuracy and learned attention maps, which it draws\n"
      "as PNG heatmaps and saves as .npy in --out. Prints each check and a\n"
      "heatmap of the attention weights; exits 1 if a check fails.");
  qkv::tools::DemoOptions demo_options;
  demo->add_flag("--color", demo_options.color, "Shade the heatmap with ANSI colours");
  demo->add_option("--out", demo_options.out, "Folder for the pictures and .npy files")
      ->capture_default_str();
  demo->add_option("--steps", demo_options.steps,
                   "Training step budget per task (default 2000;\n"
                   "training stops early at 99.8% held-out accuracy)")
      ->check(CLI::PositiveNumber);
  demo->add_option("--seed", demo_options.seed, "Training seed (data and initial weights)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  demo->add_option("--threads", demo_options.threads,
                   "OpenMP threads while training (results are\n"
                   "bitwise reproducible per seed and thread count)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1024}))
      ->capture_default_str();
  bool no_train = false;
  demo->add_flag("--no-train", no_train, "Only the fixed examples (no training, no files)");

  CLI::App* bench =
      app.add_subcommand("bench", "Time attention against the FMA peak and bandwidth");
  bench->footer(
      "Times the fused kernels (impl qkv) and materialized sgemm + softmax\n"
      "baselines (impl naive) on each case: one warm-up run, then the median of\n"
      "--repeats runs. Suite backward times the gradients alone (the forward's\n"
      "out and lse are computed beforehand). GFLOP/s count 4 flops per unmasked\n"
      "(query, key) pair and head dimension forward, 10 backward; the FMA peak\n"
      "is probed in the same run with the same threads. Extra MB is the peak\n"
      "resident memory growth during a case, beyond its inputs and outputs.\n"
      "Suite decode times one new query per sequence (n1; n4: four) against a\n"
      "filled KV cache\n"
      "(no baseline): GB/s of cached keys and values read, against a read\n"
      "bandwidth probe (all threads streaming a buffer far larger than the\n"
      "L3 cache) of the same run, for the median and the fastest run (best %),\n"
      "and tokens/s. The first line also gives what the probe's buffer reads as\n"
      "f16 values widened with 4 FMAs per value, a decode step's arithmetic.\n"
      "Suite scaling times N = 1024 .. 65536 (H = 8, D = 64, f32) for dense\n"
      "causal attention, a causal window of 512, a dilated window, a BigBird\n"
      "layout and causal linear attention, and prints each curve's log-log\n"
      "slope over N >= 4096 (not part of suite all: dense causal at N = 65536\n"
      "alone takes about a minute).\n"
      "Suite modules times qkv::nn layers at model shapes: a BERT-base\n"
      "self-attention block forward and backward, a grouped-query decoder\n"
      "step against a 4096-token cache, and SE and CBAM on 64 x 56 x 56.\n"
      "Suite ring (run it under mpiexec; builds with MPI) times ring and\n"
      "all-to-all attention (causal, N = 16384 and 65536, H = 8, D = 64)\n"
      "against one process with all ranks' threads, with compute, waiting\n"
      "and bytes sent per rank, and a link bandwidth probe.\n"
      "Progress goes to stderr; results to stdout. Exits 1 if no case matches,\n"
      "3 if --check fails.");
  qkv::tools::BenchOptions bench_options;
  const CLI::Range positive(1, std::numeric_limits<int>::max());
  bench_options.threads = omp_get_max_threads();
  bench->add_option("--suite", bench_options.suite, "Benchmark suite")
      ->check(CLI::IsMember({"forward", "backward", "decode", "all", "scaling", "modules", "ring"}))
      ->capture_default_str();
  bench->add_option("--filter", bench_options.filter,
                    "Run only the cases whose name matches this\n"
                    "regular expression (std::regex_search)");
  bench->add_flag("--json", bench_options.json,
                  "Print one JSON object per line (the first: the\n"
                  "probes) instead of a table");
  bench->add_option("--threads", bench_options.threads, "OpenMP threads (default: all cores)")
      ->check(positive)
      ->capture_default_str();
  bench->add_option("--repeats", bench_options.repeats, "Timed runs per case")
      ->check(positive)
      ->capture_default_str();
  bench->add_flag("--list", bench_options.list, "Print the names of the selected cases and exit");
  bench->add_flag("--check", bench_options.check,
                  "Also compare the baseline's outputs with qkv's\n"
                  "(max |naive - qkv| / max |qkv|, on stderr)");
  bench
      ->add_option("--shrink", bench_options.shrink,
                   "Divide sequence and cache lengths by this, for\n"
                   "quick runs (case names show the sizes run)")
      ->check(positive)
      ->capture_default_str();

  CLI::App* attend = app.add_subcommand("attend", "Attention on .npy files");
  attend->footer(
      "Reads q, k and v (.npy, rank 4: [B, N, H, D], or [B, H, N, D] with\n"
      "--layout bhnd; Hq a multiple of Hkv), computes qkv::attention with the\n"
      "options given and writes the output (.npy, q's layout and dtype).\n"
      "With --backward DOUT it also computes the gradients (--dq/--dk/--dv).\n"
      "Every input and option is checked before anything is written; outputs\n"
      "are written whole or not at all. A summary line goes to stderr (--json:\n"
      "a JSON object on stdout). Errors: one line on stderr, exit status 2.");
  qkv::tools::AttendOptions attend_options;
  attend->add_option("q", attend_options.q, "Queries (.npy)")->required();
  attend->add_option("k", attend_options.k, "Keys (.npy)")->required();
  attend->add_option("v", attend_options.v, "Values (.npy)")->required();
  attend->add_option("-o,--out", attend_options.out, "Output file (.npy)")->required();
  attend
      ->add_option("--layout", attend_options.layout, "bnhd ([B, N, H, D]) or bhnd ([B, H, N, D])")
      ->capture_default_str();
  attend->add_option("--scale", attend_options.scale, "Score scale (default 1/sqrt(D))");
  attend->add_option("--score", attend_options.score, "scaled or dot")->capture_default_str();
  attend->add_flag("--causal", attend_options.causal, "Drop keys after each query's position");
  attend->add_option("--align", attend_options.align, "bottom-right or top-left")
      ->capture_default_str();
  attend->add_option("--window", attend_options.window,
                     "L,R: keys at most L before and R after the\n"
                     "query's position (-1: unbounded)");
  attend->add_option("--key-lengths", attend_options.key_lengths,
                     "Valid keys per sequence: N,N,... or a text file");
  attend->add_option("--mask", attend_options.mask,
                     "Bool (true = attend) or float (added) mask\n"
                     "(.npy, broadcast to [B, Hq, Nq, Nk])");
  attend->add_flag("--alibi", attend_options.alibi, "ALiBi with the paper's slopes");
  attend->add_option("--alibi-slopes", attend_options.alibi_slopes,
                     "ALiBi slopes [Hq] or [B, Hq] (.npy)");
  const qkv::tools::LearnedFlags learned = qkv::tools::learned_flags();
  for (const qkv::tools::LearnedFlag& f : learned.inputs) {
    attend->add_option(f.flag, attend_options.learned[f.name], f.help);
  }
  for (const qkv::tools::LearnedFlag& f : learned.switches) {
    attend->add_flag(f.flag, attend_options.switches[f.name], f.help);
  }
  attend->add_option("--softcap", attend_options.softcap, "c > 0: scores become c tanh(s / c)");
  attend->add_option("--dropout", attend_options.dropout, "Dropout probability (< 1)");
  attend->add_option("--seed", attend_options.seed, "Dropout seed");
  attend->add_option("--dtype", attend_options.dtype,
                     "Compute dtype: f32, bf16, f16 or f64\n"
                     "(default: q's; inputs are converted)");
  attend->add_option("--backend", attend_options.backend, "automatic, fast or reference")
      ->capture_default_str();
  attend->add_option("--threads", attend_options.threads, "OpenMP threads (default: all cores)");
  attend->add_option("--lse", attend_options.lse, "Also write the logsumexp [B, Hq, Nq]");
  attend->add_option("--probs", attend_options.probs,
                     "Also write the probabilities [B, Hq, Nq, Nk]");
  attend->add_option("--backward", attend_options.dout,
                     "dLoss/dout (.npy, like the output): compute\n"
                     "the gradients too");
  attend->add_option("--dq", attend_options.dq, "Write dLoss/dq (with --backward)");
  attend->add_option("--dk", attend_options.dk, "Write dLoss/dk (with --backward)");
  attend->add_option("--dv", attend_options.dv, "Write dLoss/dv (with --backward)");
  for (const qkv::tools::LearnedFlag& f : learned.gradients) {
    attend->add_option(f.flag, attend_options.learned_gradients[f.name], f.help);
  }
  attend->add_option("--d-mask", attend_options.d_mask,
                     "Write dLoss/dmask, shaped like the mask (with\n"
                     "--backward and a float --mask)");
  attend->add_flag("--json", attend_options.json, "A JSON summary on stdout");

  CLI::App* info =
      app.add_subcommand("info", "What this CPU can run: instruction families, probes");
  info->footer(
      "Lists the instruction families of products beyond the f32 FMA\n"
      "(avx512_vnni, avx512_bf16, amx_int8, amx_bf16): whether the CPU lists\n"
      "them, whether the OS enabled them for this process (XCR0; AMX's\n"
      "permission from Linux) and QKV_ISA allows them, with each one's register\n"
      "probe beside the f32 FMA's, and the engine the kernels chose for bf16\n"
      "products.");
  qkv::tools::InfoOptions info_options;
  info->add_flag("--json", info_options.json, "One JSON object instead of the table");
  bool no_probe = false;
  info->add_flag("--no-probe", no_probe, "Skip the register probes");

  CLI::App* viz = app.add_subcommand("viz", "Draw attention probabilities (.npy) as a PNG");
  viz->footer(
      "Reads probabilities (.npy: [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk],\n"
      "e.g. from `qkv attend --probs`) and draws each head's map as a heatmap\n"
      "(rows = queries, columns = keys; heads in a grid) with token labels, a\n"
      "colour bar and a caption. Prints the picture's path and size. Errors:\n"
      "one line on stderr, exit status 2, no file written.");
  qkv::tools::VizOptions viz_options;
  viz->add_option("probs", viz_options.probs, "Probabilities (.npy)")->required();
  viz->add_option("-o,--out", viz_options.out, "Output picture (.png)")->required();
  viz->add_option("--tokens", viz_options.tokens,
                  "Key tokens, one a line (also the query tokens\n"
                  "when Nq == Nk); default: positions");
  viz->add_option("--query-tokens", viz_options.query_tokens, "Query tokens, one a line");
  viz->add_option("--head", viz_options.head, "Draw this head only (default: all)");
  viz->add_option("--batch", viz_options.batch, "Batch entry of a [B, H, Nq, Nk] array")
      ->capture_default_str();
  viz->add_option("--caption", viz_options.caption,
                  "Text under the picture (default: what it shows)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, naming the subcommand when there is one, or the word that
    // was given in its place.
    std::string commands;
    bool known = false;
    for (const CLI::App* sub : std::as_const(app).get_subcommands({})) {
      commands += (commands.empty() ? "" : ", ") + sub->get_name();
      known = known || (argc > 1 && sub->get_name() == argv[1]);
    }
    if (argc > 1 && argv[1][0] != '-' && !known) {
      std::cerr << "qkv: error: unknown command '" << argv[1] << "'; expected one of: " << commands
                << "\n";
      return 2;
    }
    std::string where = "qkv";
    for (const CLI::App* sub : app.get_subcommands()) where += " " + sub->get_name();
    std::cerr << where << ": error: " << e.what() << "\n";
    return 2;
  }
  try {
    if (attend->parsed()) return qkv::tools::run_attend(attend_options, std::cout, std::cerr);
    if (viz->parsed()) return qkv::tools::run_viz(viz_options, std::cout, std::cerr);
    if (info->parsed()) {
      info_options.probe = !no_probe;
      return qkv::tools::run_info(std::cout, info_options);
    }
    if (demo->parsed()) {
      demo_options.train = !no_train;
      demo_options.live = isatty(STDOUT_FILENO) == 1;
      return qkv::tools::run_demo(std::cout, demo_options) ? 0 : 1;
    }
    if (bench->parsed()) {
      // On a terminal one progress line is rewritten in place; in a log, each
      // measurement gets its own line.
      bench_options.live_progress = isatty(STDERR_FILENO) == 1;
      return qkv::tools::run_bench(std::cout, std::cerr, bench_options);
    }
  } catch (const qkv::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
