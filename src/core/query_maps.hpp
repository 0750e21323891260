// core/query_maps.hpp — learned maps of the queries. A parameter that acts
// on the scores only through the queries (options.score_scale: the logits
// of row i of head h times c_hi, which is the dot product of c_hi q_i with
// k_j) is run by every path on the mapped queries with the map taken out of
// the options, and its gradient is pulled back from dq', the gradient of
// the mapped queries. So no kernel sees it: the entry points, the f32
// yardstick, decode and the ring's steps call the functions below, and a new
// map is a file of its own and its row in kQueryMaps (query_maps.cpp).
//
// The mapped queries are wider than 16-bit inputs, so no path rounds them
// to bf16 or f16 (an engine at matmul_precision medium rounds its operands
// as it always does): f64 for the reference, which then computes the mapped
// dot products in double, f32 for the fused kernels, which widen every
// query to f32 anyway (one rounding of the mapped row to f32 per map).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/checks.hpp"
#include "core/problem.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv::detail {

// One query row of q.
struct QueryRow {
  std::int64_t batch = 0;  // its batch entry
  std::int64_t row = 0;    // its index in q's dimension 1
  // The keys of its key range in the whole problem (causal, window,
  // key_lengths, alignment; masks given as data come on top and do not
  // count).
  std::int64_t keys = 0;
};

// One learned map of the queries: a row of kQueryMaps.
struct QueryMap {
  // Whether the options ask for it.
  bool (*used)(const AttentionOptions& o);
  // Appends a reason for each problem of its options for Hq query heads
  // (called whether it is used or not: a modifier without its parameter is
  // a problem too).
  void (*check)(const AttentionOptions& o, std::int64_t hq, Reasons& r);
  // Takes it out of the options.
  void (*remove)(AttentionOptions& o);
  // Keeps the values of heads [h0, h0 + n) of its per-head options (an
  // all-to-all rank's heads); called only where the options use it.
  void (*select_heads)(AttentionOptions& o, std::int64_t h0, std::int64_t n);
  // Writes the mapped rows of q into `mapped` (q's shape; rows not listed
  // are left unwritten).
  void (*apply)(ConstTensorView q, std::span<const QueryRow> rows, const AttentionOptions& o,
                TensorView mapped);
  // From dq', the gradient of the mapped rows: dq on the rows (dq may be dq'
  // itself), and the rows' sum of its parameter's gradient into `d_param`
  // (undefined: not asked).
  void (*pull_back)(ConstTensorView q, ConstTensorView dq_mapped, std::span<const QueryRow> rows,
                    const AttentionOptions& o, TensorView dq, TensorView d_param);
  // Its parameter's gradient: the fields of its QKV_ATTENTION_PARAMETERS row.
  Tensor AttentionGradients::*gradient;
  TensorView GradientOutputs::*gradient_view;
};

// The maps, in the order they apply to the queries (kQueryMaps). The
// functions that apply them take another list for tests.
std::span<const QueryMap* const> query_maps();

// Whether the options use any map of the queries.
bool maps_queries(const AttentionOptions& o);

// Every map's check (query_maps.hpp's QueryMap::check).
void check_query_maps(const AttentionOptions& o, std::int64_t hq, Reasons& r);

// The options without their maps: what the paths run on mapped queries.
AttentionOptions without_query_maps(const AttentionOptions& o);

// The options of heads [h0, h0 + n) for every map the options use.
void select_query_map_heads(AttentionOptions& o, std::int64_t h0, std::int64_t n);

// Every row of a call's q (problem p), with its key range's size.
std::vector<QueryRow> query_rows(const AttentionProblem& p, const AttentionOptions& o);

// The queries through every map the options use, in kQueryMaps' order
// (each map's output in `dtype`): [B, Nq, Hq, Dq] in `dtype`, zero in rows
// not listed; only for options that map the queries (maps_queries). The
// overload with a problem takes all of its rows. `maps` replaces the list
// in tests.
Tensor mapped_queries(ConstTensorView q, std::span<const QueryRow> rows, const AttentionOptions& o,
                      DType dtype, std::span<const QueryMap* const> maps = query_maps());
Tensor mapped_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o,
                      DType dtype);

// What the paths compute on the mapped queries: grads with dq', the gradient
// of the mapped queries, for dq and without the maps' parameter gradients.
GradientOutputs mapped_gradients(const GradientOutputs& grads, TensorView dq_mapped);

// From dq', the gradient of the mapped queries: dq on the rows (dq may be dq'
// itself), and each used map's parameter gradient into its field of `grads`
// where that is defined, pulled back through the maps in reverse order;
// `dtype` is the one the queries were mapped in (mapped_queries), which the
// inputs of the maps after the first are recomputed in. Only for options
// that map the queries. `maps` replaces the list in tests.
void query_map_gradients(ConstTensorView q, ConstTensorView dq_mapped,
                         std::span<const QueryRow> rows, const AttentionOptions& o, DType dtype,
                         TensorView dq, const GradientOutputs& grads,
                         std::span<const QueryMap* const> maps = query_maps());

// The maps of the list that the options use, in order.
std::vector<const QueryMap*> used_query_maps(const AttentionOptions& o,
                                             std::span<const QueryMap* const> maps = query_maps());

}  // namespace qkv::detail
