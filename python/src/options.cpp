#include "options.hpp"

#include "qkv/error.hpp"

namespace qkv::python {

Score parse_score(const std::string& s) {
  if (s == "scaled_dot") return Score::scaled_dot;
  if (s == "dot") return Score::dot;
  if (s == "additive") return Score::additive;
  throw Error("score: expected 'scaled_dot', 'dot' or 'additive', got '" + s + "'");
}

Align parse_align(const std::string& s) {
  if (s == "bottom_right") return Align::bottom_right;
  if (s == "top_left") return Align::top_left;
  throw Error("align: expected 'bottom_right' or 'top_left', got '" + s + "'");
}

Backend parse_backend(const std::string& s) {
  if (s == "automatic") return Backend::automatic;
  if (s == "reference") return Backend::reference;
  if (s == "fast") return Backend::fast;
  throw Error("backend: expected 'automatic', 'reference' or 'fast', got '" + s + "'");
}

AttentionOptions Options::to_cpp() const {
  AttentionOptions o;
  o.score = parse_score(score);
  o.scale = scale;
  o.additive.w_q = view_of(additive_w_q, "additive_w_q");
  o.additive.w_k = view_of(additive_w_k, "additive_w_k");
  o.additive.v = view_of(additive_v, "additive_v");
  o.additive.bias = view_of(additive_bias, "additive_bias");
  o.causal = causal;
  o.align = parse_align(align);
  o.window_left = window_left;
  o.window_right = window_right;
  o.key_lengths = span_of(key_lengths);
  o.cu_seqlens_q = span_of(cu_seqlens_q);
  o.cu_seqlens_k = span_of(cu_seqlens_k);
  o.mask = view_of(mask, "mask");
  o.alibi_slopes = span_of(alibi_slopes);
  o.relative_bias.table = view_of(rel_bias_table, "rel_bias table");
  o.relative_bias.max_distance = rel_bias_max_distance;
  o.relative_bias.bidirectional = rel_bias_bidirectional;
  o.softcap = softcap;
  o.sparse = sparse;
  o.dropout_p = dropout_p;
  o.dropout_seed = dropout_seed;
  o.dropout_offset = dropout_offset;
  o.backend = parse_backend(backend);
  return o;
}

}  // namespace qkv::python
