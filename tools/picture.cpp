#include "picture.hpp"

// Debian's libstb holds the implementations; the headers only declare them
// (stb_easy_font's functions are static, in the header).
#include <stb_easy_font.h>
#include <stb_image_write.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>

#include "qkv/error.hpp"
#include "qkv/files.hpp"

namespace qkv::tools {

namespace {

struct Rgb {
  std::uint8_t r, g, b;
};

constexpr Rgb kInk{20, 20, 20};
constexpr Rgb kFrame{150, 150, 150};

// matplotlib's viridis at 0, 1/8, ..., 1.
constexpr Rgb kViridis[9] = {{68, 1, 84},    {71, 45, 123},  {59, 82, 139},
                             {44, 114, 142}, {33, 145, 140}, {40, 174, 128},
                             {94, 201, 98},  {173, 220, 48}, {253, 231, 37}};

constexpr int kMargin = 16;       // around everything
constexpr int kPanelGap = 28;     // between panels
constexpr int kLabelGap = 6;      // between a label and its grid (room for a tick)
constexpr int kMaxCell = 28;      // cell side for up to 16 tokens
constexpr int kGridBudget = 448;  // a panel's side in pixels, up to kMaxCell per token
constexpr int kBarWidth = 18;
constexpr int kMinBarHeight = 120;
constexpr std::size_t kMaxLabelChars = 16;
constexpr std::size_t kMaxTitleChars = 200;
constexpr std::size_t kMaxCaptionChars = 1000;
constexpr int kGlyphUnits = 10;  // stb_easy_font: capitals 7 units tall, descenders to 9
constexpr int kCapUnits = 7;

Rgb colour(double t) {
  t = std::clamp(t, 0.0, 1.0);
  const double pos = t * 8.0;
  const int i = std::min(static_cast<int>(pos), 7);
  const double f = pos - i;
  const Rgb a = kViridis[i], b = kViridis[i + 1];
  const auto mix = [f](std::uint8_t x, std::uint8_t y) {
    return static_cast<std::uint8_t>(std::lround(x + (y - x) * f));
  };
  return {mix(a.r, b.r), mix(a.g, b.g), mix(a.b, b.b)};
}

// `s` in the font's characters: printable ASCII kept, a UTF-8 sequence or
// control character drawn as '?'; longer than `max_chars`: cut, ending "..".
std::string printable(const std::string& s, std::size_t max_chars) {
  std::string out;
  for (const char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (u >= 0x80 && u < 0xC0) continue;  // a UTF-8 continuation byte
    out += (u >= 0x20 && u < 0x7F) ? ch : '?';
  }
  if (out.size() > max_chars) out = out.substr(0, max_chars - 2) + "..";
  return out;
}

// A line of text as a mask of `scale`-pixel font units: `width` x `height`
// pixels, 1 where ink.
struct Text {
  int width = 0, height = 0;
  std::vector<std::uint8_t> on;
};

Text render(const std::string& s, int scale) {
  Text t;
  t.height = kGlyphUnits * scale;
  if (s.empty()) return t;
  std::vector<char> chars(s.begin(), s.end());
  chars.push_back('\0');
  // About 270 bytes a character on average (stb_easy_font.h); 16 quads of
  // 64 bytes is more than any character takes.
  std::vector<char> buffer(s.size() * 1024 + 1024);
  const int quads = stb_easy_font_print(0.0f, 0.0f, chars.data(), nullptr, buffer.data(),
                                        static_cast<int>(buffer.size()));
  // Each vertex: x, y, z (floats) and a colour (4 bytes).
  const auto vertex = [&](int i, int coordinate) {
    float v = 0.0f;
    std::memcpy(&v, buffer.data() + 16 * i + 4 * coordinate, sizeof v);
    return v;
  };
  float right = 0.0f;
  for (int i = 0; i < quads * 4; ++i) right = std::max(right, vertex(i, 0));
  t.width = static_cast<int>(std::ceil(right)) * scale;
  t.on.assign(static_cast<std::size_t>(t.width) * t.height, 0);
  for (int q = 0; q < quads; ++q) {
    float x0 = vertex(4 * q, 0), x1 = x0, y0 = vertex(4 * q, 1), y1 = y0;
    for (int k = 1; k < 4; ++k) {
      x0 = std::min(x0, vertex(4 * q + k, 0));
      x1 = std::max(x1, vertex(4 * q + k, 0));
      y0 = std::min(y0, vertex(4 * q + k, 1));
      y1 = std::max(y1, vertex(4 * q + k, 1));
    }
    const int px0 = std::max(0, static_cast<int>(std::lround(x0 * scale)));
    const int px1 = std::min(t.width, static_cast<int>(std::lround(x1 * scale)));
    const int py0 = std::max(0, static_cast<int>(std::lround(y0 * scale)));
    const int py1 = std::min(t.height, static_cast<int>(std::lround(y1 * scale)));
    for (int y = py0; y < py1; ++y) {
      for (int x = px0; x < px1; ++x) t.on[static_cast<std::size_t>(y) * t.width + x] = 1;
    }
  }
  return t;
}

// `s` rendered at `scale`, cut (ending "..") until at most `max_width` wide.
Text render_fitting(std::string s, int scale, int max_width) {
  Text t = render(s, scale);
  while (t.width > max_width && s.size() > 2) {
    s = s.substr(0, s.size() - (s.size() >= 3 && s.ends_with("..") ? 3 : 1)) + "..";
    t = render(s, scale);
  }
  return t;
}

// `s` broken at spaces (words wider than `width`: anywhere) into lines at
// most `width` pixels wide at `scale`.
std::vector<std::string> wrap(const std::string& s, int scale, int width) {
  std::vector<std::string> lines;
  std::string line;
  const auto fits = [&](const std::string& text) { return render(text, scale).width <= width; };
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t space = s.find(' ', i);
    const std::size_t end = space == std::string::npos ? s.size() : space;
    std::string word = s.substr(i, end - i);
    i = end == s.size() ? end : end + 1;
    if (word.empty()) continue;
    const std::string joined = line.empty() ? word : line + " " + word;
    if (fits(joined)) {
      line = joined;
      continue;
    }
    if (!line.empty()) lines.push_back(line);
    line.clear();
    while (!fits(word)) {  // a word wider than a line: broken anywhere
      std::size_t n = 1;
      while (n < word.size() && fits(word.substr(0, n + 1))) ++n;
      lines.push_back(word.substr(0, n));
      word = word.substr(n);
    }
    line = word;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

class Canvas {
 public:
  Canvas(int width, int height)
      : width_(width), height_(height), rgb_(static_cast<std::size_t>(width) * height * 3, 255) {}

  // The rectangle [x0, x1) x [y0, y1), clipped to the picture.
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    x0 = std::max(x0, 0);
    y0 = std::max(y0, 0);
    x1 = std::min(x1, width_);
    y1 = std::min(y1, height_);
    for (int y = y0; y < y1; ++y) {
      for (int x = x0; x < x1; ++x) set(x, y, c);
    }
  }

  // A one-pixel outline just outside [x0, x1) x [y0, y1).
  void frame(int x0, int y0, int x1, int y1, Rgb c) {
    fill(x0 - 1, y0 - 1, x1 + 1, y0, c);
    fill(x0 - 1, y1, x1 + 1, y1 + 1, c);
    fill(x0 - 1, y0, x0, y1, c);
    fill(x1, y0, x1 + 1, y1, c);
  }

  // `t` with its top left corner at (x, y); `upward`: turned a quarter turn
  // anticlockwise (reading from bottom to top; t.height wide, t.width tall).
  void text(const Text& t, int x, int y, bool upward = false, Rgb c = kInk) {
    for (int ty = 0; ty < t.height; ++ty) {
      for (int tx = 0; tx < t.width; ++tx) {
        if (!t.on[static_cast<std::size_t>(ty) * t.width + tx]) continue;
        const int px = upward ? x + ty : x + tx;
        const int py = upward ? y + (t.width - 1 - tx) : y + ty;
        if (px >= 0 && px < width_ && py >= 0 && py < height_) set(px, py, c);
      }
    }
  }

  std::vector<std::uint8_t> png() const {
    std::vector<std::uint8_t> bytes;
    const auto append = [](void* context, void* data, int size) {
      auto* out = static_cast<std::vector<std::uint8_t>*>(context);
      const auto* p = static_cast<const std::uint8_t*>(data);
      out->insert(out->end(), p, p + size);
    };
    if (stbi_write_png_to_func(append, &bytes, width_, height_, 3, rgb_.data(), width_ * 3) == 0) {
      throw Error("heatmap_png: PNG encoding of a " + std::to_string(width_) + " x " +
                  std::to_string(height_) + " px picture failed");
    }
    return bytes;
  }

 private:
  void set(int x, int y, Rgb c) {
    std::uint8_t* p = &rgb_[(static_cast<std::size_t>(y) * width_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }

  int width_, height_;
  std::vector<std::uint8_t> rgb_;
};

std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

// Every argument error, and the largest value.
float check(const std::vector<HeatmapPanel>& panels) {
  if (panels.empty()) throw Error("heatmap_png: panels: expected at least one panel, got none");
  float largest = 0.0f;
  for (std::size_t i = 0; i < panels.size(); ++i) {
    const HeatmapPanel& p = panels[i];
    const std::string name = "heatmap_png: panels[" + std::to_string(i) + "]";
    for (const auto& [field, n] : {std::pair{".rows", p.rows}, std::pair{".cols", p.cols}}) {
      if (n < 1 || n > kMaxPictureSide) {
        throw Error(name + field + ": expected 1 to " + std::to_string(kMaxPictureSide) +
                    " (a cell is at least 1 px), got " + std::to_string(n));
      }
    }
    if (static_cast<std::int64_t>(p.values.size()) != p.rows * p.cols) {
      throw Error(name + ".values: expected rows * cols = " + std::to_string(p.rows) + " * " +
                  std::to_string(p.cols) + " = " + std::to_string(p.rows * p.cols) +
                  " values, got " + std::to_string(p.values.size()));
    }
    if (!p.row_labels.empty() && static_cast<std::int64_t>(p.row_labels.size()) != p.rows) {
      throw Error(name + ".row_labels: expected rows = " + std::to_string(p.rows) +
                  " labels (or none), got " + std::to_string(p.row_labels.size()));
    }
    if (!p.col_labels.empty() && static_cast<std::int64_t>(p.col_labels.size()) != p.cols) {
      throw Error(name + ".col_labels: expected cols = " + std::to_string(p.cols) +
                  " labels (or none), got " + std::to_string(p.col_labels.size()));
    }
    for (std::size_t k = 0; k < p.values.size(); ++k) {
      const float v = p.values[k];
      if (!std::isfinite(v) || v < 0.0f) {
        throw Error(name + ".values[" + std::to_string(k) + "] (row " +
                    std::to_string(static_cast<std::int64_t>(k) / p.cols) + ", column " +
                    std::to_string(static_cast<std::int64_t>(k) % p.cols) +
                    "): expected a finite value >= 0, got " + number(v));
      }
      largest = std::max(largest, v);
    }
  }
  return largest;
}

}  // namespace

std::vector<std::uint8_t> heatmap_png(const std::vector<HeatmapPanel>& panels,
                                      const std::string& caption, ImageSize* size) {
  const float largest = check(panels);
  const double top = largest > 0.0f ? largest : 1.0;  // the colour bar's range [0, top]

  std::int64_t tokens = 1, max_rows = 1, max_cols = 1;
  for (const HeatmapPanel& p : panels) {
    tokens = std::max({tokens, p.rows, p.cols});
    max_rows = std::max(max_rows, p.rows);
    max_cols = std::max(max_cols, p.cols);
  }
  const int cell = static_cast<int>(std::clamp<std::int64_t>(kGridBudget / tokens, 1, kMaxCell));
  const int label_scale = cell >= 20 ? 2 : 1;
  // Every k-th label, so that labels do not overlap: k = 1, 2, 5, 10, 20, ...
  const int needed = (kGlyphUnits * label_scale + 2 + cell - 1) / cell;
  int stride = 1;
  for (int decade = 1; stride < needed; decade *= 10) {
    for (const int k : {decade, 2 * decade, 5 * decade}) {
      if (stride < needed) stride = k;
    }
  }
  const std::int64_t grid_w = max_cols * cell, grid_h = max_rows * cell;

  // Labels, rendered once.
  std::vector<std::vector<Text>> row_text(panels.size()), col_text(panels.size());
  int row_label_w = 0, col_label_w = 0;
  bool any_row = false, any_col = false, col_fits = true;
  for (std::size_t i = 0; i < panels.size(); ++i) {
    if (!panels[i].row_labels.empty()) row_text[i].resize(panels[i].rows);
    if (!panels[i].col_labels.empty()) col_text[i].resize(panels[i].cols);
    for (std::int64_t r = 0; r < static_cast<std::int64_t>(row_text[i].size()); r += stride) {
      row_text[i][r] = render(printable(panels[i].row_labels[r], kMaxLabelChars), label_scale);
      row_label_w = std::max(row_label_w, row_text[i][r].width);
      any_row = true;
    }
    for (std::int64_t c = 0; c < static_cast<std::int64_t>(col_text[i].size()); ++c) {
      col_text[i][c] = render(printable(panels[i].col_labels[c], kMaxLabelChars), label_scale);
      col_label_w = std::max(col_label_w, col_text[i][c].width);
      col_fits = col_fits && col_text[i][c].width <= cell - 2;
      any_col = true;
    }
  }
  const int col_stride = col_fits ? 1 : stride;
  const int row_area = any_row ? row_label_w + kLabelGap : 0;
  const int col_area =
      !any_col ? 0 : kLabelGap + (col_fits ? kGlyphUnits * label_scale : col_label_w);

  // Titles: 2x, 1x, or cut to the panel's width.
  int widest_title = 0;
  bool any_title = false;
  for (const HeatmapPanel& p : panels) {
    if (p.title.empty()) continue;
    any_title = true;
    widest_title = std::max(widest_title, render(printable(p.title, kMaxTitleChars), 2).width);
  }
  const std::int64_t block_w =
      std::max<std::int64_t>(row_area + grid_w, std::min(widest_title, 360));
  const int title_area = any_title ? 2 * kGlyphUnits + 6 : 0;
  const std::int64_t block_h = title_area + grid_h + col_area;

  const std::int64_t n = static_cast<std::int64_t>(panels.size());
  const std::int64_t columns = std::min<std::int64_t>(4, n),
                     grid_rows = (n + columns - 1) / columns;
  const std::int64_t panels_w = columns * block_w + (columns - 1) * kPanelGap;
  const std::int64_t panels_h = grid_rows * block_h + (grid_rows - 1) * kPanelGap;

  // The colour bar, beside the first row of panels.
  const int bar_h =
      static_cast<int>(std::clamp<std::int64_t>(grid_h, kMinBarHeight, kMaxPictureSide));
  std::vector<Text> ticks;
  int tick_w = 0;
  for (int k = 0; k <= 4; ++k) {
    ticks.push_back(render(number(top * k / 4.0), 2));
    tick_w = std::max(tick_w, ticks.back().width);
  }
  const int bar_area = 24 + kBarWidth + 12 + tick_w;
  const std::int64_t content_h =
      std::max<std::int64_t>(panels_h, title_area + bar_h + kCapUnits * 2);

  // The caption: at least up to 720 px wide before it wraps.
  const std::string caption_text = printable(caption, kMaxCaptionChars);
  std::int64_t width = 2 * kMargin + panels_w + bar_area;
  if (!caption_text.empty()) {
    width =
        std::max<std::int64_t>(width, std::min(render(caption_text, 2).width + 2 * kMargin, 720));
  }
  std::vector<std::string> lines;
  if (width <= kMaxPictureSide) {
    lines = wrap(caption_text, 2, static_cast<int>(width) - 2 * kMargin);
  }
  const int line_h = 2 * kGlyphUnits + 4;
  const std::int64_t caption_h =
      lines.empty() ? 0 : 14 + line_h * static_cast<std::int64_t>(lines.size());
  const std::int64_t height = kMargin + content_h + caption_h + kMargin;
  if (width > kMaxPictureSide || height > kMaxPictureSide) {
    throw Error("heatmap_png: expected a picture at most " + std::to_string(kMaxPictureSide) +
                " px on each side, got " + std::to_string(width) + " x " + std::to_string(height) +
                " px for " + std::to_string(n) + " panel(s) of up to " + std::to_string(max_rows) +
                " x " + std::to_string(max_cols) + " values");
  }

  Canvas canvas(static_cast<int>(width), static_cast<int>(height));
  for (std::int64_t i = 0; i < n; ++i) {
    const HeatmapPanel& p = panels[i];
    const int bx = static_cast<int>(kMargin + (i % columns) * (block_w + kPanelGap));
    const int by = static_cast<int>(kMargin + (i / columns) * (block_h + kPanelGap));
    const int gx = bx + row_area, gy = by + title_area;
    const int gw = static_cast<int>(p.cols) * cell, gh = static_cast<int>(p.rows) * cell;
    if (!p.title.empty()) {
      std::string title = printable(p.title, kMaxTitleChars);
      Text t = render(title, 2);
      if (t.width > block_w) t = render_fitting(title, 1, static_cast<int>(block_w));
      const int tx =
          std::clamp(gx + (gw - t.width) / 2, bx, static_cast<int>(bx + block_w - t.width));
      canvas.text(t, tx, by + (title_area - 6 - t.height) / 2 + 2);
    }
    for (std::int64_t r = 0; r < p.rows; ++r) {
      for (std::int64_t c = 0; c < p.cols; ++c) {
        const int x = gx + static_cast<int>(c) * cell, y = gy + static_cast<int>(r) * cell;
        canvas.fill(x, y, x + cell, y + cell, colour(p.values[r * p.cols + c] / top));
      }
    }
    canvas.frame(gx, gy, gx + gw, gy + gh, kFrame);
    for (std::int64_t r = 0; r < static_cast<std::int64_t>(row_text[i].size()); r += stride) {
      const Text& t = row_text[i][r];
      const int cy = gy + static_cast<int>(r) * cell + cell / 2;
      canvas.text(t, gx - kLabelGap - t.width, cy - kCapUnits * label_scale / 2);
      if (stride > 1) canvas.fill(gx - 4, cy, gx - 1, cy + 1, kInk);
    }
    for (std::int64_t c = 0; c < static_cast<std::int64_t>(col_text[i].size()); c += col_stride) {
      const Text& t = col_text[i][c];
      const int cx = gx + static_cast<int>(c) * cell + cell / 2;
      if (col_fits) {
        canvas.text(t, cx - t.width / 2, gy + gh + kLabelGap);
      } else {
        // Turned to read upwards, each ending next to the grid.
        canvas.text(t, cx - kCapUnits * label_scale / 2, gy + gh + kLabelGap, true);
      }
      if (col_stride > 1) canvas.fill(cx, gy + gh + 1, cx + 1, gy + gh + 4, kInk);
    }
  }

  // The colour bar: `top` at the top, 0 at the bottom.
  const int bar_x = static_cast<int>(kMargin + panels_w + 24), bar_y = kMargin + title_area;
  for (int y = 0; y < bar_h; ++y) {
    const double t = bar_h > 1 ? 1.0 - static_cast<double>(y) / (bar_h - 1) : 1.0;
    canvas.fill(bar_x, bar_y + y, bar_x + kBarWidth, bar_y + y + 1, colour(t));
  }
  canvas.frame(bar_x, bar_y, bar_x + kBarWidth, bar_y + bar_h, kFrame);
  for (int k = 0; k <= 4; ++k) {
    const int y = bar_y + static_cast<int>(std::lround((1.0 - k / 4.0) * (bar_h - 1)));
    canvas.fill(bar_x + kBarWidth + 1, y, bar_x + kBarWidth + 5, y + 1, kInk);
    canvas.text(ticks[k], bar_x + kBarWidth + 12, y - kCapUnits);
  }

  for (std::size_t l = 0; l < lines.size(); ++l) {
    const int y =
        static_cast<int>(kMargin + content_h + 14 + line_h * static_cast<std::int64_t>(l));
    canvas.text(render(lines[l], 2), kMargin, y);
  }

  if (size != nullptr) *size = {static_cast<int>(width), static_cast<int>(height)};
  return canvas.png();
}

ImageSize write_heatmap_png(const std::string& path, const std::vector<HeatmapPanel>& panels,
                            const std::string& caption) {
  ImageSize size;
  const std::vector<std::uint8_t> png = heatmap_png(panels, caption, &size);
  write_file(path, png);
  return size;
}

}  // namespace qkv::tools
