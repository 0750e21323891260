#include "viz.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <vector>

#include "cli_error.hpp"
#include "picture.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"

namespace qkv::tools {

namespace {

std::string shape_text(const Tensor& t) {
  std::string s = "[";
  for (int d = 0; d < t.rank(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// The lines of a text file ("\r\n" endings too; a last newline ends the
// last line, not an empty one).
std::vector<std::string> read_lines(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(flag + ": cannot read '" + path + "'");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
  }
  if (in.bad()) throw Error(flag + ": cannot read '" + path + "'");
  return lines;
}

std::vector<std::string> tokens_of(const std::string& path, const std::string& flag,
                                   std::int64_t count, const std::string& what) {
  std::vector<std::string> tokens = read_lines(path, flag);
  if (static_cast<std::int64_t>(tokens.size()) != count) {
    throw Error(flag + ": expected " + what + " = " + std::to_string(count) +
                " tokens (one a line), got " + std::to_string(tokens.size()) + " in '" + path +
                "'");
  }
  return tokens;
}

std::vector<std::string> positions(std::int64_t n) {
  std::vector<std::string> labels;
  for (std::int64_t i = 0; i < n; ++i) labels.push_back(std::to_string(i));
  return labels;
}

// -o: given, not an input, in a folder that can be written.
void check_output(const VizOptions& o) {
  if (o.out.empty()) throw Error("-o: expected an output file (.png)");
  for (const std::string& input : {o.probs, o.tokens, o.query_tokens}) {
    if (o.out == input) throw Error("-o: '" + o.out + "' is also an input");
  }
  const std::size_t slash = o.out.find_last_of('/');
  if (slash + 1 == o.out.size()) throw Error("-o: expected a file name, got '" + o.out + "'");
  const std::string folder = slash == std::string::npos ? "." : o.out.substr(0, slash + 1);
  if (::access(folder.c_str(), W_OK) != 0) {
    throw Error("-o: cannot write into folder '" + folder + "' of '" + o.out + "'");
  }
}

}  // namespace

int run_viz(const VizOptions& o, std::ostream& out, std::ostream& err) {
  try {
    check_output(o);
    const Tensor loaded = load_npy(o.probs);
    const std::string name = "'" + o.probs + "'";
    if (loaded.rank() < 2 || loaded.rank() > 4) {
      throw Error(name + ": expected probabilities [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk], got " +
                  "shape " + shape_text(loaded));
    }
    if (loaded.dtype() == DType::boolean) {
      throw Error(name + ": expected floating-point probabilities, got bool");
    }
    const Tensor probs = to_dtype(loaded, DType::f32);
    // [B, H, Nq, Nk], B = H = 1 where the array has no such axis.
    std::vector<std::int64_t> dims(4 - probs.rank(), 1);
    for (int d = 0; d < probs.rank(); ++d) dims.push_back(probs.size(d));
    const int rank = probs.rank();
    const std::int64_t batches = dims[0], heads = dims[1], nq = dims[2], nk = dims[3];
    if (rank < 4 && o.batch != 0) {
      throw Error("--batch: expected a 4-D array [B, H, Nq, Nk], got shape " + shape_text(probs) +
                  " in " + name);
    }
    if (o.batch < 0 || o.batch >= batches) {
      throw Error("--batch: expected 0 to " + std::to_string(batches - 1) + " (B = " +
                  std::to_string(batches) + " in " + name + "), got " + std::to_string(o.batch));
    }
    if (o.head && rank < 3) {
      throw Error("--head: expected a 3-D or 4-D array with heads, got shape " + shape_text(probs) +
                  " in " + name);
    }
    if (o.head && (*o.head < 0 || *o.head >= heads)) {
      throw Error("--head: expected 0 to " + std::to_string(heads - 1) + " (H = " +
                  std::to_string(heads) + " in " + name + "), got " + std::to_string(*o.head));
    }
    if (nq < 1 || nk < 1) {
      throw Error(name + ": expected at least one query and one key, got shape " +
                  shape_text(probs));
    }

    std::vector<std::string> cols =
        o.tokens.empty() ? positions(nk) : tokens_of(o.tokens, "--tokens", nk, "Nk");
    std::vector<std::string> rows;
    if (!o.query_tokens.empty()) {
      rows = tokens_of(o.query_tokens, "--query-tokens", nq, "Nq");
    } else if (!o.tokens.empty() && nq == nk) {
      rows = cols;
    } else {
      rows = positions(nq);
    }

    const float* data = probs.data<float>();
    for (std::int64_t i = 0; i < probs.numel(); ++i) {
      if (!std::isfinite(data[i]) || data[i] < 0.0f) {
        std::string at;
        std::int64_t rest = i;
        for (int d = 3; d >= 4 - rank; --d) {
          at = std::to_string(rest % dims[d]) + (at.empty() ? "" : ", ") + at;
          rest /= dims[d];
        }
        char value[32];
        std::snprintf(value, sizeof value, "%g", static_cast<double>(data[i]));
        throw Error(name + ": expected probabilities (finite, >= 0), got " + value + " at [" + at +
                    "]");
      }
    }
    const std::int64_t first = o.head ? *o.head : 0, last = o.head ? *o.head + 1 : heads;
    std::vector<HeatmapPanel> panels;
    for (std::int64_t h = first; h < last; ++h) {
      HeatmapPanel p;
      p.title = rank >= 3 ? "head " + std::to_string(h) : "";
      const float* map = data + (o.batch * heads + h) * nq * nk;
      p.values.assign(map, map + nq * nk);
      p.rows = nq;
      p.cols = nk;
      p.row_labels = rows;
      p.col_labels = cols;
      panels.push_back(std::move(p));
    }

    std::string caption;
    if (o.caption) {
      caption = *o.caption;
    } else {
      std::string selection;
      if (rank == 4) selection = "batch " + std::to_string(o.batch);
      if (o.head)
        selection += (selection.empty() ? "" : ", ") + ("head " + std::to_string(*o.head));
      caption = "attention probabilities of " + o.probs +
                (selection.empty() ? "" : " (" + selection + ")") +
                ", rows = queries, columns = keys; each row sums to 1";
    }

    ImageSize size;
    try {
      size = write_heatmap_png(o.out, panels, caption);
    } catch (const Error& e) {
      if (panels.size() > 1 && e.reasons().size() == 1 &&
          e.reasons()[0].find("px on each side") != std::string::npos) {
        throw Error(e.reasons()[0] + " (--head H draws one head)");
      }
      throw;
    }
    out << o.out << ": " << size.width << " x " << size.height << " px\n";
    return 0;
  } catch (const Error& e) {
    return report_error(err, "qkv viz", e);
  }
}

}  // namespace qkv::tools
