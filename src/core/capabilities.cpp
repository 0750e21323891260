#include "core/capabilities.hpp"

#include <array>
#include <string>

namespace qkv::detail {
namespace {

struct Row {
  Option option;
  // One character per Path, in its order: 'y' takes the option, '-' does not.
  const char* paths;
};

// Columns: forward, backward, additive_backward, additive_own_weights,
// dilated_split, decode, context_parallel. What a '-' means:
// - forward: none (the forward takes every option).
// - backward: refused; a score_mod callable has no derivative.
// - additive_backward: falls back to the reference backward on
//   Backend::automatic; refused on Backend::fast.
// - additive_own_weights: falls back to the weights of the forward's
//   probabilities pass, which apply every mask and bias.
// - dilated_split: falls back to one call with the pattern (the split needs
//   a problem whose scores do not depend on absolute positions).
// - decode: refused; decoding reads keys from a KvCache, whose lengths are
//   the key lengths, and its queries are the newest tokens (bottom-right).
// - context_parallel: refused; qkv::dist cuts the sequence into pieces
//   and sets options.shard itself.
// matmul_precision is a permission every path takes: one without faster
// products computes at `highest`.
// dropout_seed and dropout_offset are parameters of dropout_p, return_lse
// and return_probs requests of the allocating forward; the backward takes
// the forward's options whole and passes over the requests.
constexpr Row kTable[] = {
    // clang-format off
    //                          f b a o s d c
    {Option::score,          "yyyyyyy"},
    {Option::scale,          "yyyyyyy"},
    {Option::additive,       "yyyyy--"},
    {Option::causal,         "yyy-yyy"},
    {Option::align,          "yyyyy-y"},
    {Option::window_left,    "yyy--yy"},
    {Option::window_right,   "yyy---y"},
    {Option::key_lengths,    "yyyy--y"},
    {Option::cu_seqlens_q,   "yyy----"},
    {Option::cu_seqlens_k,   "yyy----"},
    {Option::mask,           "yyy----"},
    {Option::alibi_slopes,   "yyy--yy"},
    {Option::sinks,          "yyy-yyy"},
    {Option::relative_bias,  "yy-----"},
    {Option::softcap,        "yy--yyy"},
    {Option::score_mod,      "y------"},
    {Option::mask_mod,       "yyy----"},
    {Option::sparse,         "yyy-yy-"},
    {Option::dropout_p,      "yy----y"},
    {Option::dropout_seed,   "yyyyyyy"},
    {Option::dropout_offset, "yyyyyyy"},
    {Option::shard,          "yyy-y--"},
    {Option::backend,        "yyyyyyy"},
    {Option::matmul_precision, "yyyyyyy"},
    {Option::return_lse,     "yyyyyyy"},
    {Option::return_probs,   "yyyy---"},
    // clang-format on
};

constexpr bool table_is_complete() {
  if (std::size(kTable) != kOptionCount) return false;
  for (std::size_t i = 0; i < std::size(kTable); ++i) {
    if (static_cast<std::size_t>(kTable[i].option) != i) return false;
    const char* p = kTable[i].paths;
    for (int c = 0; c < kPathCount; ++c) {
      if (p[c] != 'y' && p[c] != '-') return false;
    }
    if (p[kPathCount] != '\0') return false;
  }
  return true;
}
static_assert(table_is_complete(),
              "kTable needs one row per option of QKV_ATTENTION_OPTIONS, in its order, each "
              "with one 'y' or '-' per Path");

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::forward:
      return "qkv::attention";
    case Path::backward:
      return "qkv::attention_backward";
    case Path::additive_backward:
      return "the fused backward of Score::additive";
    case Path::additive_own_weights:
      return "the additive backward's own weights";
    case Path::dilated_split:
      return "the split of a dilated pattern";
    case Path::decode:
      return "decode_attention";
    case Path::context_parallel:
      return "qkv::dist";
  }
  return "?";
}

bool supports(Path path, Option option) {
  return kTable[static_cast<std::size_t>(option)].paths[static_cast<int>(path)] == 'y';
}

std::vector<Option> unsupported(Path path, const AttentionOptions& options) {
  std::vector<Option> out;
  for (const Row& row : kTable) {
    if (!supports(path, row.option) && is_on(options, row.option)) out.push_back(row.option);
  }
  return out;
}

void refuse_unsupported(Path path, const AttentionOptions& options, std::string_view by,
                        std::string_view why, Reasons& reasons) {
  for (const Option option : unsupported(path, options)) {
    reasons.push_back(std::string("options.") + option_name(option) + ": not supported by " +
                      std::string(by) + std::string(why));
  }
}

}  // namespace qkv::detail
