#include "core/options.hpp"

namespace qkv::detail {

const char* option_name(Option option) {
  switch (option) {
#define QKV_OPTION_NAME(type, name, init, doc) \
  case Option::name:                           \
    return #name;
    QKV_ATTENTION_OPTIONS(QKV_OPTION_NAME)
#undef QKV_OPTION_NAME
  }
  return "?";
}

const char* option_doc(Option option) {
  switch (option) {
#define QKV_OPTION_DOC(type, name, init, doc) \
  case Option::name:                          \
    return doc;
    QKV_ATTENTION_OPTIONS(QKV_OPTION_DOC)
#undef QKV_OPTION_DOC
  }
  return "?";
}

bool differs(const ConstTensorView& value, const ConstTensorView&) { return value.defined(); }

bool differs(const AdditiveScore& value, const AdditiveScore&) {
  return value.w_q.defined() || value.w_k.defined() || value.v.defined() || value.bias.defined();
}

bool differs(const RelativePositionBias& value, const RelativePositionBias&) {
  return value.table.defined();
}

bool differs(const SparsePattern& value, const SparsePattern&) { return value.defined(); }

bool differs(const ShardOffsets& value, const ShardOffsets&) {
  return value.position != 0 || value.row != 0 || value.key != 0 || value.head != 0 ||
         value.heads != 0 || value.partial_keys;
}

bool is_on(const AttentionOptions& options, Option option) {
  static const AttentionOptions defaults{};
  switch (option) {
#define QKV_OPTION_IS_ON(type, name, init, doc) \
  case Option::name:                            \
    return differs(options.name, defaults.name);
    QKV_ATTENTION_OPTIONS(QKV_OPTION_IS_ON)
#undef QKV_OPTION_IS_ON
  }
  return false;
}

}  // namespace qkv::detail
