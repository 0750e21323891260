// The checks every public entry point runs before it allocates or writes
// anything: reasons gathered into one qkv::Error, the text of values in
// messages, and the one check of a view argument (its shape, dtype and
// memory, and for outputs no overlap with itself, the inputs or another
// output). Entry points, modules, file readers and the KV cache all use
// these, so that every message names the argument, the expected and the
// actual value in the same words.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/positional.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

// The problems found in one call, one line each ("name: expected ..., got ...").
using Reasons = std::vector<std::string>;

// Throws qkv::Error listing every reason, unless there are none.
void throw_if(const Reasons& reasons);

// Shortest text that reads back as x ("1e-09", "inf", "nan"): std::to_string
// prints six fixed decimals, so a softcap of -1e-9 would read "-0.000000".
std::string num(double x);
// "f32", "bf16", ...; "value 6" for a value outside the enum.
std::string str(DType dtype);
// "[2, 5, 3, 8]".
std::string shape_of(ConstTensorView t);

// What a view argument must be; fields left at their defaults are not checked.
struct ViewSpec {
  int rank = -1;                             // exact rank; -1: any (implied by `sizes`)
  std::span<const std::int64_t> sizes = {};  // exact sizes; empty: any
  const char* sizes_source = nullptr;        // where those sizes come from ("the cache's heads")
  const char* layout = nullptr;              // names the dimensions in messages ("[B, N, H, D]")
  std::optional<DType> dtype = {};           // exact dtype
  const char* dtype_source = nullptr;        // where that dtype comes from ("the dtype of q")
  bool floating = false;                     // one of f32, f64, f16, bf16
};

// Appends a reason unless `dtype` is one of f32, f64, f16, bf16 (a dtype
// argument, or the dtype of the view `name`); returns whether it is.
bool check_floating(const char* name, DType dtype, Reasons& reasons);

// Appends a reason when t's extent overflows int64 or its data is null while
// it has elements; returns whether it is addressable and backed.
bool check_memory(const char* name, ConstTensorView t, Reasons& reasons);

// The one check of a view argument: defined, of the rank, sizes and dtype of
// `spec`, with an extent that fits int64 and data backing its elements.
// Appends a reason for each problem; returns whether later checks may read
// its sizes (defined, of the expected rank, addressable).
bool check_view(const char* name, ConstTensorView t, const ViewSpec& spec, Reasons& reasons);

// Appends a reason unless dimension d of t (its `what`) equals `expected`,
// which comes from `source` ("q's batch 2").
void check_dim(const char* name, ConstTensorView t, int d, const char* what, std::int64_t expected,
               const std::string& source, Reasons& reasons);

// The views one call reads and writes, for the overlap checks: register the
// inputs, then check each output in turn against itself, every input and
// every output checked before it. Undefined views are ignored.
class Aliasing {
 public:
  void input(const char* name, ConstTensorView t);
  // Appends a reason if `t` has overlapping elements or shares memory with a
  // registered view; then registers it.
  void output(const char* name, ConstTensorView t, Reasons& reasons);

 private:
  std::vector<std::pair<const char*, ConstTensorView>> views_;
};

// check_view for an output, then Aliasing::output when its rank and memory
// are sound; returns what check_view returned.
bool check_output(const char* name, ConstTensorView t, const ViewSpec& spec, Aliasing& aliasing,
                  Reasons& reasons);

// Backend::fast computes in f32: appends a reason when it is asked to take
// f64 inputs.
void check_fast_dtype(Backend backend, DType dtype, Reasons& reasons);

// A rotary embedding's configuration: base, and rotary_dim against the head
// dim it rotates, named `dim` in messages ("D", "Dk"); head_dim < 0 when it
// is unknown (its tensor is malformed), which leaves only the checks that do
// not depend on it.
void check_rope(const RopeConfig& rope, std::int64_t head_dim, const char* dim, Reasons& reasons);

// a * b * ... into `out`; false on int64 overflow (a factor of 0 makes it 0,
// whatever the others). For sizes and counts.
bool checked_product(std::initializer_list<std::int64_t> factors, std::int64_t& out);

}  // namespace qkv::detail
