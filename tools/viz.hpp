// `qkv viz`: a picture (PNG) of attention probabilities saved as .npy.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace qkv::tools {

// The command line as given (the values are checked by run_viz).
struct VizOptions {
  std::string probs;                   // .npy: [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk]
  std::string tokens;                  // text file, one key token a line; empty = positions
  std::string query_tokens;            // text file, one query token a line; empty = see run_viz
  std::optional<std::int64_t> head;    // one head; default: every head, in a grid
  std::int64_t batch = 0;              // the batch entry of a rank-4 array
  std::string out;                     // -o: the picture (.png)
  std::optional<std::string> caption;  // default: what the picture shows
};

// Reads the probabilities, draws them with heatmap_png (one panel per head;
// rows = queries, columns = keys) and writes the picture through a
// temporary file renamed over `out`; prints the picture's path and size on
// `out`. Column labels are the tokens (default: key positions 0, 1, ...);
// row labels the query tokens, else the tokens when Nq == Nk, else query
// positions. Returns the exit status: 0, or 2 after one line on `err` and
// writing nothing.
int run_viz(const VizOptions& options, std::ostream& out, std::ostream& err);

}  // namespace qkv::tools
