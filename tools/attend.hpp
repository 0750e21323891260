// `qkv attend`: attention on .npy files from the shell.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace qkv::tools {

// The command line as given (the values are checked by run_attend). Paths
// are .npy files unless said otherwise.
struct AttendOptions {
  std::string q, k, v;                 // inputs, rank 4, in `layout`
  std::string out;                     // -o: the output [B, Nq, Hq, Dv] (in `layout`)
  std::string layout = "bnhd";         // bnhd ([B, N, H, D], qkv's) or bhnd (PyTorch's)
  std::optional<double> scale;         // default 1/sqrt(D)
  std::string score = "scaled";        // scaled | dot
  bool causal = false;                 // drop keys after the query's position
  std::string align = "bottom-right";  // bottom-right | top-left
  std::string window;                  // "L,R" (-1: unbounded side); empty = none
  std::string key_lengths;             // "N,N,..." or a text file of integers; empty = none
  std::string mask;                    // bool (true = attend) or float (added) .npy
  bool alibi = false;                  // ALiBi with the paper's slopes
  std::string alibi_slopes;            // [Hq] or [B, Hq] .npy
  // The learned per-head parameters (learned_flags())
  // by option name: the [Hq] .npy that --NAME reads, and where --d-NAME
  // writes its gradient (with --backward); absent or empty = not given.
  std::map<std::string, std::string> learned, learned_gradients;
  std::map<std::string, bool> switches;  // their switches by option name
  double softcap = 0.0;                  // c > 0: c tanh(s / c)
  double dropout = 0.0;                  // dropout probability, < 1
  std::uint64_t seed = 0;                // dropout seed
  std::string dtype;                     // compute dtype f32 | bf16 | f16 | f64; empty = q's
  std::string backend = "automatic";     // automatic | fast | reference
  int threads = 0;                       // OpenMP threads; 0 = all cores
  std::string lse;                       // also write lse [B, Hq, Nq]
  std::string probs;                     // also write probabilities [B, Hq, Nq, Nk]
  std::string dout;                      // --backward: dLoss/dout, like out
  std::string dq, dk, dv;                // --backward: gradient files (each optional)
  std::string d_mask;                    // --backward with a float --mask: dLoss/dmask, its shape
  bool json = false;                     // a JSON summary on stdout instead of the line on stderr
};

// A flag that the learned parameters' table of `qkv attend` makes.
struct LearnedFlag {
  std::string name;  // its key in AttendOptions' map: the option's name
  std::string flag;  // "--score-scale"
  std::string help;  // for --help
};

// The flags of the learned parameters, in the table's order.
struct LearnedFlags {
  std::vector<LearnedFlag> inputs;     // --NAME FILE, into AttendOptions::learned
  std::vector<LearnedFlag> switches;   // --NAME, into AttendOptions::switches
  std::vector<LearnedFlag> gradients;  // --d-NAME FILE, into AttendOptions::learned_gradients
};
LearnedFlags learned_flags();

// Runs the call: reads every input and checks every option before it
// computes, and writes the outputs only when everything succeeded (each
// through a temporary file renamed over its target). Returns the exit
// status; errors are one line on `err`.
int run_attend(const AttendOptions& options, std::ostream& out, std::ostream& err);

}  // namespace qkv::tools
