// What the libFuzzer targets of tests/fuzz share: decoding fuzz input into
// sizes, strided views, values and attention options (FuzzedDataProvider),
// calling an entry point so that any exception but qkv::Error is a finding,
// sentinel-filled buffers that show whether a call wrote where it must not,
// and the finiteness and reference checks. Attention and its backward are
// held to the worst-case error bounds of tests/error_bound.hpp through
// tests/attention_checks.hpp (its EXPECTs are turned into findings by a
// gtest listener); decode and linear attention, in the regime where it
// holds, to the tolerance policy of docs/numerics.md through
// `expect_within_policy` below: |fast - ref| <= 2 |naive - ref| +
// u_out max|ref| (+ a documented floor).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "attention_checks.hpp"
#include "core/elements.hpp"
#include "qkv/qkv.hpp"
#include "test_util.hpp"

namespace qkv::fuzz {

using test::max_abs;
using test::unit_roundoff;

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr std::int64_t kMax64 = std::numeric_limits<std::int64_t>::max();

// ------------------------------------------------------------- findings --

// Reports a finding and aborts, which libFuzzer records as a crash input.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "\n==qkv-fuzz== FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

// Failed EXPECTs of the shared test helpers (attention_checks.hpp) become
// findings: the fuzzers run no test, so gtest records them as ad-hoc results
// and tells its listeners.
class AbortOnFailure : public testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    finding(std::string(result.file_name() != nullptr ? result.file_name() : "?") + ":" +
            std::to_string(result.line_number()) + ": " + result.summary());
  }
};

// Called once by libFuzzer before the first input (every target is one
// translation unit that includes this header).
inline void initialize() {
  testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new AbortOnFailure);
}

// Runs an entry point: true when it returned, false when it threw qkv::Error;
// any other exception is a finding.
template <class F>
bool accepted(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    finding(std::string(what) +
            ": an exception other than qkv::Error escaped: " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    finding(std::string(what) + ": a non-standard exception escaped");
  }
}

// ---------------------------------------------------------------- files --

// An in-memory file with a path (/proc/self/fd/N), rewritten per input: the
// file readers' input.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(memfd_create(name, 0)) {
    if (fd_ < 0) finding("memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  ~MemFile() { close(fd_); }

  void write(const std::uint8_t* data, std::size_t size) const {
    require(ftruncate(fd_, 0) == 0, "ftruncate failed");
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      require(n > 0, "pwrite failed");
      done += static_cast<std::size_t>(n);
    }
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

// Same dtype, shape and bits (what a file round trip must preserve).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.rank() != b.rank()) return false;
  for (int d = 0; d < a.rank(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  const std::size_t bytes = static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype());
  return bytes == 0 || std::memcmp(a.view().data(), b.view().data(), bytes) == 0;
}

// ------------------------------------------------------------- decoding --

// Small deterministic generator for the bulk of tensor values, seeded from
// the input, so that inputs stay short.
class SplitMix {
 public:
  explicit SplitMix(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  double symmetric() { return static_cast<double>(next() >> 11) * 0x1p-52 - 1.0; }

 private:
  std::uint64_t state_;
};

// The fuzz input, read front to back. Exhausted input reads as zeros, which
// every helper maps to its first (plainest) choice.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : fdp_(data, size) {}

  FuzzedDataProvider& fdp() { return fdp_; }
  bool coin() { return fdp_.ConsumeBool(); }
  // True with probability about 1 / n.
  bool one_in(int n) { return fdp_.ConsumeIntegralInRange<int>(0, n - 1) == n - 1; }
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    return fdp_.ConsumeIntegralInRange<std::int64_t>(lo, hi);
  }
  template <class T, std::size_t N>
  T pick(const T (&items)[N]) {
    return fdp_.PickValueInArray(items);
  }
  std::uint64_t u64() { return fdp_.ConsumeIntegral<std::uint64_t>(); }
  // A size: mostly 0..small, sometimes up to `large`.
  std::int64_t size(std::int64_t small, std::int64_t large) {
    return one_in(8) ? range(0, large) : range(1, small);
  }
  // Integers that break arithmetic: int64 limits, powers of two, -1, -2.
  std::int64_t extreme_int() {
    static constexpr std::int64_t kValues[] = {0,
                                               1,
                                               -1,
                                               -2,
                                               2,
                                               kMax64,
                                               kMax64 - 1,
                                               kMax64 / 2,
                                               kMax64 / 4 + 1,
                                               std::numeric_limits<std::int64_t>::min(),
                                               std::int64_t{1} << 31,
                                               std::int64_t{1} << 32,
                                               (std::int64_t{1} << 32) + 1,
                                               std::int64_t{1} << 62,
                                               3037000500,  // about sqrt(2^63)
                                               65536};
    return pick(kValues);
  }
  // A parameter that is usually small and sometimes extreme.
  std::int64_t param(std::int64_t lo, std::int64_t hi) {
    return one_in(10) ? extreme_int() : range(lo, hi);
  }
  // Doubles at the edges of float and double.
  double extreme_real() {
    static constexpr double kValues[] = {0.0,
                                         -0.0,
                                         1e-300,
                                         std::numeric_limits<double>::denorm_min(),
                                         1e-46,
                                         1e-39,
                                         std::numeric_limits<float>::min(),
                                         1e-7,
                                         1e7,
                                         std::numeric_limits<float>::max(),
                                         1e39,
                                         1e300,
                                         std::numeric_limits<double>::max(),
                                         kInf,
                                         -kInf,
                                         kNaN,
                                         -1.0,
                                         -1e39};
    return pick(kValues);
  }

 private:
  FuzzedDataProvider fdp_;
};

// ------------------------------------------------------ tensors (Arg) --

// Sentinel element bit patterns: quiet NaNs with a payload no computation
// produces, so that an element left unwritten or read from a gap shows up.
inline void fill_sentinel(std::byte* data, std::size_t bytes, DType dtype) {
  const std::size_t elem = dtype_size(dtype);
  const std::uint64_t pattern = dtype == DType::f64    ? 0x7FF4A5A5A5A5A5A5ULL
                                : dtype == DType::f32  ? 0x7FA5A5A5ULL
                                : dtype == DType::f16  ? 0x7DA5ULL
                                : dtype == DType::bf16 ? 0x7FA5ULL
                                                       : 0xA5ULL;
  for (std::size_t i = 0; i + elem <= bytes; i += elem) std::memcpy(data + i, &pattern, elem);
}

// Exactly-sized heap memory (so that ASan sees a read one past the end).
struct Storage {
  explicit Storage(std::size_t n) : bytes(n), data(new std::byte[std::max<std::size_t>(n, 1)]) {}
  std::size_t bytes;
  std::unique_ptr<std::byte[]> data;
  std::vector<std::byte> snapshot() const { return {data.get(), data.get() + bytes}; }
  bool same_as(const std::vector<std::byte>& s) const {
    return s.size() == bytes && (bytes == 0 || std::memcmp(s.data(), data.get(), bytes) == 0);
  }
};

// A tensor argument: the view a call sees and the memory behind it, filled
// with the dtype's sentinel outside the view's elements.
struct Arg {
  std::shared_ptr<Storage> storage;  // null for undefined or null-data views
  TensorView view;
  bool finite = true;    // no NaN or infinity among the view's elements
  bool aliased = false;  // shares memory with another argument by construction
  // Values from a structured pattern (ties, small integers, mostly zeros, all
  // zero), on which a naive computation may round far less than on random
  // data.
  bool structured = false;

  operator TensorView() const { return view; }       // NOLINT: implicit by design
  operator ConstTensorView() const { return view; }  // NOLINT: implicit by design
  ConstTensorView cview() const { return view; }
};

// How a view's elements lie in memory.
enum class Layout : std::uint8_t {
  contiguous,
  permuted,     // a transposed view of a contiguous buffer
  padded,       // gaps between rows and elements
  offset,       // starts inside its buffer
  broadcast,    // some strides 0 (inputs only)
  overlapping,  // strides that revisit elements (inputs only)
};

// Strides for `sizes` in `layout`; returns the elements the buffer needs and
// the view's first element.
struct Placement {
  Shape strides{};
  std::int64_t first = 0;
  std::int64_t extent = 0;  // elements of the buffer
};

inline Placement place(Input& in, std::span<const std::int64_t> sizes, Layout layout) {
  Placement p;
  const int rank = static_cast<int>(sizes.size());
  std::array<int, kMaxRank> order{0, 1, 2, 3};  // dims from outermost to innermost in memory
  if (layout == Layout::permuted) {
    for (int d = rank - 1; d > 0; --d) std::swap(order[d], order[in.range(0, d)]);
  }
  std::int64_t stride = layout == Layout::padded ? in.range(1, 3) : 1;
  for (int pos = rank - 1; pos >= 0; --pos) {
    const int d = order[pos];
    p.strides[d] = stride;
    stride *= std::max<std::int64_t>(sizes[d], 1);
    if (layout == Layout::padded) stride += in.range(0, 3);
  }
  if (layout == Layout::broadcast || layout == Layout::overlapping) {
    for (int d = 0; d < rank; ++d) {
      if (in.coin()) p.strides[d] = layout == Layout::broadcast ? 0 : in.range(0, 2);
    }
  }
  if (layout == Layout::offset) p.first = in.range(1, 5);
  std::int64_t last = p.first;
  bool empty = false;
  for (int d = 0; d < rank; ++d) {
    empty = empty || sizes[d] == 0;
    last += (sizes[d] - 1) * p.strides[d];
  }
  p.extent = empty ? p.first : last + 1;
  if (layout == Layout::padded) p.extent += in.range(0, 3);
  return p;
}

// What the values of a tensor look like.
struct Values {
  double magnitude = 1.5;  // values in [-magnitude, magnitude]
  bool specials = false;   // may also hold NaN (and infinities when `infinities`)
  bool infinities = false;
  bool positive = false;  // [0, magnitude] (lengths, variances)
};

// Picks a value regime: mostly moderate values, sometimes large ones,
// structured ones (ties, zeros), or a few NaNs and infinities.
inline Values values(Input& in, bool allow_specials, double large = 1e4) {
  Values v;
  static constexpr double kMagnitudes[] = {1.5, 0.5, 3.0, 8.0, 1.0, 0.0};
  v.magnitude = in.one_in(8) ? large : in.pick(kMagnitudes);
  v.specials = allow_specials && in.one_in(12);
  return v;
}

// Writes values into every element of the view (a stride-0 or overlapping
// view gets the last value written to each element).
inline void fill_values(Input& in, Arg& a, const Values& v) {
  if (!a.view.defined() || a.view.data() == nullptr) return;
  SplitMix gen(in.u64());
  const int pattern = static_cast<int>(in.range(0, 7));
  a.structured = pattern >= 5 || v.magnitude == 0.0;
  const double constant = v.magnitude * gen.symmetric();
  detail::for_each_index(a.view.sizes(), a.view.rank(), [&](const Shape& idx) {
    double x = v.magnitude * gen.symmetric();
    switch (pattern) {
      case 5:  // ties
        x = constant;
        break;
      case 6:  // small integers
        x = std::round(x);
        break;
      case 7:  // mostly zeros
        x = gen.next() % 4 == 0 ? x : 0.0;
        break;
      default:
        break;
    }
    if (v.positive) x = std::fabs(x);
    detail::store(a.view.data(), a.view.dtype(),
                  detail::offset(idx, a.view.strides(), a.view.rank()), x);
  });
  if (!v.specials || a.view.numel() == 0) return;
  const std::int64_t count = in.range(1, 3);
  for (std::int64_t c = 0; c < count; ++c) {
    Shape idx{};
    for (int d = 0; d < a.view.rank(); ++d) idx[d] = in.range(0, a.view.size(d) - 1);
    const double special = v.infinities && in.coin() ? (in.coin() ? kInf : -kInf) : kNaN;
    detail::store(a.view.data(), a.view.dtype(),
                  detail::offset(idx, a.view.strides(), a.view.rank()), special);
    a.finite = false;
  }
}

// A fresh argument of the given sizes and dtype in `layout`, its buffer
// filled with the sentinel (values are written by fill_values).
inline Arg make_arg(Input& in, std::span<const std::int64_t> sizes, DType dtype, Layout layout) {
  const Placement p = place(in, sizes, layout);
  Arg a;
  a.storage = std::make_shared<Storage>(static_cast<std::size_t>(p.extent) * dtype_size(dtype));
  fill_sentinel(a.storage->data.get(), a.storage->bytes, dtype);
  std::byte* first = a.storage->data.get() + p.first * static_cast<std::int64_t>(dtype_size(dtype));
  a.view = TensorView(first, dtype, sizes,
                      std::span<const std::int64_t>(p.strides.data(), sizes.size()));
  return a;
}

// An input: any layout (broadcast and overlapping included), values filled.
inline Arg make_input(Input& in, std::span<const std::int64_t> sizes, DType dtype,
                      const Values& v) {
  static constexpr Layout kLayouts[] = {Layout::contiguous, Layout::contiguous, Layout::permuted,
                                        Layout::padded,     Layout::offset,     Layout::broadcast,
                                        Layout::overlapping};
  Arg a = make_arg(in, sizes, dtype, in.pick(kLayouts));
  fill_values(in, a, v);
  return a;
}
inline Arg make_input(Input& in, std::initializer_list<std::int64_t> sizes, DType dtype,
                      const Values& v) {
  return make_input(in, std::span<const std::int64_t>(sizes.begin(), sizes.size()), dtype, v);
}

// An output: layouts whose elements are distinct, sentinel everywhere.
inline Arg make_output(Input& in, std::span<const std::int64_t> sizes, DType dtype) {
  static constexpr Layout kLayouts[] = {Layout::contiguous, Layout::contiguous, Layout::permuted,
                                        Layout::padded, Layout::offset};
  return make_arg(in, sizes, dtype, in.pick(kLayouts));
}
inline Arg make_output(Input& in, std::initializer_list<std::int64_t> sizes, DType dtype) {
  return make_output(in, std::span<const std::int64_t>(sizes.begin(), sizes.size()), dtype);
}

// Raw bad views: what validation must reject whatever else the call holds.
enum class BadView : std::uint8_t { none, undefined, null_data, overflow, self_overlap };

// Replaces `a` by a bad view of its kind (self_overlap: a stride-0 dimension
// of size > 1, which outputs must not have; inputs may, so it is not bad for
// them). Overflowing extents never point at memory that could be read.
inline void make_bad(Input& in, Arg& a, BadView bad) {
  if (bad == BadView::none || !a.view.defined()) return;
  const DType dtype = a.view.dtype();
  const int rank = a.view.rank();
  Shape sizes = a.view.sizes(), strides = a.view.strides();
  switch (bad) {
    case BadView::none:
      return;
    case BadView::undefined:
      a.view = TensorView();
      a.storage.reset();
      return;
    case BadView::null_data:
      a.view = TensorView(nullptr, dtype, a.view.size_span(), a.view.stride_span());
      a.storage.reset();
      return;
    case BadView::overflow: {
      // Sizes whose element count or last byte offset exceeds int64.
      if (rank == 0) return;
      const int d = static_cast<int>(in.range(0, rank - 1));
      sizes[d] = in.coin() ? kMax64 : (std::int64_t{1} << 62);
      strides[d] = in.coin() ? strides[d] + 1 : kMax64 / 2;
      const int e = (d + 1) % rank;
      if (rank > 1 && sizes[e] < 2) sizes[e] = 2;
      a.view = TensorView(a.view.data(), dtype, std::span<const std::int64_t>(sizes.data(), rank),
                          std::span<const std::int64_t>(strides.data(), rank));
      return;
    }
    case BadView::self_overlap: {
      for (int d = 0; d < rank; ++d) {
        if (sizes[d] > 1) {
          strides[d] = 0;
          a.view = TensorView(a.view.data(), dtype, a.view.size_span(),
                              std::span<const std::int64_t>(strides.data(), rank));
          a.aliased = true;
          return;
        }
      }
      return;
    }
  }
}

inline BadView bad_view(Input& in) {
  static constexpr BadView kBad[] = {BadView::undefined, BadView::null_data, BadView::overflow,
                                     BadView::self_overlap};
  return in.pick(kBad);
}

// Points `out` into the memory of `input` (same dtype and sizes needed):
// validation must reject it.
inline void alias_into(Arg& out, const Arg& input) {
  if (&out == &input) return;  // a view does not alias itself
  if (!input.storage || !out.view.defined() || input.view.dtype() != out.view.dtype()) return;
  if (out.view.numel() == 0 || input.view.numel() == 0) return;
  // Byte ranges of views whose extent passes int64 (made bad on purpose) are
  // not defined.
  if (input.view.data() == nullptr || !detail::extent_fits(input.view) ||
      !detail::extent_fits(out.view)) {
    return;
  }
  const std::size_t need = static_cast<std::size_t>(detail::byte_range(out.view).end -
                                                    detail::byte_range(out.view).begin);
  if (need > input.storage->bytes) return;
  const auto shift =
      reinterpret_cast<std::uintptr_t>(out.view.data()) - detail::byte_range(out.view).begin;
  const TensorView moved(input.storage->data.get() + shift, out.view.dtype(), out.view.size_span(),
                         out.view.stride_span());
  // Only memory the input's view covers counts: an input that starts inside
  // its buffer (or has gaps) may leave the moved view beside it.
  if (!detail::byte_range(moved).overlaps(detail::byte_range(input.view))) return;
  out.view = moved;
  out.storage = input.storage;
  out.aliased = true;
}

// ----------------------------------------------------------- snapshots --

// Every byte of a set of arguments' buffers, to show that a call changed
// nothing (inputs always; outputs when it threw).
class Snapshot {
 public:
  Snapshot() = default;
  explicit Snapshot(std::initializer_list<const Arg*> args) {
    for (const Arg* a : args) add(*a);
  }
  void add(const Arg& a) {
    if (a.storage) saved_.emplace_back(a.storage, a.storage->snapshot());
  }
  bool unchanged() const {
    return std::all_of(saved_.begin(), saved_.end(),
                       [](const auto& s) { return s.first->same_as(s.second); });
  }
  void require_unchanged(const std::string& what) const {
    require(unchanged(), what + " changed memory it must not write");
  }

 private:
  std::vector<std::pair<std::shared_ptr<Storage>, std::vector<std::byte>>> saved_;
};

// True when every byte of the output's buffer outside its elements still
// holds the sentinel (a call wrote only where the view points).
inline bool gaps_untouched(const Arg& out) {
  if (!out.storage || !out.view.defined()) return true;
  std::vector<bool> inside(out.storage->bytes, false);
  const std::size_t elem = dtype_size(out.view.dtype());
  const auto base = reinterpret_cast<std::uintptr_t>(out.storage->data.get());
  const auto first = reinterpret_cast<std::uintptr_t>(out.view.data()) - base;
  detail::for_each_index(out.view.sizes(), out.view.rank(), [&](const Shape& idx) {
    const std::size_t at =
        first +
        static_cast<std::size_t>(detail::offset(idx, out.view.strides(), out.view.rank())) * elem;
    for (std::size_t b = 0; b < elem && at + b < inside.size(); ++b) inside[at + b] = true;
  });
  Storage pristine(out.storage->bytes);
  fill_sentinel(pristine.data.get(), pristine.bytes, out.view.dtype());
  for (std::size_t b = 0; b < inside.size(); ++b) {
    if (!inside[b] && pristine.data[b] != out.storage->data[b]) return false;
  }
  return true;
}

// ------------------------------------------------------------- checks --

// Whether every element is finite; `allow_neg_inf` admits -inf (lse).
inline bool all_finite(ConstTensorView t, bool allow_neg_inf = false) {
  if (!t.defined()) return true;
  bool ok = true;
  detail::for_each_index(t.sizes(), t.rank(), [&](const Shape& idx) {
    const double x = detail::load(t.data(), t.dtype(), detail::offset(idx, t.strides(), t.rank()));
    ok = ok && (std::isfinite(x) || (allow_neg_inf && x == -kInf));
  });
  return ok;
}

inline void require_finite(ConstTensorView t, const std::string& what, bool allow_neg_inf = false) {
  if (!all_finite(t, allow_neg_inf)) {
    finding(what + ": NaN or infinity from finite inputs and options");
  }
}

// Element-wise equality (NaN equals NaN; +0 equals -0) of two views of the
// same sizes.
inline bool same_values(ConstTensorView a, ConstTensorView b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.rank() != b.rank() || a.size_span().size() != b.size_span().size()) return false;
  for (int d = 0; d < a.rank(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  bool same = true;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    const double x = detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank()));
    const double y = detail::load(b.data(), b.dtype(), detail::offset(idx, b.strides(), b.rank()));
    same = same && (x == y || (std::isnan(x) && std::isnan(y)));
  });
  return same;
}

// The tolerance policy of docs/numerics.md for one result of a fast path
// without an attention_checks.hpp helper: ref is computed from the inputs in
// double, naive in the input precision; `floor` adds a documented
// cancellation bound (0 when none applies).
inline void expect_within_policy(ConstTensorView fast, ConstTensorView ref, ConstTensorView naive,
                                 DType out_dtype, double floor, const std::string& label) {
  int mismatches = 0;
  const double err_fast = test::finite_diff(fast, ref, &mismatches);
  const double err_naive = test::finite_diff(naive, ref, &mismatches);
  const double bound = 2 * err_naive + unit_roundoff(out_dtype) * max_abs(ref) + floor;
  EXPECT_LE(err_fast, bound) << label << ": fast error " << err_fast << ", naive " << err_naive
                             << ", bound " << bound;
  EXPECT_EQ(mismatches, 0) << label << ": infinities or NaNs differ from the reference";
}

// Total elements a problem touches, to keep reference checks cheap.
inline bool small_enough(std::initializer_list<std::int64_t> dims, std::int64_t limit) {
  std::int64_t work = 1;
  for (const std::int64_t d : dims) {
    if (d > 0 && work > limit / d) return false;
    work *= std::max<std::int64_t>(d, 1);
  }
  return work <= limit;
}

// Sets the OpenMP thread count of the next calls (results must not depend
// on it).
inline void fuzz_threads(Input& in) { omp_set_num_threads(static_cast<int>(in.range(1, 3))); }

inline DType floating_dtype(Input& in) {
  static constexpr DType kTypes[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::f64};
  return in.pick(kTypes);
}

// Any DType value, out-of-range ones (casts from integers) included.
inline DType any_dtype(Input& in) { return static_cast<DType>(in.range(0, 7)); }

// ------------------------------------------------- attention problems --

// The score_mod / mask_mod menu (FlexAttention-style callables). Score
// entries >= kScoreModsFinite produce NaN scores themselves.
inline constexpr int kScoreMods = 7;
inline constexpr int kScoreModsFinite = 6;
inline constexpr int kMaskMods = 6;

inline float score_mod_menu(int id, float s, std::int64_t b, std::int64_t h, std::int64_t i,
                            std::int64_t j) {
  switch (id) {
    case 0:
      return s * 0.5f;
    case 1:
      return s - 0.25f * static_cast<float>(i > j ? i - j : j - i);
    case 2:
      return j > i ? -std::numeric_limits<float>::infinity() : s;
    case 3:
      return s + 0.1f * static_cast<float>(h + 1) - 0.05f * static_cast<float>(b);
    case 4:
      return 3.0f * std::tanh(s);
    case 5:
      return -std::numeric_limits<float>::infinity();
    default:
      return (i + j) % 5 == 0 ? std::numeric_limits<float>::quiet_NaN() : s;
  }
}

// What the finite menu entries do to a score, for the worst-case bound:
// 3 tanh(s) is 3-Lipschitz, the others 1; each adds at most 0.25 |i - j|,
// 0.1 (h + 1) + 0.05 b or 3 and rounds at most four times.
inline test::ScoreModBound score_mod_bound(int id, std::int64_t batch, std::int64_t hq,
                                           std::int64_t nq, std::int64_t nk) {
  if (id < 0) return {};
  const double offset =
      std::max({0.25 * static_cast<double>(nq + nk),
                0.1 * static_cast<double>(hq + 1) + 0.05 * static_cast<double>(batch), 3.0});
  return {3.0, offset, 4.0};
}

inline bool mask_mod_menu(int id, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  switch (id) {
    case 0:
      return true;
    case 1:
      return j <= i;
    case 2:
      return i / 4 == j / 4;
    case 3:
      return (b + h + i + j) % 3 != 0;
    case 4:
      return false;
    default:
      return j % 2 == 0;
  }
}

// One fuzzed attention call: shapes, tensors and options, with the storage
// the options' spans and views point into (so it is neither copied nor
// moved), and what the checks may expect of it.
struct AttentionCase {
  AttentionCase() = default;
  AttentionCase(const AttentionCase&) = delete;
  AttentionCase& operator=(const AttentionCase&) = delete;

  DType dtype = DType::f32;
  std::int64_t batch = 1, nq = 1, nk = 1, hq = 1, hkv = 1, dq = 1, dk = 1, dv = 1;
  std::vector<std::int64_t> key_lengths, cu_q, cu_k;
  std::vector<float> slopes, sinks, scales;
  Arg q, k, v, mask, w_q, w_k, add_v, add_bias, table;
  AttentionOptions opt;
  double qk_magnitude = 0.0;  // largest |q|, |k| the values were drawn with
  double v_magnitude = 0.0;   // largest |v|
  int score_mod = -1;         // menu entries, -1 for none
  int mask_mod = -1;
  bool flex = false;  // through flex_attention (else the std::function options)

  // Finite inputs and options: every result must be finite (lse may be -inf).
  bool finite_expected = true;
  // Finite inputs, and results inside the formats: the fast path is
  // compared with the reference (error_bound.hpp's worst-case bounds).
  bool comparable = true;
  // Why validation must reject the call (empty when it may accept it).
  std::string must_reject;
  std::string text;  // a description for findings

  void reject(const std::string& why) {
    if (must_reject.empty()) must_reject = why;
  }
  void note(const std::string& what) { text += what + " "; }
  // The call's inputs, for snapshots.
  std::vector<const Arg*> inputs() const {
    return {&q, &k, &v, &mask, &w_q, &w_k, &add_v, &add_bias, &table};
  }
  // The options with the menu callables as std::function (what
  // flex_attention passes the reference, and what the helpers take).
  AttentionOptions function_options() const {
    AttentionOptions o = opt;
    if (score_mod >= 0) {
      o.score_mod = [id = score_mod](double s, std::int64_t b, std::int64_t h, std::int64_t i,
                                     std::int64_t j) {
        return static_cast<double>(score_mod_menu(id, static_cast<float>(s), b, h, i, j));
      };
    }
    if (mask_mod >= 0) {
      o.mask_mod = [id = mask_mod](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
        return mask_mod_menu(id, b, h, i, j);
      };
    }
    return o;
  }
  bool inputs_finite() const {
    return q.finite && k.finite && v.finite && mask.finite && table.finite;
  }
  bool runs_fast() const {
    return opt.backend == Backend::fast ||
           (opt.backend == Backend::automatic && dtype != DType::f64);
  }
};

// Per-sequence lengths (varlen) or the dense batch.
inline void fuzz_sequences(Input& in, AttentionCase& c) {
  if (!in.one_in(6)) return;
  const std::int64_t s_count = in.range(1, 4);
  c.cu_q.assign(1, 0);
  c.cu_k.assign(1, 0);
  for (std::int64_t s = 0; s < s_count; ++s) {
    c.cu_q.push_back(c.cu_q.back() + in.range(0, 12));
    c.cu_k.push_back(c.cu_k.back() + in.range(0, 12));
  }
  c.batch = 1;
  c.nq = c.cu_q.back();
  c.nk = c.cu_k.back();
  c.note("varlen S=" + std::to_string(s_count));
  if (in.one_in(12)) {
    // Offsets that do not describe the tensors: a first offset other than
    // 0, a decrease, a last offset past the rows, or counts that differ.
    auto& cu = in.coin() ? c.cu_q : c.cu_k;
    switch (in.range(0, 3)) {
      case 0:
        cu[0] = in.coin() ? 1 : in.extreme_int();
        if (cu[0] == 0) cu[0] = -1;
        break;
      case 1:
        cu.push_back(cu.back() - 1);
        cu.push_back(cu.back() + 1);
        (&cu == &c.cu_q ? c.cu_k : c.cu_q).push_back(0);
        break;
      case 2:
        cu.back() += in.coin() ? 1 : kMax64 / 2;
        break;
      default:
        cu.push_back(cu.back());
        break;
    }
    c.reject("corrupted cu_seqlens");
  }
  c.opt.cu_seqlens_q = c.cu_q;
  c.opt.cu_seqlens_k = c.cu_k;
}

inline std::int64_t sequences(const AttentionCase& c) {
  return c.cu_q.empty() ? c.batch : static_cast<std::int64_t>(c.cu_q.size()) - 1;
}
// The longest query and key rows of a sequence (block layouts must cover them).
inline std::pair<std::int64_t, std::int64_t> longest_sequence(const AttentionCase& c) {
  if (c.cu_q.empty()) return {c.nq, c.nk};
  std::int64_t lq = 0, lk = 0;
  for (std::size_t s = 0; s + 1 < c.cu_q.size() && s + 1 < c.cu_k.size(); ++s) {
    lq = std::max(lq, c.cu_q[s + 1] - c.cu_q[s]);
    lk = std::max(lk, c.cu_k[s + 1] - c.cu_k[s]);
  }
  return {lq, lk};
}

// A block layout over `rows` x `keys`, sometimes with extreme dimensions
// whose product wraps around.
inline BlockLayout fuzz_layout(Input& in, const AttentionCase& c) {
  const auto [rows, keys] = longest_sequence(c);
  BlockLayout l;
  l.heads = in.coin() ? 1 : c.hq;
  l.block_size = in.param(1, 16);
  const std::int64_t bs = std::max<std::int64_t>(l.block_size, 1);
  l.q_blocks = rows / bs + (rows % bs != 0) + in.range(0, 1);
  l.k_blocks = keys / bs + (keys % bs != 0) + in.range(0, 1);
  std::uint64_t cells = 0;
  if (in.one_in(8)) {
    l.heads = in.extreme_int();
    l.q_blocks = in.extreme_int();
    l.k_blocks = in.coin() ? in.extreme_int() : l.k_blocks;
    // The product as it wraps in 64 bits (what a missing overflow check sees).
    cells = static_cast<std::uint64_t>(l.heads) * static_cast<std::uint64_t>(l.q_blocks) *
            static_cast<std::uint64_t>(l.k_blocks);
    if (cells > 4096) cells = 1;
  } else {
    // Blocks of huge packed sequences (extreme offsets) would need more
    // bits than memory holds: give a short vector, which must be rejected.
    std::int64_t product = 0;
    const bool overflow = __builtin_mul_overflow(l.heads, l.q_blocks, &product) ||
                          __builtin_mul_overflow(product, l.k_blocks, &product);
    cells =
        overflow || product < 0 || product > (1 << 20) ? 1 : static_cast<std::uint64_t>(product);
  }
  SplitMix gen(in.u64());
  const std::uint64_t density = static_cast<std::uint64_t>(in.range(0, 4));
  l.bits.resize(cells);
  for (auto& bit : l.bits) bit = static_cast<std::uint8_t>(gen.next() % 4 < density);
  return l;
}

// A sparse pattern (factories that reject their parameters leave it off).
inline SparsePattern fuzz_pattern(Input& in, const AttentionCase& c, int depth) {
  const std::int64_t rows = longest_sequence(c).first, keys = longest_sequence(c).second;
  SparsePattern p;
  const std::int64_t kind = in.range(0, depth < 2 ? 8 : 7);
  accepted("sparse pattern factory", [&] {
    switch (kind) {
      case 0:
        p = SparsePattern::window(in.param(-1, 12), in.param(-1, 12));
        break;
      case 1:
        p = SparsePattern::dilated_window(in.param(0, 12), in.param(0, 12), in.param(1, 4));
        break;
      case 2:
        p = SparsePattern::strided(in.param(1, 8));
        break;
      case 3: {
        const std::int64_t block = in.param(1, 8);
        p = SparsePattern::fixed(
            block, in.coin() ? in.range(0, std::max<std::int64_t>(block, 0)) : in.extreme_int());
        break;
      }
      case 4: {
        std::vector<std::int64_t> tokens;
        for (std::int64_t t = in.range(0, 4); t > 0; --t) tokens.push_back(in.param(0, keys));
        p = SparsePattern::global_tokens(std::move(tokens));
        break;
      }
      case 5:
        p = SparsePattern::block_sparse(fuzz_layout(in, c));
        break;
      case 6: {
        BigBirdConfig b;
        b.heads = in.coin() ? 1 : c.hq;
        b.nq = rows;
        b.nk = keys;
        b.block_size = in.param(1, 8);
        b.window_blocks = in.param(0, 3);
        b.global_blocks = in.param(0, 2);
        b.random_blocks = in.param(0, 3);
        b.seed = in.u64();
        // Layouts of more than 2^24 blocks that fit int64 are valid but
        // take memory the fuzzer does not have (bigbird_layout refuses those
        // beyond the machine's memory): leave them out.
        const std::int64_t bs = std::max<std::int64_t>(b.block_size, 1);
        const double blocks = static_cast<double>(b.heads) *
                              std::ceil(static_cast<double>(b.nq) / bs) *
                              std::ceil(static_cast<double>(b.nk) / bs);
        if (blocks > 0x1p24 && blocks < 0x1p62) break;
        p = SparsePattern::block_sparse(bigbird_layout(b));
        break;
      }
      case 7:
        p = in.coin() ? SparsePattern::prefix(in.param(-1, keys + 1))
                      : SparsePattern::prefix_lm(in.param(-1, keys + 1));
        break;
      default: {
        const SparsePattern a = fuzz_pattern(in, c, depth + 1);
        const SparsePattern b = fuzz_pattern(in, c, depth + 1);
        p = in.coin() ? (a | b) : (a & b);
        break;
      }
    }
  });
  return p;
}

// The mask: bool or float, rank 0 to 4, each dimension full or broadcast.
inline void fuzz_mask(Input& in, AttentionCase& c) {
  const int rank = static_cast<int>(in.range(0, 4));
  const std::int64_t full[4] = {c.batch, c.hq, c.nq, c.nk};
  std::vector<std::int64_t> sizes;
  for (int d = 0; d < rank; ++d) sizes.push_back(in.coin() ? full[4 - rank + d] : 1);
  if (rank > 0 && in.one_in(16)) {
    // Neither 1 nor the full size.
    const auto d = static_cast<std::size_t>(in.range(0, rank - 1));
    sizes[d] = std::max<std::int64_t>(full[4 - rank + static_cast<int>(d)] + in.range(1, 2), 2);
    c.reject("mask that does not broadcast");
  }
  const bool boolean = in.coin();
  const Values v = values(in, !boolean, 30.0);
  c.mask = make_input(in, sizes, boolean ? DType::boolean : floating_dtype(in), v);
  if (boolean && c.mask.view.data() != nullptr) {
    // Bits at a fuzzed density.
    SplitMix gen(in.u64());
    const std::uint64_t density = static_cast<std::uint64_t>(in.range(0, 8));
    detail::for_each_index(c.mask.view.sizes(), rank, [&](const Shape& idx) {
      detail::store(c.mask.view.data(), DType::boolean,
                    detail::offset(idx, c.mask.view.strides(), rank), gen.next() % 8 < density);
    });
  } else if (c.mask.view.numel() > 0) {
    // Some -inf (dropped keys), which is not a non-finite input.
    for (std::int64_t n = in.range(0, 6); n > 0; --n) {
      Shape idx{};
      for (int d = 0; d < rank; ++d) idx[d] = in.range(0, c.mask.view.size(d) - 1);
      detail::store(c.mask.view.data(), c.mask.view.dtype(),
                    detail::offset(idx, c.mask.view.strides(), rank), -kInf);
    }
  }
  c.opt.mask = c.mask.view;
  c.note(std::string(boolean ? "bool" : "float") + " mask rank " + std::to_string(rank));
  // Its gradient asked (only a float mask has one).
  if (in.one_in(boolean ? 16 : 2)) {
    c.opt.mask_requires_grad = true;
    c.note("mask_requires_grad");
    if (boolean) c.reject("mask_requires_grad with a bool mask");
  }
}

// The additive score's parameters (A may be 0).
inline void fuzz_additive(Input& in, AttentionCase& c) {
  c.opt.score = Score::additive;
  const std::int64_t a = in.range(0, 8);
  const DType pd = floating_dtype(in);
  const Values v = values(in, false, 30.0);
  c.w_q = make_input(in, {a, c.dq}, pd, v);
  c.w_k = make_input(in, {a, c.dk}, pd, v);
  c.add_v = make_input(in, {a}, pd, v);
  c.opt.additive = {c.w_q.view, c.w_k.view, c.add_v.view, {}};
  if (in.coin()) {
    c.add_bias = make_input(in, {a}, pd, v);
    c.opt.additive.bias = c.add_bias.view;
  }
  c.note("additive A=" + std::to_string(a));
}

// The scale: mostly unset or moderate, sometimes at the edges of float.
inline void fuzz_scale(Input& in, AttentionCase& c) {
  static constexpr double kScales[] = {1.0, 0.5, 0.0, -1.0, 2.0, 10.0, 1e-3, 100.0};
  const double s = in.one_in(6) ? in.extreme_real() : in.pick(kScales);
  c.opt.scale = s;
  if (!std::isfinite(s) || c.opt.score != Score::scaled_dot) {
    c.reject("scale " + std::to_string(s) + " with score " +
             std::to_string(static_cast<int>(c.opt.score)));
  }
  if (std::fabs(s) > 1e3) c.finite_expected = c.comparable = false;  // scores beyond f32
  c.note("scale=" + std::to_string(s));
}

inline void fuzz_softcap(Input& in, AttentionCase& c) {
  static constexpr double kCaps[] = {1.0, 5.0, 30.0, 0.5, 1e-3};
  const double cap = in.one_in(4) ? in.extreme_real() : in.pick(kCaps);
  c.opt.softcap = cap;
  if (!(cap >= 0.0) || !std::isfinite(cap)) c.reject("softcap " + std::to_string(cap));
  // Caps outside float's range are valid options; only the naive f32
  // computation cannot represent them.
  if (cap != 0.0 && (cap < 1e-30 || cap > 1e30)) c.comparable = false;
  c.note("softcap=" + std::to_string(cap));
}

inline void fuzz_alibi(Input& in, AttentionCase& c) {
  const std::int64_t n = in.coin() ? c.hq : sequences(c) * c.hq;
  SplitMix gen(in.u64());
  for (std::int64_t h = 0; h < n; ++h) c.slopes.push_back(static_cast<float>(gen.symmetric()));
  if (in.one_in(6) && !c.slopes.empty()) {
    const double x = in.extreme_real();
    c.slopes[static_cast<std::size_t>(in.range(0, n - 1))] = static_cast<float>(x);
    if (!std::isfinite(static_cast<float>(x))) c.reject("non-finite ALiBi slope");
    if (std::fabs(x) > 1e3) c.finite_expected = c.comparable = false;
  }
  if (in.one_in(16)) {
    // Neither Hq nor B * Hq slopes.
    c.slopes.resize(static_cast<std::size_t>(c.hq + sequences(c) * c.hq + 1), 0.5f);
    c.reject("ALiBi slope count");
  }
  c.opt.alibi_slopes = c.slopes;
  c.note("alibi x" + std::to_string(c.slopes.size()));
}

// Learned sinks: a logit per query head (-inf = none for that head), and
// now and then a NaN, +inf or a wrong count that validation must refuse.
inline void fuzz_sinks(Input& in, AttentionCase& c) {
  SplitMix gen(in.u64());
  for (std::int64_t h = 0; h < c.hq; ++h) {
    c.sinks.push_back(in.one_in(5) ? -std::numeric_limits<float>::infinity()
                                   : static_cast<float>(4 * gen.symmetric()));
  }
  if (in.one_in(8)) {
    const float bad = in.coin() ? std::numeric_limits<float>::quiet_NaN()
                                : std::numeric_limits<float>::infinity();
    c.sinks[static_cast<std::size_t>(in.range(0, c.hq - 1))] = bad;
    c.reject("sink NaN or +inf");
  }
  if (in.one_in(12)) {
    c.sinks.push_back(0.0f);
    c.reject("sink count");
  }
  c.opt.sinks = c.sinks;
  c.note("sinks x" + std::to_string(c.sinks.size()));
}

// A learned logit scale per query head, sometimes in the Scalable-Softmax
// form (times ln n_i); now and then a NaN, an infinity or a wrong count,
// which validation must refuse, as it refuses the scale of an additive score.
inline void fuzz_score_scale(Input& in, AttentionCase& c) {
  SplitMix gen(in.u64());
  for (std::int64_t h = 0; h < c.hq; ++h)
    c.scales.push_back(static_cast<float>(2 * gen.symmetric()));
  if (in.one_in(8)) {
    const float bad = in.coin() ? std::numeric_limits<float>::quiet_NaN()
                                : std::numeric_limits<float>::infinity();
    c.scales[static_cast<std::size_t>(in.range(0, c.hq - 1))] = bad;
    c.reject("score_scale NaN or inf");
  }
  if (in.one_in(12)) {
    c.scales.push_back(1.0f);
    c.reject("score_scale count");
  }
  if (c.opt.score == Score::additive) c.reject("score_scale of an additive score");
  c.opt.score_scale = c.scales;
  c.opt.score_scale_log_n = in.coin();
  c.note(std::string("score_scale") + (c.opt.score_scale_log_n ? " log_n" : "") + " x" +
         std::to_string(c.scales.size()));
}

inline void fuzz_relative_bias(Input& in, AttentionCase& c) {
  c.opt.relative_bias.bidirectional = in.coin();
  const std::int64_t buckets = in.range(c.opt.relative_bias.bidirectional ? 4 : 2, 12);
  c.opt.relative_bias.max_distance = in.param(buckets, 64);
  c.table = make_input(in, {c.hq, buckets}, floating_dtype(in), values(in, false, 30.0));
  c.opt.relative_bias.table = c.table.view;
  c.note("relative bias buckets=" + std::to_string(buckets) +
         " max_distance=" + std::to_string(c.opt.relative_bias.max_distance));
}

inline void fuzz_dropout(Input& in, AttentionCase& c) {
  static constexpr double kP[] = {0.1, 0.5, 0.9, 0.25, 0.999};
  const double p = in.one_in(8) ? in.extreme_real() : in.pick(kP);
  c.opt.dropout_p = p;
  c.opt.dropout_seed = in.u64();
  c.opt.dropout_offset = in.fdp().ConsumeIntegral<std::uint32_t>();
  if (!(p >= 0.0 && p < 1.0)) c.reject("dropout_p " + std::to_string(p));
  c.note("dropout=" + std::to_string(p));
}

inline void fuzz_window(Input& in, AttentionCase& c) {
  c.opt.window_left = in.coin() ? in.param(-1, 20) : -1;
  c.opt.window_right = in.coin() ? in.param(-1, 20) : -1;
  if (c.opt.window_left < -1 || c.opt.window_right < -1) c.reject("window below -1");
  c.note("window=" + std::to_string(c.opt.window_left) + "," + std::to_string(c.opt.window_right));
}

inline void fuzz_key_lengths(Input& in, AttentionCase& c) {
  for (std::int64_t s = 0; s < sequences(c); ++s) {
    // The sequence's keys (fuzzed offsets may be extreme: a difference
    // past int64 stands for "many").
    std::int64_t rows = c.nk;
    if (!c.cu_k.empty() && static_cast<std::size_t>(s + 1) < c.cu_k.size() &&
        __builtin_sub_overflow(c.cu_k[static_cast<std::size_t>(s) + 1],
                               c.cu_k[static_cast<std::size_t>(s)], &rows)) {
      rows = std::numeric_limits<std::int64_t>::max();
    }
    c.key_lengths.push_back(in.range(0, std::max<std::int64_t>(rows, 0)));
  }
  if (in.one_in(12)) {
    if (in.coin() || c.key_lengths.empty()) {
      c.key_lengths.push_back(0);
    } else {
      c.key_lengths.back() = in.coin() ? c.key_lengths.back() + 1 + c.nk : -1;
    }
    c.reject("key_lengths");
  }
  c.opt.key_lengths = c.key_lengths;
  c.note("key_lengths");
}

// Enum fields set from integers out of range (as bindings and config parsers
// may): validation must reject them.
inline void fuzz_enums(Input& in, AttentionCase& c) {
  switch (in.range(0, 3)) {
    case 0:
      c.opt.score = static_cast<Score>(in.range(3, 255));
      break;
    case 1:
      c.opt.align = static_cast<Align>(in.range(2, 255));
      break;
    case 2:
      c.opt.matmul_precision = static_cast<qkv::MatmulPrecision>(in.range(3, 255));
      break;
    default:
      c.opt.backend = static_cast<Backend>(in.range(3, 255));
      break;
  }
  c.reject("out-of-range enum");
}

// Builds a whole case; `differentiable` leaves out score_mod (the backward
// refuses it).
inline void fuzz_case(Input& in, AttentionCase& c, bool differentiable) {
  static constexpr DType kTypes[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::f64};
  c.dtype = in.pick(kTypes);
  c.hkv = in.range(1, 3);
  c.hq = c.hkv * in.range(1, 3);
  c.dk = in.size(16, 40);
  c.dq = c.dk;
  c.dv = in.coin() ? c.dk : in.size(16, 40);
  c.batch = in.size(3, 4);
  c.nq = in.size(12, 72);
  c.nk = in.coin() ? c.nq : in.size(12, 72);
  fuzz_sequences(in, c);
  c.note(std::string(dtype_name(c.dtype)) + " B=" + std::to_string(c.batch) +
         " Nq=" + std::to_string(c.nq) + " Nk=" + std::to_string(c.nk) +
         " Hq=" + std::to_string(c.hq) + " Hkv=" + std::to_string(c.hkv) +
         " Dk=" + std::to_string(c.dk) + " Dv=" + std::to_string(c.dv));

  switch (in.range(0, 5)) {
    case 0:
      c.opt.score = Score::dot;
      c.note("dot");
      break;
    case 1:
      c.dq = in.size(16, 40);
      fuzz_additive(in, c);
      break;
    default:
      break;
  }
  if (in.one_in(3)) fuzz_scale(in, c);
  c.opt.causal = in.coin();
  c.opt.align = in.coin() ? Align::bottom_right : Align::top_left;
  if (c.opt.causal) c.note(c.opt.align == Align::top_left ? "causal top-left" : "causal");
  if (in.one_in(3)) fuzz_window(in, c);
  if (in.one_in(4)) fuzz_key_lengths(in, c);
  if (in.one_in(4)) fuzz_mask(in, c);
  if (in.one_in(5)) fuzz_alibi(in, c);
  if (in.one_in(5)) fuzz_sinks(in, c);
  if (in.one_in(6)) fuzz_score_scale(in, c);
  if (in.one_in(6)) fuzz_relative_bias(in, c);
  if (in.one_in(5)) fuzz_softcap(in, c);
  if (in.one_in(6)) fuzz_dropout(in, c);
  if (in.one_in(5)) {
    c.opt.sparse = fuzz_pattern(in, c, 0);
    c.note("sparse " + c.opt.sparse.describe());
  }
  if (!differentiable && in.one_in(6)) {
    c.score_mod = static_cast<int>(in.range(0, kScoreMods - 1));
    if (c.score_mod >= kScoreModsFinite) c.finite_expected = c.comparable = false;
  }
  if (in.one_in(6)) c.mask_mod = static_cast<int>(in.range(0, kMaskMods - 1));
  if (c.score_mod >= 0 || c.mask_mod >= 0) {
    c.flex = !differentiable && in.coin();
    if (!c.flex) c.opt = c.function_options();
    c.note("score_mod=" + std::to_string(c.score_mod) + " mask_mod=" + std::to_string(c.mask_mod) +
           (c.flex ? " (flex)" : ""));
  }
  // Reduced precision: the engines' paths where the CPU has them (or under
  // QKV_EMULATE_ENGINES), the f32 path bit for bit elsewhere.
  if (in.one_in(4)) {
    static constexpr qkv::MatmulPrecision kPrecisions[] = {qkv::MatmulPrecision::medium,
                                                           qkv::MatmulPrecision::int8};
    c.opt.matmul_precision = in.pick(kPrecisions);
    c.note(c.opt.matmul_precision == qkv::MatmulPrecision::int8 ? "int8" : "medium");
  }
  static constexpr Backend kBackends[] = {Backend::automatic, Backend::fast, Backend::reference};
  c.opt.backend = in.pick(kBackends);
  if (c.opt.backend == Backend::fast && c.dtype == DType::f64) c.reject("fast backend with f64");
  if (in.one_in(24)) fuzz_enums(in, c);

  // q, k and v: NaN may appear anywhere, infinities only in v (an infinite
  // key turns scores into inf - inf, whose NaN is the input's doing).
  const Values vq = values(in, true, c.dtype == DType::f16 ? 8.0 : 1e4);
  c.q = make_input(in, {c.batch, c.nq, c.hq, c.dq}, c.dtype, vq);
  c.k = make_input(in, {c.batch, c.nk, c.hkv, c.dk}, c.dtype, vq);
  Values vv = values(in, true, c.dtype == DType::f16 ? 8.0 : 1e4);
  vv.infinities = true;
  c.v = make_input(in, {c.batch, c.nk, c.hkv, c.dv}, c.dtype, vv);
  c.qk_magnitude = vq.magnitude;
  c.v_magnitude = vv.magnitude;
  if (in.one_in(20)) {
    Arg* const args[] = {&c.q, &c.k, &c.v};
    Arg& victim = *args[in.range(0, 2)];
    const BadView bad = bad_view(in);
    const bool empty = victim.view.numel() == 0;
    make_bad(in, victim, bad);
    if (bad == BadView::undefined || bad == BadView::overflow ||
        (bad == BadView::null_data && !empty)) {
      c.reject("raw bad q, k or v view");
    }
  }
  if (!c.inputs_finite()) c.note("non-finite inputs");

  // Dropout scales kept weights by 1 / (1 - p): bounded outputs need a
  // bounded factor in 16-bit formats.
  if (c.opt.dropout_p > 0.9 && (c.dtype == DType::f16 || c.dtype == DType::bf16)) {
    c.finite_expected = false;
  }
  if (!c.inputs_finite()) c.comparable = false;
  if (!c.finite_expected) c.comparable = false;
}

}  // namespace qkv::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qkv::fuzz::initialize();
  return 0;
}
