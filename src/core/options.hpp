// The attention options as data: an enumerator per row of
// QKV_ATTENTION_OPTIONS (qkv/attention.hpp), its name, and whether a call
// turns it on. An option is on when its value differs from its default: a
// defined view or pattern, a non-empty span or function, a set optional, a
// changed number or enum, any nonzero field of a struct of parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "qkv/attention.hpp"

namespace qkv::detail {

enum class Option : std::uint8_t {
#define QKV_OPTION_ENUMERATOR(type, name, init, doc) name,
  QKV_ATTENTION_OPTIONS(QKV_OPTION_ENUMERATOR)
#undef QKV_OPTION_ENUMERATOR
};

#define QKV_OPTION_ONE(type, name, init, doc) +1
inline constexpr std::size_t kOptionCount = 0 QKV_ATTENTION_OPTIONS(QKV_OPTION_ONE);
#undef QKV_OPTION_ONE

// The field's name, as in "options.<name>" of the error messages.
const char* option_name(Option option);

// Its row's documentation.
const char* option_doc(Option option);

// Whether `value` differs from its row's default `init`.
template <class T>
bool differs(const T& value, const T& init) {
  return value != init;
}
template <class T>
bool differs(const std::optional<T>& value, const std::optional<T>&) {
  return value.has_value();
}
template <class T>
bool differs(std::span<T> value, std::span<T>) {
  return !value.empty();
}
template <class R, class... A>
bool differs(const std::function<R(A...)>& value, const std::function<R(A...)>&) {
  return static_cast<bool>(value);
}
bool differs(const ConstTensorView& value, const ConstTensorView&);
bool differs(const AdditiveScore& value, const AdditiveScore&);
bool differs(const RelativePositionBias& value, const RelativePositionBias&);
bool differs(const SparsePattern& value, const SparsePattern&);
bool differs(const ShardOffsets& value, const ShardOffsets&);

// Whether `options` turns `option` on.
bool is_on(const AttentionOptions& options, Option option);

// Calls f(Option, const T& value) for every row, in the rows' order.
template <class F>
void for_each_option(const AttentionOptions& options, F&& f) {
#define QKV_OPTION_VISIT(type, name, init, doc) f(Option::name, options.name);
  QKV_ATTENTION_OPTIONS(QKV_OPTION_VISIT)
#undef QKV_OPTION_VISIT
}

}  // namespace qkv::detail
