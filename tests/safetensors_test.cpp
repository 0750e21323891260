// safetensors files: round trips of every dtype and rank, a hand-built file
// read and written byte for byte, every malformed file rejected, and
// load_parameters' checks and dtype conversion.
#include "qkv/modules/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "module_checks.hpp"
#include "qkv/modules/linear.hpp"
#include "test_util.hpp"

namespace qkv::test {
namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "qkv_safetensors_" + name + ".safetensors";
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(file.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A file of `header` (its exact length in the length field unless `length`
// says otherwise) followed by `data`.
std::string file_of(const std::string& header, const std::string& data, std::int64_t length = -1) {
  return le64(length < 0 ? header.size() : static_cast<std::uint64_t>(length)) + header + data;
}

// The message of the qkv::Error that loading `bytes` as a file throws ("" if
// none), after checking that it names the file.
std::string load_error(const std::string& name, const std::string& bytes) {
  const std::string path = temp_path(name);
  write_bytes(path, bytes);
  try {
    nn::load_safetensors(path);
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    return what;
  }
  ADD_FAILURE() << name << ": expected qkv::Error";
  return "";
}

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "\"" << part << "\" not in:\n" << text;
}

// Fills a tensor with random bytes (float dtypes: any bit pattern, NaNs with
// payloads included, which a round trip through double would not keep) or
// random 0/1 (bool).
Tensor random_bits(DType dtype, std::span<const std::int64_t> sizes, std::uint32_t seed) {
  Tensor t(dtype, sizes);
  std::mt19937 gen(seed);
  auto* bytes = static_cast<unsigned char*>(t.view().data());
  const std::size_t n = static_cast<std::size_t>(t.numel()) * dtype_size(dtype);
  for (std::size_t i = 0; i < n; ++i) {
    bytes[i] = static_cast<unsigned char>(dtype == DType::boolean ? gen() % 2 : gen() % 256);
  }
  return t;
}

// Whether a and b hold the same sizes, dtype and element bits.
::testing::AssertionResult same_bits(ConstTensorView a, ConstTensorView b) {
  if (a.dtype() != b.dtype() || a.rank() != b.rank() || a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure()
           << dtype_name(a.dtype()) << shape_string(a.size_span()) << " vs "
           << dtype_name(b.dtype()) << shape_string(b.size_span());
  }
  const std::size_t element = dtype_size(a.dtype());
  std::int64_t mismatches = 0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    const auto* x = static_cast<const char*>(a.data()) +
                    detail::offset(idx, a.strides(), a.rank()) * std::int64_t(element);
    const auto* y = static_cast<const char*>(b.data()) +
                    detail::offset(idx, b.strides(), b.rank()) * std::int64_t(element);
    mismatches += std::memcmp(x, y, element) != 0;
  });
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " elements differ";
}

TEST(Safetensors, RoundTripsEveryDTypeAndRankBitExactly) {
  const std::vector<std::vector<std::int64_t>> shapes = {{},        {5},          {3, 4},
                                                         {2, 3, 2}, {2, 1, 3, 2}, {0, 3}};
  std::uint32_t seed = 1;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::boolean}) {
    std::vector<Tensor> owned;
    std::map<std::string, ConstTensorView> tensors;
    for (const auto& shape : shapes) {
      owned.push_back(random_bits(dtype, shape, seed++));
    }
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      tensors.emplace("rank" + std::to_string(shapes[i].size()) + "_" + std::to_string(i),
                      owned[i]);
    }
    // A strided input: [4, 3] read through the transpose of a [3, 4] tensor.
    const std::vector<std::int64_t> base_shape = {3, 4};
    owned.push_back(random_bits(dtype, base_shape, seed++));
    const ConstTensorView transposed = owned.back().view().transpose(0, 1);
    tensors.emplace("transposed", transposed);

    const std::string path = temp_path(std::string("roundtrip_") + std::string(dtype_name(dtype)));
    nn::save_safetensors(path, tensors);
    const nn::TensorMap loaded = nn::load_safetensors(path);
    ASSERT_EQ(loaded.size(), tensors.size()) << dtype_name(dtype);
    for (const auto& [name, view] : tensors) {
      ASSERT_TRUE(loaded.contains(name)) << name;
      EXPECT_TRUE(same_bits(loaded.at(name), view)) << dtype_name(dtype) << " " << name;
    }
    EXPECT_TRUE(loaded.at("transposed").view().is_contiguous());
  }
}

TEST(Safetensors, MixedDTypesRoundTripAndMetadataToo) {
  const Tensor a = random_bits(DType::f16, std::vector<std::int64_t>{3}, 7);  // 6 bytes
  const Tensor b = random_bits(DType::f64, std::vector<std::int64_t>{2, 2}, 8);
  const Tensor c = random_bits(DType::boolean, std::vector<std::int64_t>{5}, 9);
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\" \\ back"}, {"empty", ""}};
  const std::string path = temp_path("mixed");
  nn::save_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, metadata);
  const nn::TensorMap loaded = nn::load_safetensors(path);
  EXPECT_TRUE(same_bits(loaded.at("a"), a));
  EXPECT_TRUE(same_bits(loaded.at("b"), b));
  EXPECT_TRUE(same_bits(loaded.at("c"), c));
  EXPECT_EQ(nn::load_safetensors_metadata(path), metadata);

  // Without metadata the header has no "__metadata__" entry at all.
  nn::save_safetensors(path, {{"a", a}});
  EXPECT_TRUE(nn::load_safetensors_metadata(path).empty());
  EXPECT_EQ(read_bytes(path).find("__metadata__"), std::string::npos);
}

// The file format written out by hand, independently of the writer: two
// tensors, the F32 one first (the reference writer puts larger elements
// first), the header padded with 4 spaces to 112 bytes.
const std::string kHandHeader = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("s":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}})"
                                "    ";
const std::string kHandFile = std::string("\x70\0\0\0\0\0\0\0", 8) + kHandHeader +
                              std::string(
                                  "\x00\x00\x80\x3f"  // 1.0f
                                  "\x00\x00\x20\xc0"  // -2.5f
                                  "\xc0\x3f",         // bf16 1.5
                                  10);

TEST(Safetensors, ReadsAHandBuiltFileAsTheFormatSpecifies) {
  ASSERT_EQ(kHandHeader.size(), 0x70u);
  const std::string path = temp_path("hand");
  write_bytes(path, kHandFile);
  const nn::TensorMap t = nn::load_safetensors(path);
  ASSERT_EQ(t.size(), 2u);
  const Tensor& w = t.at("w");
  ASSERT_EQ(w.dtype(), DType::f32);
  ASSERT_EQ(w.rank(), 1);
  ASSERT_EQ(w.size(0), 2);
  EXPECT_EQ(w.get({0}), 1.0);
  EXPECT_EQ(w.get({1}), -2.5);
  const Tensor& s = t.at("s");
  ASSERT_EQ(s.dtype(), DType::bf16);
  ASSERT_EQ(s.rank(), 0);
  EXPECT_EQ(s.get({}), 1.5);
}

TEST(Safetensors, WritesTheReferenceWritersBytes) {
  // Same tensors as the hand-built file: the writer must reproduce it byte
  // for byte (order by element size, compact JSON, fields in the
  // reference's order, space padding).
  float w[] = {1.0f, -2.5f};
  const bf16 s = to_bf16(1.5f);
  const std::string path = temp_path("written");
  nn::save_safetensors(path,
                       {{"s", ConstTensorView(&s, DType::bf16, std::span<const std::int64_t>{})},
                        {"w", ConstTensorView(w, {2})}});
  EXPECT_EQ(read_bytes(path), kHandFile);

  // No tensors at all: "{}" padded to 8 bytes.
  nn::save_safetensors(path, {});
  EXPECT_EQ(read_bytes(path), le64(8) + "{}      ");
  EXPECT_TRUE(nn::load_safetensors(path).empty());
}

TEST(Safetensors, AcceptsAnyKeyOrderWhitespaceAndNullMetadata) {
  const std::string header =
      R"( { "__metadata__" : null, "b" : { "data_offsets" : [ 4, 8 ], "shape" : [ 1 ], )"
      R"("dtype" : "F32" }, "a" : { "shape" : [ 1 ], "dtype" : "F32", "data_offsets" : [0,4] } })";
  const std::string path = temp_path("whitespace");
  write_bytes(path, file_of(header, std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8)));
  const nn::TensorMap t = nn::load_safetensors(path);
  EXPECT_EQ(t.at("a").get({0}), 1.0);
  EXPECT_EQ(t.at("b").get({0}), 2.0);
}

TEST(Safetensors, RejectsMalformedFilesNamingFileAndTensor) {
  const std::string f32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');

  expect_has(load_error("short", std::string("\x10\0\0\0\0", 5)), "truncated: 5 bytes");
  expect_has(load_error("header_too_long", file_of("{}", "", 1000)),
             "header length 1000 exceeds the 2 bytes");
  expect_has(load_error("bad_json", file_of(R"({"w": )", "")), "not valid JSON");
  expect_has(load_error("not_object", file_of("[1, 2]", "")),
             "must be a JSON object, got a JSON array");
  expect_has(load_error("bad_utf8", file_of("{\"w\xff\":1}", "")), "not valid JSON");
  expect_has(load_error("i32", file_of(R"({"w":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                                       eight)),
             "tensor \"w\": unsupported dtype \"I32\"");
  expect_has(load_error("rank5", file_of(R"({"w":{"dtype":"F32","shape":[1,1,1,1,2],)"
                                         R"("data_offsets":[0,8]}})",
                                         eight)),
             "tensor \"w\": rank 5");
  expect_has(load_error("negative_size", file_of(R"({"w":{"dtype":"F32","shape":[-2],)"
                                                 R"("data_offsets":[0,8]}})",
                                                 eight)),
             "tensor \"w\": \"shape\": expected non-negative integer sizes");
  expect_has(
      load_error("reversed",
                 file_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight)),
      "tensor \"w\": data_offsets [8, 0]: end before begin");
  expect_has(
      load_error("size_mismatch",
                 file_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd")),
      "tensor \"w\": data_offsets [0, 4] hold 4 bytes, but shape [2] of F32 needs 8");
  expect_has(load_error("overflow", file_of(R"({"w":{"dtype":"F64","shape":[4294967296,)"
                                            R"(4294967296],"data_offsets":[0,8]}})",
                                            eight)),
             "needs more than 2^64 bytes");
  expect_has(load_error("overlap", file_of(R"({"a":)" + f32x2 +
                                               R"(,"b":{"dtype":"F32","shape":[2],)"
                                               R"("data_offsets":[4,12]}})",
                                           std::string(12, '\0'))),
             "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\"");
  expect_has(load_error("gap", file_of(R"({"a":)" + f32x2 +
                                           R"(,"b":{"dtype":"F32","shape":[2],)"
                                           R"("data_offsets":[12,20]}})",
                                       std::string(20, '\0'))),
             "tensor \"b\": data_offsets [12, 20] leave bytes [8, 12) of the data buffer unused");
  expect_has(load_error("past_end", file_of(R"({"w":)" + f32x2 + "}", "abcd")),
             "tensor \"w\": data_offsets [0, 8] reach past the end of the 4-byte data buffer");
  expect_has(load_error("trailing", file_of(R"({"w":)" + f32x2 + "}", std::string(12, '\0'))),
             "the tensors cover 8 bytes of the 12-byte data buffer");
  expect_has(load_error("bad_metadata", file_of(R"({"__metadata__":{"k":1}})", "")),
             "\"__metadata__\": value of \"k\" must be a string, got a JSON number");
  expect_has(load_error("no_offsets", file_of(R"({"w":{"dtype":"F32","shape":[2]}})", eight)),
             "tensor \"w\": \"data_offsets\": expected [begin, end]");

  // Every problem of a header at once.
  const std::string path = temp_path("many");
  write_bytes(path, file_of(R"({"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},)"
                            R"("b":{"dtype":"F32","shape":[1,1,1,1,1],"data_offsets":[1,5]}})",
                            "12345"));
  try {
    nn::load_safetensors(path);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.reasons().size(), 2u) << e.what();
  }

  const std::string missing = temp_path("does_not_exist");
  std::remove(missing.c_str());
  try {
    nn::load_safetensors(missing);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    expect_has(e.what(), missing + ": cannot open the file for reading");
  }
}

TEST(Safetensors, SaveRejectsBadArguments) {
  float x[2] = {1, 2};
  const std::string path = temp_path("save_errors");
  EXPECT_THROW(nn::save_safetensors(path, {{"u", ConstTensorView()}}), Error);
  EXPECT_THROW(nn::save_safetensors(path, {{"__metadata__", ConstTensorView(x, {2})}}), Error);
  EXPECT_THROW(nn::save_safetensors(path, {{"bad\xff", ConstTensorView(x, {2})}}), Error);
  EXPECT_THROW(nn::save_safetensors(::testing::TempDir() + "no/such/dir/x.safetensors",
                                    {{"x", ConstTensorView(x, {2})}}),
               Error);
}

// The values of a parameter list, to check that a failed load changed nothing.
std::vector<Tensor> values_of(const nn::NamedParameters& ps) {
  std::vector<Tensor> v;
  for (const nn::NamedParameter& p : ps) v.push_back(p.parameter->value);
  return v;
}

TEST(Safetensors, LoadParametersListsEveryProblemAndChangesNothing) {
  nn::Linear fc(3, 2);
  const nn::NamedParameters ps = fc.named_parameters("fc.");
  nn::init_uniform(ps, 4);
  const std::vector<Tensor> before = values_of(ps);

  nn::TensorMap tensors;
  tensors.emplace("fc.weight", random_tensor(DType::f32, {3, 2}, 1));  // transposed shape
  tensors.emplace("fc.extra", random_tensor(DType::f32, {2}, 2));      // no such parameter
  // "fc.bias" is missing.
  try {
    nn::load_parameters(ps, tensors);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    ASSERT_EQ(e.reasons().size(), 3u) << e.what();
    expect_has(e.what(), "\"fc.weight\": expected shape [2, 3], got [3, 2]");
    expect_has(e.what(), "\"fc.bias\": missing (a parameter of shape [2])");
    expect_has(e.what(), "\"fc.extra\": unexpected");
  }
  for (std::size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(same_bits(ps[i].parameter->value, before[i])) << ps[i].name;
  }

  // A bool tensor is no parameter value.
  tensors.clear();
  tensors.emplace("fc.weight", Tensor(DType::boolean, {2, 3}));
  tensors.emplace("fc.bias", Tensor(DType::f32, {2}));
  EXPECT_THROW(nn::load_parameters(ps, tensors), Error);

  // Through a file, each reason also names the file.
  tensors.clear();
  tensors.emplace("fc.weight", random_tensor(DType::f32, {2, 3}, 3));
  const std::string path = temp_path("params_missing_bias");
  nn::save_safetensors(path, {{"fc.weight", tensors.at("fc.weight")}});
  try {
    nn::load_parameters(ps, path);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    ASSERT_EQ(e.reasons().size(), 1u) << e.what();
    expect_has(e.reasons()[0], path + ": \"fc.bias\": missing");
  }
  for (std::size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(same_bits(ps[i].parameter->value, before[i])) << ps[i].name;
  }
}

TEST(Safetensors, NonStrictLoadIgnoresExtraTensors) {
  nn::Linear fc(3, 2);
  const nn::NamedParameters ps = fc.named_parameters();
  nn::TensorMap tensors;
  tensors.emplace("weight", random_tensor(DType::f32, {2, 3}, 5));
  tensors.emplace("bias", random_tensor(DType::f32, {2}, 6));
  tensors.emplace("num_batches_tracked", random_tensor(DType::f32, {}, 7));
  EXPECT_THROW(nn::load_parameters(ps, tensors), Error);
  nn::load_parameters(ps, tensors, /*strict=*/false);
  EXPECT_TRUE(same_bits(fc.weight.value, tensors.at("weight")));
  EXPECT_TRUE(same_bits(fc.bias.value, tensors.at("bias")));
  // Missing parameters are errors even when not strict.
  tensors.erase("bias");
  EXPECT_THROW(nn::load_parameters(ps, tensors, false), Error);
}

TEST(Safetensors, LoadConvertsToTheParameterDTypeWithRoundToNearestEven) {
  // bf16 keeps 8 significant bits: near 1 its spacing is 2^-7.
  const double u = std::ldexp(1.0, -8);
  const float values[] = {
      static_cast<float>(1 + u),                         // tie: to even, 1
      static_cast<float>(1 + 3 * u),                     // tie: to even, 1 + 2^-6
      static_cast<float>(1 + u + std::ldexp(1.0, -20)),  // above the tie: 1 + 2^-7
      -0.0f, 1e30f};
  const double want[] = {1.0, 1 + 4 * u, 1 + 2 * u, -0.0, to_float(to_bf16(1e30f))};
  const std::string path = temp_path("convert");
  nn::save_safetensors(path, {{"weight", ConstTensorView(values, {5})}});

  nn::Parameter p = nn::make_parameter(DType::bf16, {5});
  nn::load_parameters({{"weight", &p}}, path);
  for (std::int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(p.value.get({i}), want[i]) << i;
    EXPECT_EQ(std::signbit(p.value.get({i})), std::signbit(want[i])) << i;
  }

  // save_parameters writes each value in its own dtype.
  nn::save_parameters({{"weight", &p}}, path);
  EXPECT_TRUE(same_bits(nn::load_safetensors(path).at("weight"), p.value));
}

TEST(Safetensors, SavingANullViewWithElementsIsAnError) {
  const std::string path = temp_path("null_view");
  const std::vector<std::string> r = reasons_of([&] {
    nn::save_safetensors(path, {{"x", ConstTensorView(static_cast<const float*>(nullptr), {4})}});
  });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].find("\"x\""), std::string::npos) << r[0];
}

}  // namespace
}  // namespace qkv::test
