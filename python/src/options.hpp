// qkv::AttentionOptions as Python sees it: one keyword per row of
// QKV_ATTENTION_OPTIONS (qkv/attention.hpp) that Python can express (every
// row but the C++ callables score_mod, mask_mod and the shard offsets, which
// qkv::dist sets), converted when set. The object holds the arrays its views
// and spans point into, so they stay valid while a call runs; one object
// serves the forward, the backward and decoding.
#pragma once

#include <nanobind/nanobind.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "qkv/attention.hpp"

namespace qkv::python {

namespace nb = nanobind;

#define QKV_OPTION_ONE(type, name, init, doc) +1
inline constexpr std::size_t kOptionRows = 0 QKV_ATTENTION_OPTIONS(QKV_OPTION_ONE);
#undef QKV_OPTION_ONE

struct Options {
  AttentionOptions cpp;                    // what the calls read
  std::array<nb::object, kOptionRows> py;  // the Python value of each row set; unset: None
  // The arrays each row's views and spans point into.
  std::array<std::vector<std::shared_ptr<void>>, kOptionRows> arrays;

  const AttentionOptions& to_cpp() const { return cpp; }
};

// "automatic", "reference" or "fast"; throws qkv::Error naming `backend`.
Backend parse_backend(const std::string& s);

// Binds qkv._qkv.Options: Options(**options) with qkv.attention's keywords,
// a property per keyword, and Options.names, the keywords in the rows' order.
// A keyword that is not an option raises TypeError, as Python does for an
// unexpected keyword argument; a bad value raises qkv::Error (ValueError)
// or TypeError naming it.
void bind_options(nb::module_& m);

}  // namespace qkv::python
