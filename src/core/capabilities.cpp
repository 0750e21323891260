#include "core/capabilities.hpp"

#include <array>
#include <iterator>
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
// An option without a row is taken by the forward and the backward alone
// (kDefault): a new option is refused by name everywhere else until a path
// learns it and the option gets its row. The capability test holds every
// path to its letter, the backward's default included.
// matmul_precision is a permission every path takes: one without faster
// products computes at `highest`.
// dropout_seed and dropout_offset are parameters of dropout_p, return_lse
// and return_probs requests of the allocating forward; the backward takes
// the forward's options whole and passes over the requests.
constexpr const char* kDefault = "yy-----";
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
    {Option::mask_requires_grad, "yyy----"},
    {Option::alibi_slopes,   "yyy--yy"},
    {Option::sinks,          "yyy-yyy"},
    {Option::score_scale,    "yy---yy"},
    {Option::score_scale_log_n, "yy---yy"},
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

constexpr bool is_path_string(const char* p) {
  for (int c = 0; c < kPathCount; ++c) {
    if (p[c] != 'y' && p[c] != '-') return false;
  }
  return p[kPathCount] == '\0' && p[0] == 'y';
}

// Rows in the options' order (so none twice), each with one 'y' or '-' per
// Path and the forward's 'y'; the default likewise.
constexpr bool table_is_valid() {
  if (!is_path_string(kDefault)) return false;
  for (std::size_t i = 0; i < std::size(kTable); ++i) {
    if (i > 0 && !(kTable[i - 1].option < kTable[i].option)) return false;
    if (!is_path_string(kTable[i].paths)) return false;
  }
  return true;
}
static_assert(table_is_valid(),
              "kTable's rows follow QKV_ATTENTION_OPTIONS' order, at most one per option, each "
              "with one 'y' or '-' per Path, 'y' for the forward");

// Every option's row, kDefault where it has none.
constexpr std::array<const char*, kOptionCount> paths_of_options() {
  std::array<const char*, kOptionCount> paths{};
  paths.fill(kDefault);
  for (const Row& row : kTable) paths[static_cast<std::size_t>(row.option)] = row.paths;
  return paths;
}
constexpr std::array<const char*, kOptionCount> kPaths = paths_of_options();

}  // namespace

const char* path_name(Path path) {
  constexpr const char* kNames[] = {"qkv::attention",
                                    "qkv::attention_backward",
                                    "the fused backward of Score::additive",
                                    "the additive backward's own weights",
                                    "the split of a dilated pattern",
                                    "decode_attention",
                                    "qkv::dist"};  // in Path's order
  static_assert(std::size(kNames) == kPathCount);
  return kNames[static_cast<int>(path)];
}

bool supports(Path path, Option option) {
  return kPaths[static_cast<std::size_t>(option)][static_cast<int>(path)] == 'y';
}

std::vector<Option> unsupported(Path path, const AttentionOptions& options) {
  std::vector<Option> out;
  for (std::size_t i = 0; i < kOptionCount; ++i) {
    const auto option = static_cast<Option>(i);
    if (!supports(path, option) && is_on(options, option)) out.push_back(option);
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
