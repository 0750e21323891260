// Heatmap pictures (PNG) of attention probabilities, for the command line
// tool: panels of coloured cells with token labels, a shared colour bar and
// a caption.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::tools {

// One matrix of the picture.
struct HeatmapPanel {
  std::string title;                    // drawn above the panel
  std::vector<float> values;            // [rows * cols], row-major (probabilities, >= 0)
  std::int64_t rows = 0, cols = 0;      // both >= 1
  std::vector<std::string> row_labels;  // `rows` labels (queries), or empty
  std::vector<std::string> col_labels;  // `cols` labels (keys), or empty
};

struct ImageSize {
  int width = 0, height = 0;
};

// The largest width and height of a picture, in pixels.
inline constexpr int kMaxPictureSide = 8192;

// The panels side by side (a grid of up to 4 columns when there are more),
// each value a square cell (28 px for up to 16 tokens, smaller for more, at
// least 1 px) coloured by a viridis map of value / (largest value of all
// panels); row labels left of each panel, column labels below it (turned to
// read upwards when they are wider than a cell; every k-th label when the
// cells are smaller than the text; labels longer than 16 characters are
// cut, characters outside printable ASCII drawn as '?'), one colour bar for
// [0, largest value] with tick labels right of the panels, and `caption`
// (wrapped at the picture's width, cut at 1000 characters; empty: none) at
// the bottom; text is drawn with stb_easy_font's bitmap font. Returns the
// PNG bytes (8-bit RGB) and, when `size` is given, the picture's size.
// Throws qkv::Error, naming the panel and field, for: no panels; rows or
// cols < 1; values.size() != rows * cols; a label count that is neither 0
// nor rows (cols); a NaN, infinite or negative value; a picture wider or
// taller than kMaxPictureSide.
std::vector<std::uint8_t> heatmap_png(const std::vector<HeatmapPanel>& panels,
                                      const std::string& caption, ImageSize* size = nullptr);

// heatmap_png written to `path` with qkv::write_file (a temporary file
// renamed over the target: an existing file is replaced whole or left as it
// was). Returns the picture's size.
ImageSize write_heatmap_png(const std::string& path, const std::vector<HeatmapPanel>& panels,
                            const std::string& caption);

}  // namespace qkv::tools
