// .npy reading and writing (qkv/npy.hpp): round trips of every dtype and
// rank, NumPy's own files (when a Python with NumPy is found), and
// hand-made corrupt files, each refused with a message naming the file.
#include "qkv/npy.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/files.hpp"
#include "qkv/tensor.hpp"
#include "test_paths.hpp"

namespace qkv {
namespace {

namespace fs = std::filesystem;

class Npy : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("qkv_npy_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A version 1.0 file with header `dict` (padded as NumPy pads it) and `data`.
std::string npy_file(const std::string& dict, const std::string& data, char major = 1) {
  std::string header = dict;
  const std::size_t fixed = major == 1 ? 10 : 12;
  header.append((64 - (fixed + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += major;
  out += '\0';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>((header.size() >> 8) & 0xff);
  if (major != 1) out += std::string(2, '\0');
  return out + header + data;
}

template <class T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string bytes_of(ConstTensorView t) {
  return std::string(static_cast<const char*>(t.data()),
                     static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()));
}

// Elements 0.25 i - 3 (exact in every float dtype used here).
Tensor counting(DType dtype, std::initializer_list<std::int64_t> sizes) {
  Tensor t(dtype, sizes);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double value = 0.25 * static_cast<double>(i) - 3.0;
    if (dtype == DType::f64) {
      t.data<double>()[i] = value;
    } else {
      t.data<float>()[i] = static_cast<float>(value);
    }
  }
  return t;
}

TEST_F(Npy, RoundTripsEveryDtypeAndRank) {
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::boolean}) {
    for (const auto& sizes : std::vector<std::vector<std::int64_t>>{
             {}, {5}, {2, 3}, {2, 0, 3}, {2, 3, 4}, {2, 1, 3, 5}}) {
      Tensor t(dtype, sizes);
      auto* bytes = static_cast<std::uint8_t*>(t.view().data());
      for (std::size_t i = 0; i < static_cast<std::size_t>(t.numel()) * dtype_size(dtype); ++i) {
        bytes[i] = dtype == DType::boolean ? i % 2 : static_cast<std::uint8_t>(i * 37 + 11);
      }
      const std::string file = path("t.npy");
      save_npy(file, t);
      const Tensor back = load_npy(file);
      EXPECT_EQ(back.dtype(), dtype);
      ASSERT_EQ(back.rank(), static_cast<int>(sizes.size()));
      for (int d = 0; d < back.rank(); ++d) EXPECT_EQ(back.size(d), sizes[d]);
      EXPECT_EQ(bytes_of(back), bytes_of(t)) << dtype_name(dtype);
      EXPECT_EQ(read_bytes(file).size() % 64, bytes_of(t).size() % 64);  // data at 64 bytes
      const std::vector<std::uint8_t> memory = npy_bytes(t);
      EXPECT_EQ(std::string(memory.begin(), memory.end()), read_bytes(file));
    }
  }
}

TEST_F(Npy, WritesStridedViewsInRowMajorOrder) {
  const Tensor t = counting(DType::f32, {3, 4});
  const ConstTensorView transposed(t.view().data(), DType::f32, std::vector<std::int64_t>{4, 3},
                                   std::vector<std::int64_t>{1, 4});
  save_npy(path("t.npy"), transposed);
  const Tensor back = load_npy(path("t.npy"));
  for (std::int64_t i = 0; i < 4; ++i) {
    for (std::int64_t j = 0; j < 3; ++j) EXPECT_EQ(back.get({i, j}), t.get({j, i}));
  }
}

TEST_F(Npy, ReadsFortranOrderBigEndianAndBoolBytes) {
  // [[0, 1, 2], [3, 4, 5]] stored column-major: 0 3 1 4 2 5.
  write_bytes(path("f.npy"), npy_file("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }",
                                      raw(std::vector<double>{0, 3, 1, 4, 2, 5})));
  const Tensor f = load_npy(path("f.npy"));
  ASSERT_EQ(f.rank(), 2);
  for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(f.get({i / 3, i % 3}), static_cast<double>(i));

  std::string big = raw(std::vector<float>{1.5f, -2.0f});
  for (std::size_t at = 0; at < big.size(); at += 4) std::reverse(&big[at], &big[at] + 4);
  write_bytes(path("b.npy"),
              npy_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", big));
  const Tensor b = load_npy(path("b.npy"));
  EXPECT_EQ(b.get({0}), 1.5);
  EXPECT_EQ(b.get({1}), -2.0);

  write_bytes(path("m.npy"),
              npy_file("{\"shape\": (3,), \"fortran_order\": False, \"descr\": \"|b1\"}",
                       std::string("\x00\x07\x01", 3)));
  const Tensor m = load_npy(path("m.npy"));
  EXPECT_EQ(bytes_of(m), std::string("\x00\x01\x01", 3));

  // Versions 2.0 and 3.0 differ only in a 4-byte header length.
  write_bytes(path("v2.npy"), npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                                       raw(std::vector<float>{7.0f}), 2));
  EXPECT_EQ(load_npy(path("v2.npy")).get({}), 7.0);
}

// Each corrupt file is refused with a message naming the file and `want`.
void expect_refused(const std::string& file, const std::string& want) {
  try {
    load_npy(file);
    ADD_FAILURE() << "accepted: " << want;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file), std::string::npos) << what;
    EXPECT_NE(what.find(want), std::string::npos) << "expected '" << want << "' in: " << what;
  }
}

TEST_F(Npy, RefusesCorruptFilesNamingTheProblem) {
  const std::string ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const std::string two = raw(std::vector<float>{1, 2});
  struct Case {
    std::string bytes, want;
  };
  std::string huge_header = "\x93NUMPY\x02";
  huge_header += std::string("\0\0\0\x20\0", 5);  // 2 MiB announced
  const std::vector<Case> cases = {
      {"", "shorter than the 10-byte preamble"},
      {std::string("NUMPYX\x01\x00\x10\x00", 10) + "{}\n", "bad magic string"},
      {npy_file(ok, two).replace(6, 1, "\x04"), "unsupported .npy version 4.0"},
      {npy_file(ok, two).substr(0, 40), "truncated .npy header"},
      {huge_header + std::string(64, ' '), "expected at most 1048576"},
      {npy_file(ok, two).replace(npy_file(ok, two).find('\n'), 1, " "), "end with a newline"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), '\xc3\xa9': 1}", two),
       "expected ASCII text"},
      {npy_file("{'descr': '<f4', 'shape': (2,), }", two), "expected the keys"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 'y'}", two),
       "unexpected key 'x'"},
      {npy_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", two),
       "key 'descr' given twice"},
      {npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", two),
       "unsupported .npy dtype '<i4'"},
      {npy_file("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", two),
       "expected a string, True, False or a tuple"},
      {npy_file("{'descr': '<f4', 'fortran_order': 'no', 'shape': (2,), }", two),
       "'fortran_order' must be True or False"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': '2', }", two),
       "'shape' must be a tuple"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", two),
       "expected a non-negative integer"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 2), }", two),
       "rank 5 (expected at most 4)"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4), }",
                two),
       "byte count overflows"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                two),
       "integer too large"},
      {npy_file(ok, two.substr(0, 5)), "(truncated)"},
      {npy_file(ok, two + "x"), "(trailing bytes)"},
      {npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } junk", two),
       "unexpected text after the dict"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string file = path("bad" + std::to_string(i) + ".npy");
    write_bytes(file, cases[i].bytes);
    SCOPED_TRACE(cases[i].want);
    expect_refused(file, cases[i].want);
    // The same rules in memory.
    const std::vector<std::uint8_t> bytes(cases[i].bytes.begin(), cases[i].bytes.end());
    EXPECT_THROW(parse_npy(bytes, "memory"), Error);
  }
  expect_refused(path("missing.npy"), "cannot open the file for reading");
  expect_refused(dir_.string(), "expected a regular file");
}

TEST_F(Npy, WritingIsAllOrNothing) {
  const std::string file = path("out.npy");
  const Tensor first = counting(DType::f32, {2, 3});
  save_npy(file, first);
  const std::string before = read_bytes(file);
  EXPECT_THROW(save_npy(file, ConstTensorView()), Error);  // undefined view: nothing written
  EXPECT_EQ(read_bytes(file), before);
  EXPECT_THROW(save_npy(path("no/such/folder/out.npy"), first), Error);
  EXPECT_THROW(save_npy(dir_.string() + "/", first), Error);
  const Tensor second = counting(DType::f64, {4});
  save_npy(file, second);  // replaced whole
  EXPECT_EQ(bytes_of(load_npy(file)), bytes_of(second));
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u);  // no temporary file left behind
}

TEST_F(Npy, WriteFileReplacesWholeOrNotAtAll) {
  const std::string file = path("bytes.bin");
  const std::vector<std::uint8_t> first = {1, 2, 3}, second = {4, 5};
  write_file(file, first);
  EXPECT_EQ(read_bytes(file), std::string("\x01\x02\x03"));
  write_file(file, second);
  EXPECT_EQ(read_bytes(file), std::string("\x04\x05"));
  EXPECT_THROW(write_file(path("missing/bytes.bin"), first), Error);
  EXPECT_THROW(write_file(dir_.string() + "/", first), Error);
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u);
}

// A Python with NumPy: the project's .venv, else python3 (none: skipped).
std::string python_with_numpy() {
  const std::vector<std::string> candidates = {
      std::string(qkv::test::kSourceDir) + "/.venv/bin/python", "python3"};
  for (const std::string& candidate : candidates) {
    const std::string probe = candidate + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return candidate;
  }
  return {};
}

TEST_F(Npy, RoundTripsThroughNumPy) {
  const std::string python = python_with_numpy();
  if (python.empty()) GTEST_SKIP() << "no Python with NumPy";
  // NumPy writes arrays of every supported kind and their elements as
  // row-major little-endian bytes; qkv reads the .npy files, checks the
  // elements and writes them back; NumPy compares.
  const std::string script = R"PY(
import sys, numpy as np
d = sys.argv[1]
rng = np.random.default_rng(0)
arrays = {
    "f4": rng.standard_normal((2, 3, 4, 5)).astype("<f4"),
    "f8_fortran": np.asfortranarray(rng.standard_normal((3, 7))),
    "f2": rng.standard_normal((5,)).astype("<f2"),
    "big": rng.standard_normal((2, 2)).astype(">f4"),
    "scalar": np.array(3.5, dtype="<f8"),
    "bool": rng.standard_normal((3, 4)) > 0,
    "empty": np.zeros((2, 0), dtype="<f4"),
}
try:
    import ml_dtypes
    arrays["bf16"] = rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16)
except ImportError:
    pass
if sys.argv[2] == "write":
    for name, a in arrays.items():
        np.save(f"{d}/{name}.npy", a)
        little = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        open(f"{d}/{name}.bin", "wb").write(np.ascontiguousarray(little).tobytes())
else:
    for name, a in arrays.items():
        back = np.load(f"{d}/{name}.back.npy")
        if name == "bf16":
            back = back.view(a.dtype)
        assert back.shape == a.shape and back.flags.c_contiguous, name
        assert back.dtype.byteorder != ">", name
        assert np.array_equal(back, a), name
    print("ok", len(arrays))
)PY";
  std::ofstream(path("check.py")) << script;
  ASSERT_EQ(std::system((python + " " + path("check.py") + " " + dir_.string() + " write").c_str()),
            0);
  int arrays = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (entry.path().extension() != ".npy") continue;
    const std::string stem = entry.path().stem().string();
    SCOPED_TRACE(stem);
    const Tensor t = load_npy(entry.path().string());
    EXPECT_EQ(bytes_of(t), read_bytes(path(stem + ".bin")));
    save_npy(path(stem + ".back.npy"), t);
    ++arrays;
  }
  EXPECT_GE(arrays, 7);
  ASSERT_EQ(std::system((python + " " + path("check.py") + " " + dir_.string() + " read").c_str()),
            0);
}

}  // namespace
}  // namespace qkv
