// cpu/engines/engine_table.hpp — an engine enum's table: per enumerator, in
// the enum's order, what names it, what it needs and what runs it. The
// engines' name, availability and product functions read their row.
#pragma once

#include <cstddef>
#include <iterator>
#include <optional>

#include "core/isa.hpp"

namespace qkv::cpu::engines {

template <class Product>
struct EngineRow {
  const char* name;                      // as benchmarks and `qkv info` print it
  std::optional<detail::Family> family;  // what its instructions need; none: an emulation
  void (*run)(const Product&);           // computes the product
};

// The row of enumerator e in `table` (listed in the enum's order).
template <class Product, std::size_t N, class Engine>
const EngineRow<Product>& row_of(const EngineRow<Product> (&table)[N], Engine e) {
  static_assert(N > 0);
  return table[static_cast<std::size_t>(e)];
}

// Whether the row's engine runs now: an emulation always; instructions where
// the build `compiled` them and their family is allowed (core/isa.hpp).
template <class Product>
bool runs_now(const EngineRow<Product>& row, bool compiled) {
  return !row.family || (compiled && detail::family_allowed(*row.family));
}

}  // namespace qkv::cpu::engines
