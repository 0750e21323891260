#include "qkv/npy.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <string_view>

#include "io/files.hpp"
#include "qkv/error.hpp"

namespace qkv {

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr std::uint64_t kMaxHeaderBytes = std::uint64_t{1} << 20;

// Where the bytes come from: a file or memory, both with a size known before
// anything is allocated.
class MemorySource {
 public:
  MemorySource(std::span<const std::uint8_t> bytes, const std::string& name)
      : bytes_(bytes), name_(name) {}
  std::uint64_t size() const { return bytes_.size(); }
  void read(std::uint64_t offset, void* out, std::size_t n) const {
    if (offset > bytes_.size() || n > bytes_.size() - offset) {
      throw Error(name_ + ": truncated: expected " + std::to_string(n) + " bytes at offset " +
                  std::to_string(offset) + ", there are " + std::to_string(bytes_.size()));
    }
    if (n != 0) std::memcpy(out, bytes_.data() + offset, n);
  }

 private:
  std::span<const std::uint8_t> bytes_;
  const std::string& name_;
};

struct Header {
  DType dtype = DType::f32;
  bool swap = false;     // big-endian elements
  bool fortran = false;  // column-major elements
  std::vector<std::int64_t> shape;
  std::uint64_t data_offset = 0;
  std::uint64_t data_bytes = 0;
};

// The header's dict literal, parsed strictly: string keys, and values that
// are strings, True/False or tuples of non-negative integers.
class DictParser {
 public:
  DictParser(std::string_view text, const std::string& name) : s_(text), name_(name) {}

  struct Value {
    std::optional<std::string> text;
    std::optional<bool> flag;
    std::optional<std::vector<std::int64_t>> tuple;
  };

  // Calls on_entry(key, value) for each entry.
  template <class F>
  void parse(F&& on_entry) {
    expect('{');
    skip_space();
    while (peek() != '}') {
      std::string key = string();
      expect(':');
      on_entry(key, value());
      skip_space();
      next_item('}', "expected ',' or '}'");
    }
    ++at_;
    skip_space();
    if (at_ != s_.size()) fail("unexpected text after the dict");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(name_ + ": bad .npy header at character " + std::to_string(at_) + ": " + what +
                " (header: " + std::string(s_.substr(0, 200)) + ")");
  }
  char peek() const { return at_ < s_.size() ? s_[at_] : '\0'; }
  void skip_space() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t')) ++at_;
  }
  // After an item of a list that `close` ends: a ',' (skipped, with the
  // spaces after it), or else `close` must come next.
  void next_item(char close, const char* message) {
    if (peek() == ',') {
      ++at_;
      skip_space();
    } else if (peek() != close) {
      fail(message);
    }
  }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++at_;
    skip_space();
  }
  std::string string() {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a quoted string");
    const std::size_t end = s_.find(quote, at_ + 1);
    if (end == std::string_view::npos) fail("unterminated string");
    std::string out(s_.substr(at_ + 1, end - at_ - 1));
    if (out.find('\\') != std::string::npos) fail("escapes in strings are not supported");
    at_ = end + 1;
    skip_space();
    return out;
  }
  std::int64_t integer() {
    skip_space();
    if (peek() < '0' || peek() > '9') fail("expected a non-negative integer");
    std::int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) fail("integer too large");
      v = v * 10 + digit;
      ++at_;
    }
    skip_space();
    return v;
  }
  Value value() {
    skip_space();
    Value v;
    if (peek() == '\'' || peek() == '"') {
      v.text = string();
    } else if (s_.substr(at_, 4) == "True") {
      v.flag = true;
      at_ += 4;
    } else if (s_.substr(at_, 5) == "False") {
      v.flag = false;
      at_ += 5;
    } else if (peek() == '(') {
      ++at_;
      std::vector<std::int64_t> dims;
      skip_space();
      while (peek() != ')') {
        if (dims.size() > static_cast<std::size_t>(kMaxRank)) {
          fail("expected a shape of rank at most " + std::to_string(kMaxRank));
        }
        dims.push_back(integer());
        next_item(')', "expected ',' or ')' in the shape");
      }
      ++at_;
      v.tuple = std::move(dims);
    } else {
      fail("expected a string, True, False or a tuple");
    }
    return v;
  }

  std::string_view s_;
  std::size_t at_ = 0;
  const std::string& name_;
};

// The dtype of a descr string, and whether its elements are big-endian.
void set_dtype(Header& h, const std::string& descr, const std::string& name) {
  struct Known {
    const char* descr;
    DType dtype;
    bool swap;
  };
  static constexpr Known kKnown[] = {
      {"<f4", DType::f32, false},     {">f4", DType::f32, true},   {"<f8", DType::f64, false},
      {">f8", DType::f64, true},      {"<f2", DType::f16, false},  {">f2", DType::f16, true},
      {"|b1", DType::boolean, false}, {"<V2", DType::bf16, false}, {"|V2", DType::bf16, false},
  };
  for (const Known& k : kKnown) {
    if (descr == k.descr) {
      h.dtype = k.dtype;
      h.swap = k.swap;
      return;
    }
  }
  std::string printable;
  for (const char c : descr.substr(0, 40)) printable += (c >= 32 && c < 127) ? c : '?';
  throw Error(name + ": unsupported .npy dtype '" + printable +
              "' (expected '<f4', '<f8', '<f2', '|b1', '<V2' for bfloat16, or '>f4', '>f8', "
              "'>f2')");
}

template <class Source>
Header read_header(const Source& src, const std::string& name) {
  const std::uint64_t size = src.size();
  if (size < 10) {
    throw Error(name + ": not a .npy file (" + std::to_string(size) +
                " bytes, shorter than the 10-byte preamble)");
  }
  std::uint8_t pre[12] = {};
  src.read(0, pre, 8);
  if (std::memcmp(pre, kMagic.data(), kMagic.size()) != 0) {
    throw Error(name + ": not a .npy file (bad magic string)");
  }
  const int major = pre[6], minor = pre[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    throw Error(name + ": unsupported .npy version " + std::to_string(major) + "." +
                std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)");
  }
  const int length_bytes = major == 1 ? 2 : 4;
  src.read(8, pre + 8, static_cast<std::size_t>(length_bytes));
  std::uint64_t header_len = 0;
  for (int i = 0; i < length_bytes; ++i) header_len |= std::uint64_t{pre[8 + i]} << (8 * i);
  const std::uint64_t header_at = 8 + static_cast<std::uint64_t>(length_bytes);
  if (header_len > kMaxHeaderBytes) {
    throw Error(name + ": .npy header of " + std::to_string(header_len) +
                " bytes (expected at most " + std::to_string(kMaxHeaderBytes) + ")");
  }
  if (header_len > size - header_at) {
    throw Error(name + ": truncated .npy header: " + std::to_string(header_len) +
                " bytes announced, " + std::to_string(size - header_at) + " in the file");
  }
  std::string text(static_cast<std::size_t>(header_len), '\0');
  src.read(header_at, text.data(), text.size());
  if (text.empty() || text.back() != '\n') {
    throw Error(name + ": bad .npy header: expected it to end with a newline");
  }
  for (const char c : text) {
    // 3.0 headers are UTF-8; the dict of a supported array is ASCII anyway.
    if (static_cast<unsigned char>(c) >= 128 || (c < 32 && c != '\n' && c != '\t')) {
      throw Error(name + ": bad .npy header: expected ASCII text, found byte " +
                  std::to_string(static_cast<unsigned char>(c)));
    }
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();

  Header h;
  bool has_descr = false, has_order = false, has_shape = false;
  DictParser(text, name).parse([&](const std::string& key, const DictParser::Value& v) {
    bool* seen = key == "descr"           ? &has_descr
                 : key == "fortran_order" ? &has_order
                 : key == "shape"         ? &has_shape
                                          : nullptr;
    if (seen == nullptr) throw Error(name + ": bad .npy header: unexpected key '" + key + "'");
    if (*seen) throw Error(name + ": bad .npy header: key '" + key + "' given twice");
    *seen = true;
    if (key == "descr") {
      if (!v.text) {
        throw Error(name +
                    ": unsupported .npy dtype: expected a plain dtype string "
                    "(structured arrays are not supported)");
      }
      set_dtype(h, *v.text, name);
    } else if (key == "fortran_order") {
      if (!v.flag) throw Error(name + ": bad .npy header: 'fortran_order' must be True or False");
      h.fortran = *v.flag;
    } else {
      if (!v.tuple) throw Error(name + ": bad .npy header: 'shape' must be a tuple");
      h.shape = *v.tuple;
    }
  });
  if (!has_descr || !has_order || !has_shape) {
    throw Error(name +
                ": bad .npy header: expected the keys 'descr', 'fortran_order' and "
                "'shape'");
  }
  if (h.shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw Error(name + ": .npy array of rank " + std::to_string(h.shape.size()) +
                " (expected at most " + std::to_string(kMaxRank) + ")");
  }
  const auto element = static_cast<std::uint64_t>(dtype_size(h.dtype));
  std::uint64_t bytes = element;
  for (const std::int64_t d : h.shape) {
    const auto n = static_cast<std::uint64_t>(d);
    if (n != 0 && bytes > (std::uint64_t{1} << 62) / n) {
      throw Error(name + ": .npy shape too large (its byte count overflows)");
    }
    bytes *= n;
  }
  h.data_offset = header_at + header_len;
  h.data_bytes = bytes;
  const std::uint64_t present = size - h.data_offset;
  if (present != bytes) {
    std::string shape = "(";
    for (std::size_t i = 0; i < h.shape.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(h.shape[i]);
    }
    shape += h.shape.size() == 1 ? ",)" : ")";
    throw Error(name + ": .npy data of " + std::to_string(present) + " bytes, but shape " + shape +
                " of " + std::string(dtype_name(h.dtype)) + " needs " + std::to_string(bytes) +
                (present < bytes ? " (truncated)" : " (trailing bytes)"));
  }
  return h;
}

void swap_bytes(std::uint8_t* data, std::uint64_t bytes, std::size_t element) {
  for (std::uint64_t at = 0; at + element <= bytes; at += element) {
    std::reverse(data + at, data + at + element);
  }
}

template <class Source>
Tensor read_npy(const Source& src, const std::string& name) {
  const Header h = read_header(src, name);
  // Fortran order: the elements are the row-major elements of the reversed
  // shape; read them so, then transpose.
  std::vector<std::int64_t> stored = h.shape;
  if (h.fortran) std::reverse(stored.begin(), stored.end());
  Tensor raw(h.dtype, stored);
  auto* data = static_cast<std::uint8_t*>(raw.view().data());
  src.read(h.data_offset, data, static_cast<std::size_t>(h.data_bytes));
  if (h.swap) swap_bytes(data, h.data_bytes, dtype_size(h.dtype));
  if (h.dtype == DType::boolean) {
    for (std::uint64_t i = 0; i < h.data_bytes; ++i) data[i] = data[i] != 0 ? 1 : 0;
  }
  if (!h.fortran || h.shape.size() < 2) return raw;
  const int rank = static_cast<int>(h.shape.size());
  std::vector<std::int64_t> strides(h.shape.size());
  for (int d = 0; d < rank; ++d) strides[d] = raw.view().stride(rank - 1 - d);
  const ConstTensorView transposed(raw.view().data(), h.dtype, h.shape, strides);
  Tensor out(h.dtype, h.shape);
  copy(transposed, out);
  return out;
}

std::string descr_of(DType d) {
  // In DType's order (bf16 as two opaque bytes).
  constexpr const char* kDescr[] = {"<f4", "<f8", "<f2", "<V2", "|b1"};
  static_assert(std::size(kDescr) == static_cast<std::size_t>(DType::boolean) + 1);
  const auto i = static_cast<std::size_t>(d);
  if (i < std::size(kDescr)) return kDescr[i];
  throw Error("npy: no .npy dtype for " + std::string(dtype_name(d)));
}

// Magic, version 1.0, header length and the header, padded with spaces so
// that the data starts at a multiple of 64 bytes.
std::string preamble(ConstTensorView t) {
  std::string dict = "{'descr': '" + descr_of(t.dtype()) + "', 'fortran_order': False, 'shape': (";
  for (int d = 0; d < t.rank(); ++d) dict += (d ? ", " : "") + std::to_string(t.size(d));
  dict += t.rank() == 1 ? ",), }" : "), }";
  const std::size_t fixed = kMagic.size() + 2 + 2;
  const std::size_t total = (fixed + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - fixed - dict.size() - 1, ' ');
  dict += '\n';
  std::string out(kMagic);
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(dict.size() & 0xff);
  out += static_cast<char>(dict.size() >> 8);
  return out + dict;
}

void check_writable(ConstTensorView t, const std::string& name) {
  if (!t.defined()) throw Error(name + ": expected a defined tensor, got an undefined view");
  if (t.numel() > 0 && t.data() == nullptr) {
    throw Error(name + ": expected a view backed by memory, got one without data");
  }
}

}  // namespace

Tensor load_npy(const std::string& path) {
  const io::InputFile file(path);
  return read_npy(file, path);
}

Tensor parse_npy(std::span<const std::uint8_t> bytes, const std::string& name) {
  return read_npy(MemorySource(bytes, name), name);
}

std::vector<std::uint8_t> npy_bytes(ConstTensorView t) {
  check_writable(t, "npy");
  const std::string head = preamble(t);
  std::vector<std::uint8_t> out(head.begin(), head.end());
  const std::size_t element = dtype_size(t.dtype());
  out.resize(head.size() + static_cast<std::size_t>(t.numel()) * element);
  if (t.numel() > 0) io::gather_bytes(t, reinterpret_cast<std::byte*>(out.data() + head.size()));
  return out;
}

void save_npy(const std::string& path, ConstTensorView t) {
  check_writable(t, path);
  io::AtomicFile file(path);
  const std::string head = preamble(t);
  file.write(head.data(), head.size());
  file.write(t);
  file.commit();
}

}  // namespace qkv
