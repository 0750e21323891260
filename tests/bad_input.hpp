// Helpers of the bad-input tests: buffers that outlive the views a row
// builds (and whose bytes show that a rejected call wrote nothing), the
// qkv::Error a call throws, and the checks of its message.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/elements.hpp"
#include "qkv/qkv.hpp"

namespace qkv::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr std::int64_t kMaxInt64 = std::numeric_limits<std::int64_t>::max();

// Buffers owned by one test row. Views and spans point into them, so an
// owner is never copied or moved.
class Buffers {
 public:
  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;

  // A contiguous view over a buffer of its own, holding at least
  // kMinElements elements (so that a row may lay a larger view onto it)
  // that are neither 0 nor alike: 0.25, 0.375, ... (exact in every dtype;
  // bool: alternating), so that a write of any computed value shows.
  TensorView tensor(DType dtype, std::initializer_list<std::int64_t> sizes) {
    return tensor(dtype, std::span<const std::int64_t>(sizes.begin(), sizes.size()));
  }
  TensorView tensor(DType dtype, std::span<const std::int64_t> sizes) {
    std::int64_t n = 1;
    for (const std::int64_t s : sizes) n *= s;
    const std::int64_t count = std::max(n, kMinElements);
    // operator new aligns the bytes for any element type.
    std::vector<std::byte>& block =
        blocks_.emplace_back(static_cast<std::size_t>(count) * dtype_size(dtype));
    void* data = block.data();
    for (std::int64_t i = 0; i < count; ++i) {
      detail::store(data, dtype, i,
                    dtype == DType::boolean ? double(i % 2) : 0.25 + 0.125 * (i % 7));
    }
    return {data, dtype, sizes};
  }

  // A span over a copy of `values`.
  template <class T>
  std::span<const T> list(std::initializer_list<T> values) {
    std::vector<std::byte>& block =
        blocks_.emplace_back(std::max<std::size_t>(values.size(), 1) * sizeof(T));
    T* p = reinterpret_cast<T*>(block.data());
    std::copy(values.begin(), values.end(), p);
    return {p, values.size()};
  }

  // Every byte of every buffer.
  std::vector<std::vector<std::byte>> snapshot() const { return {blocks_.begin(), blocks_.end()}; }

 private:
  static constexpr std::int64_t kMinElements = 1024;

  std::deque<std::vector<std::byte>> blocks_;  // a deque: adding one moves none
};

// Runs `call`; returns the qkv::Error it throws, and fails the test if it
// throws nothing or another exception.
inline std::optional<Error> error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a different exception: " << e.what();
    return std::nullopt;
  } catch (...) {
    ADD_FAILURE() << "threw something that is not a std::exception";
    return std::nullopt;
  }
  ADD_FAILURE() << "did not throw";
  return std::nullopt;
}

inline void expect_contains(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(text.find(part), std::string::npos) << "message lacks \"" << part << "\"; message:\n"
                                                  << text;
  }
}

// One row of a bad-input table: a valid `Call` that `breaks` turns into a
// bad one, whose error must list `reasons` problems and contain every part
// of `message` (naming the argument, the expected and the actual value).
template <class Call>
struct BadRow {
  std::string name;                   // gtest parameter name
  std::function<void(Call&)> breaks;  // turns the valid base call into a bad one
  std::vector<std::string> message;   // substrings that what() must contain
  std::size_t reasons = 1;            // problems the error lists
};

template <class Call>
void PrintTo(const BadRow<Call>& row, std::ostream* os) {
  *os << row.name;
}

template <class Call>
std::string row_name(const testing::TestParamInfo<BadRow<Call>>& info) {
  return info.param.name;
}

// Runs `call`, which must throw qkv::Error as `row` describes; returns
// whether it threw one.
template <class Call>
bool expect_rejected(const std::function<void()>& call, const BadRow<Call>& row) {
  const std::optional<Error> error = error_of(call);
  if (!error) return false;
  expect_contains(error->what(), row.message);
  EXPECT_EQ(error->reasons().size(), row.reasons) << error->what();
  return true;
}

// Runs `row` on a fresh Call: the call must throw as the row says and leave
// its buffers and call.state() (whatever else it may change: a cache, the
// parameters) as they were; `after` then runs on the rejected call.
template <class Call>
void expect_row(const BadRow<Call>& row, const std::function<void(Call&)>& after = {}) {
  Call call;
  row.breaks(call);
  const auto state = call.state();
  const auto buffers = call.snapshot();
  if (!expect_rejected([&] { call.run(); }, row)) return;
  EXPECT_TRUE(call.state() == state) << "the rejected call changed " << Call::kState;
  EXPECT_TRUE(call.snapshot() == buffers) << "the rejected call wrote into its inputs or outputs";
  if (after) after(call);
}

// Runs each variant of a valid call on a fresh Call; none may throw.
template <class Call>
void expect_valid(const std::vector<std::pair<std::string, std::function<void(Call&)>>>& variants) {
  for (const auto& [name, make] : variants) {
    Call call;
    make(call);
    try {
      call.run();
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": " << e.what();
    }
  }
}

// A tensor argument of the call a table tests, for view_rows.
struct ViewArgument {
  std::string name;                 // as messages name it ("k_new")
  std::vector<std::int64_t> sizes;  // valid sizes, with at least one element
  DType dtype = DType::f32;         // of the null and the overflowing view
  bool optional = false;            // an undefined view is valid: no row for it
  // The dtypes the bool row's message expects; empty: bool is valid, no row.
  std::string dtypes = "f32, f64, f16 or bf16";
  std::string label = name;  // prefix of the row names
};

// The rows every tensor argument gets: undefined (unless optional), data
// that is null while there are elements, an extent whose last byte offset
// overflows int64, and bool elements. `set` puts a view in the argument's
// place in a valid call (after switching the call to the entry point that
// takes it, if need be); each row expects one reason.
template <class Call>
std::vector<BadRow<Call>> view_rows(const ViewArgument& arg,
                                    const std::function<void(Call&, TensorView)>& set) {
  std::int64_t numel = 1;
  for (const std::int64_t s : arg.sizes) numel *= s;
  // Contiguous strides, but the outermost dimension of more than one index
  // gets the stride that puts the last element at offset 2^63 - 1 or just
  // past it: the end of that element (in bytes, even of bool) is past
  // 2^63 - 1, so no allocation can back the view.
  std::vector<std::int64_t> strides(arg.sizes.size(), 1);
  for (std::size_t d = strides.size() - 1; d-- > 0;) strides[d] = strides[d + 1] * arg.sizes[d + 1];
  for (std::size_t d = 0; d < strides.size(); ++d) {
    if (arg.sizes[d] < 2) continue;
    std::int64_t rest = 0;  // offset of the last element without dimension d
    for (std::size_t e = 0; e < strides.size(); ++e) {
      if (e != d) rest += (arg.sizes[e] - 1) * strides[e];
    }
    const std::int64_t steps = arg.sizes[d] - 1;
    const std::int64_t room = std::numeric_limits<std::int64_t>::max() - rest;
    strides[d] = room / steps + (room % steps != 0);
    break;
  }
  const std::string shape = shape_string(arg.sizes);
  std::vector<BadRow<Call>> rows;
  if (!arg.optional) {
    rows.push_back({arg.label + "_undefined",
                    [=](Call& c) { set(c, {}); },
                    {arg.name + ": required tensor is undefined"}});
  }
  rows.push_back({arg.label + "_null_data",
                  [=](Call& c) { set(c, TensorView(nullptr, arg.dtype, arg.sizes)); },
                  {arg.name + ": data is null but the tensor has " + std::to_string(numel) +
                   " elements (sizes " + shape + ")"}});
  rows.push_back(
      {arg.label + "_extent_overflows",
       [=](Call& c) {
         set(c, TensorView(c.tensor(arg.dtype, arg.sizes).data(), arg.dtype, arg.sizes, strides));
       },
       {arg.name + ": sizes " + shape + " with strides " + shape_string(strides) +
        " overflow int64"}});
  if (!arg.dtypes.empty()) {
    rows.push_back({arg.label + "_bool",
                    [=](Call& c) { set(c, c.tensor(DType::boolean, arg.sizes)); },
                    {arg.name + ": expected dtype " + arg.dtypes + ", got bool"}});
  }
  return rows;
}

// The rows of `parts`, in order.
template <class Call>
std::vector<BadRow<Call>> join(std::initializer_list<std::vector<BadRow<Call>>> parts) {
  std::vector<BadRow<Call>> rows;
  for (const auto& part : parts) rows.insert(rows.end(), part.begin(), part.end());
  return rows;
}

}  // namespace qkv::test

// The parameterized test of a table of bad rows for `Call`: each row of
// `rows` runs through expect_row, under the name Suite/Fixture.*/row.
#define QKV_BAD_INPUT_TEST(Suite, Fixture, Call, rows)                            \
  class Fixture : public testing::TestWithParam<qkv::test::BadRow<Call>> {};      \
  TEST_P(Fixture, ThrowsAndChangesNothing) { qkv::test::expect_row(GetParam()); } \
  INSTANTIATE_TEST_SUITE_P(Suite, Fixture, testing::ValuesIn(rows), qkv::test::row_name<Call>)
