// The safetensors format. What a valid file is, and how one is written, follow
// Hugging Face's reference implementation (the Rust crate `safetensors`):
// the tensors' byte ranges, sorted by offset, tile the data buffer exactly
// (no overlap, no gap, no trailing bytes); the writer orders tensors by
// decreasing element size, then by name, and pads the header with spaces to a
// multiple of 8 bytes, so every tensor starts at a multiple of its element
// size and the file is byte-identical to the reference writer's.
#include "qkv/modules/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/elements.hpp"
#include "io/files.hpp"
#include "qkv/error.hpp"

namespace qkv::nn {
namespace {

// Tensor bytes are copied between the file and memory unchanged.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

using detail::Reasons;
using detail::throw_if;
using std::to_string;

// safetensors' dtype names, in the reference writer's order: decreasing
// element size (its Dtype enum is in increasing alignment order), BF16
// before F16.
struct FileDType {
  DType dtype;
  std::string_view name;
};
constexpr FileDType kFileDTypes[] = {{DType::f64, "F64"},
                                     {DType::f32, "F32"},
                                     {DType::bf16, "BF16"},
                                     {DType::f16, "F16"},
                                     {DType::boolean, "BOOL"}};

std::size_t write_rank(DType dtype) {
  for (std::size_t i = 0; i < std::size(kFileDTypes); ++i) {
    if (kFileDTypes[i].dtype == dtype) return i;
  }
  return std::size(kFileDTypes);
}

std::string_view file_dtype_name(DType dtype) { return kFileDTypes[write_rank(dtype)].name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const FileDType& d : kFileDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

std::string quoted(const std::string& name) { return "\"" + name + "\""; }

std::string shape_of(const std::vector<std::int64_t>& sizes) { return shape_string(sizes); }

// A JSON value for a message, cut short: at most `items` elements of an
// array and `depth` levels (a hostile header may nest 100,000 arrays, and
// json::dump recurses once per level).
std::string brief(const nlohmann::json& v, int depth = 2, std::size_t items = 6) {
  if (!v.is_array()) {
    if (v.is_structured()) return v.is_object() ? "{...}" : "[...]";
    std::string text = v.dump();
    return text.size() > 40 ? text.substr(0, 37) + "..." : text;
  }
  if (depth == 0) return "[...]";
  std::string text = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) text += ", ";
    if (i == items) return text + "...]";
    text += brief(v[i], depth - 1, items);
  }
  return text + "]";
}

// One tensor entry of a validated header.
struct Entry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte range in the data buffer
};

struct Header {
  std::uint64_t data_start = 0;  // file offset of the data buffer: 8 + header length
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

// A JSON value as a non-negative integer (the parser stores those as
// unsigned); nullopt for anything else (negative, fractional, not a number).
std::optional<std::uint64_t> non_negative(const nlohmann::json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  return v.get<std::uint64_t>();
}

// Checks one tensor entry; appends reasons (prefixed by the file and the
// tensor) and returns whether it is usable.
bool parse_entry(const std::string& where, const std::string& name, const nlohmann::json& info,
                 std::uint64_t buffer_size, Entry& e, Reasons& r) {
  const std::string at = where + "tensor " + quoted(name) + ": ";
  if (!info.is_object()) {
    r.push_back(at + "expected an object {\"dtype\", \"shape\", \"data_offsets\"}, got a JSON " +
                info.type_name());
    return false;
  }
  bool ok = true;
  e.name = name;
  const auto dtype = info.find("dtype");
  if (dtype == info.end() || !dtype->is_string()) {
    r.push_back(at + "\"dtype\": expected a string");
    ok = false;
  } else if (const auto d = parse_dtype(dtype->get<std::string>())) {
    e.dtype = *d;
  } else {
    r.push_back(at + "unsupported dtype " + quoted(dtype->get<std::string>()) +
                " (qkv reads F32, F64, F16, BF16 and BOOL)");
    ok = false;
  }
  const auto shape = info.find("shape");
  if (shape == info.end() || !shape->is_array()) {
    r.push_back(at + "\"shape\": expected an array of sizes");
    ok = false;
  } else if (shape->size() > static_cast<std::size_t>(kMaxRank)) {
    r.push_back(at + "rank " + to_string(shape->size()) + " (shape " + brief(*shape) +
                ") exceeds qkv's largest rank " + to_string(kMaxRank));
    ok = false;
  } else {
    for (const nlohmann::json& s : *shape) {
      const auto size = non_negative(s);
      if (!size || *size > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        r.push_back(at + "\"shape\": expected non-negative integer sizes, got " + brief(*shape));
        ok = false;
        break;
      }
      e.shape.push_back(static_cast<std::int64_t>(*size));
    }
  }
  const auto offsets = info.find("data_offsets");
  std::optional<std::uint64_t> begin, end;
  if (offsets != info.end() && offsets->is_array() && offsets->size() == 2) {
    begin = non_negative((*offsets)[0]);
    end = non_negative((*offsets)[1]);
  }
  if (!begin || !end) {
    r.push_back(at + "\"data_offsets\": expected [begin, end], two non-negative integers");
    return false;
  }
  e.begin = *begin;
  e.end = *end;
  const std::string range = "data_offsets [" + to_string(e.begin) + ", " + to_string(e.end) + "]";
  if (e.end < e.begin) {
    r.push_back(at + range + ": end before begin");
    return false;
  }
  if (e.end > buffer_size) {
    r.push_back(at + range + " reach past the end of the " + to_string(buffer_size) +
                "-byte data buffer (truncated file?)");
    ok = false;
  }
  if (!ok) return false;
  std::uint64_t bytes = dtype_size(e.dtype);
  for (const std::int64_t s : e.shape) {
    if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(s), &bytes)) {
      r.push_back(at + "shape " + shape_of(e.shape) + " of " + std::string(dtype_name(e.dtype)) +
                  " needs more than 2^64 bytes");
      return false;
    }
  }
  // Tensor's strides multiply the sizes, zeros counted as ones.
  std::int64_t strides = 1;
  for (const std::int64_t s : e.shape) {
    if (__builtin_mul_overflow(strides, std::max<std::int64_t>(s, 1), &strides)) {
      r.push_back(at + "shape " + shape_of(e.shape) +
                  ": the product of its sizes (zeros counted as ones) overflows int64");
      return false;
    }
  }
  if (e.end - e.begin != bytes) {
    r.push_back(at + range + " hold " + to_string(e.end - e.begin) + " bytes, but shape " +
                shape_of(e.shape) + " of " + std::string(file_dtype_name(e.dtype)) + " needs " +
                to_string(bytes));
    return false;
  }
  return true;
}

// Reads and validates the length field and the header; throws qkv::Error
// listing every problem. Leaves the stream's position unspecified.
Header read_header(std::ifstream& file, const std::string& path) {
  const std::string where = path + ": ";
  file.seekg(0, std::ios::end);
  const std::streamoff file_size = file.tellg();
  file.seekg(0);
  if (!file || file_size < 0) throw Error(where + "cannot determine the file size");
  const auto size = static_cast<std::uint64_t>(file_size);
  if (size < 8) {
    throw Error(where + "truncated: " + to_string(size) +
                " bytes, fewer than the 8-byte header length that starts a safetensors file");
  }
  unsigned char length_field[8];
  file.read(reinterpret_cast<char*>(length_field), 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length_field[i];
  if (n > size - 8) {
    throw Error(where + "header length " + to_string(n) + " exceeds the " + to_string(size - 8) +
                " bytes that follow the length field (truncated file, or not safetensors)");
  }
  std::string text(static_cast<std::size_t>(n), '\0');
  file.read(text.data(), static_cast<std::streamsize>(n));
  if (!file) throw Error(where + "cannot read the " + to_string(n) + "-byte header");

  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(where + "the header is not valid JSON (" + e.what() + ")");
  }
  if (!json.is_object()) {
    throw Error(where + "the header must be a JSON object, got a JSON " + json.type_name());
  }

  Header h;
  h.data_start = 8 + n;
  const std::uint64_t buffer_size = size - h.data_start;
  Reasons r;
  for (const auto& [name, info] : json.items()) {
    if (name == "__metadata__") {
      if (info.is_null()) continue;  // the reference reads null as "no metadata"
      if (!info.is_object()) {
        r.push_back(where + "\"__metadata__\": expected an object of strings, got a JSON " +
                    info.type_name());
        continue;
      }
      for (const auto& [key, value] : info.items()) {
        if (value.is_string()) {
          h.metadata[key] = value.get<std::string>();
        } else {
          r.push_back(where + "\"__metadata__\": value of " + quoted(key) +
                      " must be a string, got a JSON " + value.type_name());
        }
      }
      continue;
    }
    Entry e;
    if (parse_entry(where, name, info, buffer_size, e, r)) h.entries.push_back(std::move(e));
  }
  throw_if(r);

  // Sorted by offset, the byte ranges must tile the data buffer.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : h.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* e : by_offset) {
    const std::string at = where + "tensor " + quoted(e->name) + ": data_offsets [" +
                           to_string(e->begin) + ", " + to_string(e->end) + "]";
    if (e->begin < covered) {
      r.push_back(at + " overlap tensor " + quoted(previous->name) + ", which ends at " +
                  to_string(covered));
    } else if (e->begin > covered) {
      r.push_back(at + " leave bytes [" + to_string(covered) + ", " + to_string(e->begin) +
                  ") of the data buffer unused");
    }
    if (e->end >= covered) {
      covered = e->end;
      previous = e;
    }
  }
  if (r.empty() && covered != buffer_size) {
    r.push_back(where + "the tensors cover " + to_string(covered) + " bytes of the " +
                to_string(buffer_size) + "-byte data buffer (trailing bytes)");
  }
  throw_if(r);
  return h;
}

std::ifstream open_for_reading(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw Error(path + ": cannot open the file for reading");
  return file;
}

std::size_t byte_size(ConstTensorView v) {
  return static_cast<std::size_t>(v.numel()) * dtype_size(v.dtype());
}

}  // namespace

TensorMap load_safetensors(const std::string& path) {
  std::ifstream file = open_for_reading(path);
  const Header h = read_header(file, path);
  TensorMap tensors;
  for (const Entry& e : h.entries) {
    Tensor t(e.dtype, e.shape);
    const std::size_t bytes = byte_size(t);
    if (bytes > 0) {
      char* data = static_cast<char*>(t.view().data());
      file.seekg(static_cast<std::streamoff>(h.data_start + e.begin));
      file.read(data, static_cast<std::streamsize>(bytes));
      if (!file) throw Error(path + ": tensor " + quoted(e.name) + ": cannot read its data");
      // qkv's bool elements are 0 or 1; the format stores one byte per
      // element, any non-zero byte reading as true.
      if (e.dtype == DType::boolean) {
        for (std::size_t i = 0; i < bytes; ++i) data[i] = data[i] != 0 ? 1 : 0;
      }
    }
    tensors.emplace(e.name, std::move(t));
  }
  return tensors;
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  std::ifstream file = open_for_reading(path);
  return read_header(file, path).metadata;
}

void save_safetensors(const std::string& path,
                      const std::map<std::string, ConstTensorView>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  Reasons r;
  std::vector<std::pair<std::string, ConstTensorView>> order;
  for (const auto& [name, view] : tensors) {
    if (name == "__metadata__") {
      r.push_back(path + ": tensor name \"__metadata__\" is reserved for the metadata");
    } else if (!view.defined()) {
      r.push_back(path + ": tensor " + quoted(name) + ": undefined view");
    } else if (qkv::detail::check_memory((path + ": tensor " + quoted(name)).c_str(), view, r)) {
      // (Otherwise check_memory named the problem: null data with elements,
      // or an extent past 2^63 bytes.)
      order.emplace_back(name, view);
    }
  }
  throw_if(r);
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return write_rank(a.second.dtype()) < write_rank(b.second.dtype());
  });

  // ordered_json keeps insertion order: "__metadata__" first, then the
  // tensors in data order, with the entry fields in the reference's order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, view] : order) {
    const std::uint64_t end = offset + byte_size(view);
    header[name] = {
        {"dtype", std::string(file_dtype_name(view.dtype()))},
        {"shape", std::vector<std::int64_t>(view.size_span().begin(), view.size_span().end())},
        {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": tensor names and metadata must be valid UTF-8 (" + e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  io::AtomicFile file(path);  // the target is replaced only when complete
  unsigned char length_field[8];
  for (int i = 0; i < 8; ++i) length_field[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  file.write(length_field, 8);
  file.write(text.data(), text.size());
  for (const auto& [name, view] : order) file.write(view);
  file.commit();
}

void load_parameters(const NamedParameters& parameters, const TensorMap& tensors, bool strict) {
  Reasons r;
  std::set<std::string> taken;
  for (const NamedParameter& p : parameters) {
    taken.insert(p.name);
    const ConstTensorView value = p.parameter->value;
    const std::vector<std::int64_t> want(value.size_span().begin(), value.size_span().end());
    const auto it = tensors.find(p.name);
    if (it == tensors.end()) {
      r.push_back(quoted(p.name) + ": missing (a parameter of shape " + shape_of(want) + ")");
      continue;
    }
    const ConstTensorView t = it->second;
    const std::vector<std::int64_t> got(t.size_span().begin(), t.size_span().end());
    if (!is_floating(t.dtype())) {
      r.push_back(quoted(p.name) + ": expected a floating tensor, got " +
                  std::string(dtype_name(t.dtype())));
    } else if (got != want) {
      r.push_back(quoted(p.name) + ": expected shape " + shape_of(want) + ", got " + shape_of(got));
    }
  }
  if (strict) {
    for (const auto& [name, t] : tensors) {
      if (!taken.contains(name)) {
        r.push_back(quoted(name) +
                    ": unexpected, no parameter has this name (strict = false "
                    "ignores it)");
      }
    }
  }
  throw_if(r);
  for (const NamedParameter& p : parameters) copy(tensors.at(p.name), p.parameter->value);
}

void load_parameters(const NamedParameters& parameters, const std::string& path, bool strict) {
  const TensorMap tensors = load_safetensors(path);
  try {
    load_parameters(parameters, tensors, strict);
  } catch (const Error& e) {
    Reasons r;
    for (const std::string& reason : e.reasons()) r.push_back(path + ": " + reason);
    throw Error(r);
  }
}

void save_parameters(const NamedParameters& parameters, const std::string& path) {
  std::map<std::string, ConstTensorView> tensors;
  for (const NamedParameter& p : parameters) tensors.emplace(p.name, p.parameter->value);
  save_safetensors(path, tensors, {});
}

}  // namespace qkv::nn
