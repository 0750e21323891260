// qkv.context_parallel's native half: the transport-free pieces of ring and
// all-to-all attention (src/dist/pieces.hpp), the same code qkv::dist runs
// between its MPI messages. The Python layer moves the shards over
// torch.distributed and calls these between its messages:
//
//   shard_check         this rank's half of the collective check
//   ring_forward_step   one step's pieces, merged into f32/f64 accumulators
//   ring_add_sinks      the sinks, once, after the last step
//   ring_backward_step  one step's gradients, added into accumulators
//   shard_sink_gradients  this rank's rows' part of d_sinks
//   shard_query_map_gradients  dq' to dq, and this rank's part of the maps' gradients
//   heads_attention(_backward)  an all-to-all rank's heads over the whole sequence
//
// Every function takes the arguments of the whole call (the options of the
// whole problem, the layout, this rank and the rank count) and works out
// the pieces itself; the GIL is released while the kernels run.
#include "shards.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "api/validate.hpp"
#include "arrays.hpp"
#include "core/parameters.hpp"
#include "core/query_maps.hpp"
#include "dist/pieces.hpp"
#include "gradients.hpp"
#include "options.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace qkv::python {

dist::Layout parse_layout(const std::string& s) {
  if (s == "contiguous") return dist::Layout::contiguous;
  if (s == "zigzag") return dist::Layout::zigzag;
  throw Error("layout: expected 'contiguous' or 'zigzag', got '" + s + "'");
}

namespace {

using dist::detail::CallSpec;
using dist::detail::Setup;

// Checks that `rank` (and `holder`, a rank too) are ranks of `ranks`.
void check_ranks(int rank, int ranks, int holder = 0) {
  if (ranks < 1 || rank < 0 || rank >= ranks || holder < 0 || holder >= ranks) {
    throw Error("rank, holder, ranks: expected 0 <= rank, holder < ranks, got rank " +
                std::to_string(rank) + ", holder " + std::to_string(holder) + ", ranks " +
                std::to_string(ranks));
  }
}

CallSpec spec_of(const char* function, const std::string& layout, bool heads_divide = false) {
  return {.function = function, .layout = parse_layout(layout), .heads_divide = heads_divide};
}

// A contiguous accumulator of the inputs' working type (f32, f64 for f64
// inputs) with the given sizes; throws qkv::Error naming it otherwise.
TensorView accumulator(const Out& a, const char* name, DType real,
                       std::initializer_list<std::int64_t> sizes) {
  TensorView t = view_of(a, name);
  const std::span<const std::int64_t> want(sizes.begin(), sizes.size()), got = t.size_span();
  const bool same = std::equal(want.begin(), want.end(), got.begin(), got.end());
  if (t.dtype() != real || !same || !t.is_contiguous()) {
    throw Error(std::string(name) + ": expected a contiguous " + std::string(dtype_name(real)) +
                " accumulator of shape " + shape_string(want) + ", got " +
                std::string(dtype_name(t.dtype())) + " " + shape_string(got) +
                (t.is_contiguous() ? "" : " (not contiguous)"));
  }
  return t;
}

DType working_type(const Setup& s) { return s.dtype == DType::f64 ? DType::f64 : DType::f32; }

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::int64_t>>
shard_check(const std::string& function, const In& q, const In& k, const In& v,
            const std::optional<In>& out, const std::optional<In>& dout,
            const std::optional<In>& lse, const Options& options, const std::string& layout,
            int rank, int ranks, bool heads_divide) {
  check_ranks(rank, ranks);
  CallSpec spec = spec_of(function.c_str(), layout, heads_divide);
  spec.backward = out.has_value();
  spec.out = view_of(out, "out");
  spec.dout = view_of(dout, "dout");
  spec.lse = view_of(lse, "lse");
  const dist::detail::LocalCheck c = dist::detail::check_locally(
      view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), options.to_cpp(), spec, rank, ranks);
  std::vector<std::string> names;
  std::vector<std::int64_t> values;
  for (const dist::detail::Agreed& a : c.agreed) {
    names.push_back(a.name);
    values.push_back(a.value);
  }
  return {c.reasons, c.whole, names, values};
}

template <class Real>
Real* data_of(TensorView t) {
  return static_cast<Real*>(t.data());
}

void ring_forward_step(const In& q, const In& k, const In& v, const Out& acc, const Out& acc_lse,
                       const Options& options, const std::string& layout, int rank, int holder,
                       int ranks) {
  check_ranks(rank, ranks, holder);
  const AttentionOptions& o = options.to_cpp();
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  const Setup s =
      dist::detail::setup_of(qv, kv, vv, o, spec_of("ring_attention", layout), rank, ranks);
  const DType real = working_type(s);
  const TensorView a = accumulator(acc, "acc", real, {s.batch, s.nq, s.hq, s.dv});
  const TensorView l = accumulator(acc_lse, "acc_lse", real, {s.batch, s.hq, s.nq});
  nb::gil_scoped_release release;
  const auto groups = dist::detail::batch_groups(s, o);
  dist::detail::PieceCounts counts;
  if (real == DType::f64) {
    dist::detail::ring_forward_step<double>(s, o, groups, holder, qv, kv, vv, data_of<double>(a),
                                            data_of<double>(l), counts, {});
  } else {
    dist::detail::ring_forward_step<float>(s, o, groups, holder, qv, kv, vv, data_of<float>(a),
                                           data_of<float>(l), counts, {});
  }
}

void ring_add_sinks(const In& q, const In& k, const In& v, const Out& acc, const Out& acc_lse,
                    const Options& options, const std::string& layout, int rank, int ranks) {
  check_ranks(rank, ranks);
  const AttentionOptions& o = options.to_cpp();
  const Setup s = dist::detail::setup_of(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), o,
                                         spec_of("ring_attention", layout), rank, ranks);
  const DType real = working_type(s);
  const TensorView a = accumulator(acc, "acc", real, {s.batch, s.nq, s.hq, s.dv});
  const TensorView l = accumulator(acc_lse, "acc_lse", real, {s.batch, s.hq, s.nq});
  if (o.sinks.empty()) return;
  nb::gil_scoped_release release;
  if (real == DType::f64) {
    dist::detail::add_sinks<double>(s, o.sinks, data_of<double>(a), data_of<double>(l));
  } else {
    dist::detail::add_sinks<float>(s, o.sinks, data_of<float>(a), data_of<float>(l));
  }
}

void ring_backward_step(const In& q, const In& k, const In& v, const In& out, const In& dout,
                        const In& lse, const Out& dq, const Out& dk, const Out& dv,
                        const Options& options, const std::string& layout, int rank, int holder,
                        int ranks) {
  check_ranks(rank, ranks, holder);
  const AttentionOptions& o = options.to_cpp();
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  const ConstTensorView ov = view_of(out, "out"), gv = view_of(dout, "dout"),
                        lv = view_of(lse, "lse");
  CallSpec spec = spec_of("ring_attention_backward", layout);
  spec.backward = true;
  spec.out = ov;
  spec.dout = gv;
  spec.lse = lv;
  const Setup s = dist::detail::setup_of(qv, kv, vv, o, spec, rank, ranks);
  const DType real = working_type(s);
  const TensorView a = accumulator(dq, "dq", real, {s.batch, s.nq, s.hq, s.dk});
  const TensorView b = accumulator(dk, "dk", real, {s.batch, s.nk, s.hkv, s.dk});
  const TensorView c = accumulator(dv, "dv", real, {s.batch, s.nk, s.hkv, s.dv});
  nb::gil_scoped_release release;
  const auto groups = dist::detail::batch_groups(s, o);
  dist::detail::PieceCounts counts;
  if (real == DType::f64) {
    dist::detail::ring_backward_step<double>(s, o, groups, holder, qv, kv, vv, ov, gv, lv,
                                             data_of<double>(a), data_of<double>(b),
                                             data_of<double>(c), counts, {});
  } else {
    dist::detail::ring_backward_step<float>(s, o, groups, holder, qv, kv, vv, ov, gv, lv,
                                            data_of<float>(a), data_of<float>(b), data_of<float>(c),
                                            counts, {});
  }
}

Array shard_sink_gradients(const In& q, const In& k, const In& v, const In& out, const In& dout,
                           const In& lse, const Options& options, const std::string& layout,
                           int rank, int ranks) {
  check_ranks(rank, ranks);
  const AttentionOptions& o = options.to_cpp();
  CallSpec spec = spec_of("ring_attention_backward", layout);
  spec.backward = true;
  spec.out = view_of(out, "out");
  spec.dout = view_of(dout, "dout");
  spec.lse = view_of(lse, "lse");
  const Setup s = dist::detail::setup_of(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), o, spec,
                                         rank, ranks);
  Tensor d;
  {
    nb::gil_scoped_release release;
    d = dist::detail::local_sink_gradients(s, spec.out, spec.dout, spec.lse, o);
  }
  return owning_array(std::move(d));
}

nb::dict shard_query_map_gradients(const In& q, const In& k, const In& v, const Out& dq,
                                   const Options& options, const std::string& layout, int rank,
                                   int ranks) {
  check_ranks(rank, ranks);
  const AttentionOptions& o = options.to_cpp();
  const ConstTensorView qv = view_of(q, "q");
  const Setup s = dist::detail::setup_of(qv, view_of(k, "k"), view_of(v, "v"), o,
                                         spec_of("ring_attention_backward", layout), rank, ranks);
  const DType real = working_type(s);
  const TensorView acc = accumulator(dq, "dq", real, {s.batch, s.nq, s.hq, s.dk});
  AttentionGradients shares;
  {
    nb::gil_scoped_release release;
    shares = real == DType::f64
                 ? dist::detail::finish_query_maps<double>(s, o, qv, data_of<double>(acc))
                 : dist::detail::finish_query_maps<float>(s, o, qv, data_of<float>(acc));
  }
  return parameter_arrays(shares);
}

// The geometry head_options reads: Hq of the whole problem, this rank of
// `ranks`, from head-sharded q [B, N, Hq / R, Dk].
Setup heads_of(ConstTensorView q, const AttentionOptions& o, int rank, int ranks) {
  check_ranks(rank, ranks);
  if (q.rank() != 4) {
    throw Error("q: expected [B, N, Hq / R, Dk], got " + std::to_string(q.rank()) + " dimensions");
  }
  Setup s;
  s.rank = rank;
  s.ranks = ranks;
  s.hq = q.size(2) * ranks;
  const auto hq = static_cast<std::size_t>(s.hq);
  if (!o.sinks.empty() && o.sinks.size() != hq) {
    throw Error("options.sinks: expected Hq = " + std::to_string(hq) + " logits (the heads of " +
                "all ranks), got " + std::to_string(o.sinks.size()));
  }
  if (!o.alibi_slopes.empty() && (hq == 0 || o.alibi_slopes.size() % hq != 0)) {
    throw Error("options.alibi_slopes: expected a multiple of Hq = " + std::to_string(hq) +
                " slopes, got " + std::to_string(o.alibi_slopes.size()));
  }
  qkv::detail::Reasons reasons;  // the maps of the queries, for the heads of all ranks
  qkv::detail::check_query_maps(o, s.hq, reasons);
  qkv::detail::throw_if(reasons);
  return s;
}

void heads_attention(const In& q, const In& k, const In& v, const Out& out, const Out& lse,
                     const Options& options, int rank, int ranks) {
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  std::vector<float> slopes;
  const AttentionOptions o = dist::detail::head_options(
      options.to_cpp(), heads_of(qv, options.to_cpp(), rank, ranks), slopes);
  const AttentionOutputs outputs{view_of(out, "out"), view_of(lse, "lse")};
  nb::gil_scoped_release release;
  attention_into(qv, kv, vv, outputs, o);
}

nb::dict heads_attention_backward(const In& q, const In& k, const In& v, const In& out,
                                  const In& dout, const In& lse, const Out& dq, const Out& dk,
                                  const Out& dv, const Options& options, int rank, int ranks) {
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  const ConstTensorView ov = view_of(out, "out"), gv = view_of(dout, "dout"),
                        lv = view_of(lse, "lse");
  std::vector<float> slopes;
  const AttentionOptions o = dist::detail::head_options(
      options.to_cpp(), heads_of(qv, options.to_cpp(), rank, ranks), slopes);
  // The gradients of the parameters the options use, for this rank's heads.
  AttentionGradients parameters;
  qkv::detail::allocate_parameter_gradients(qkv::detail::check_attention_inputs(qv, kv, vv, o), o,
                                            parameters);
  GradientOutputs grads = qkv::detail::views_of(parameters);
  grads.dq = view_of(dq, "dq");
  grads.dk = view_of(dk, "dk");
  grads.dv = view_of(dv, "dv");
  {
    nb::gil_scoped_release release;
    attention_backward_into(qv, kv, vv, ov, gv, lv, grads, o);
  }
  return parameter_arrays(parameters);
}

}  // namespace

void bind_shards(nb::module_& m) {
  m.def("shard_check", &shard_check, "function"_a, "q"_a, "k"_a, "v"_a, "out"_a.none(),
        "dout"_a.none(), "lse"_a.none(), "options"_a, "layout"_a, "rank"_a, "ranks"_a,
        "heads_divide"_a,
        "This rank's half of a context-parallel call's collective check: (reasons of this "
        "rank's inputs, reasons of the whole problem once every rank agrees, the names and "
        "values every rank must pass alike). Backward checks pass out, dout and lse.");
  m.def("ring_forward_step", &ring_forward_step, "q"_a, "k"_a, "v"_a, "acc"_a, "acc_lse"_a,
        "options"_a, "layout"_a, "rank"_a, "holder"_a, "ranks"_a,
        "One ring step: this rank's q [B, nq, Hq, Dk] against the shard of rank `holder` (k [B, "
        "nk, Hkv, Dk], v [B, nk, Hkv, Dv]), merged into acc [B, nq, Hq, Dv] and acc_lse [B, Hq, "
        "nq] (contiguous float32, float64 for float64 inputs; start at 0 and -inf).");
  m.def("ring_add_sinks", &ring_add_sinks, "q"_a, "k"_a, "v"_a, "acc"_a, "acc_lse"_a, "options"_a,
        "layout"_a, "rank"_a, "ranks"_a,
        "The options' sinks added to the merged rows of ring_forward_step's accumulators, once.");
  m.def("ring_backward_step", &ring_backward_step, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a,
        "dq"_a, "dk"_a, "dv"_a, "options"_a, "layout"_a, "rank"_a, "holder"_a, "ranks"_a,
        "One backward ring step: the gradients of this rank's rows against the shard of "
        "`holder` added into dq [B, nq, Hq, Dk] and the held shard's dk, dv (contiguous float32, "
        "float64 for float64 inputs).");
  m.def("shard_sink_gradients", &shard_sink_gradients, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a,
        "lse"_a, "options"_a, "layout"_a, "rank"_a, "ranks"_a,
        "This rank's rows' part of d_sinks [Hq]; the whole problem's is the sum over the ranks.");
  m.def("shard_query_map_gradients", &shard_query_map_gradients, "q"_a, "k"_a, "v"_a, "dq"_a,
        "options"_a, "layout"_a, "rank"_a, "ranks"_a,
        "With maps of the queries: dq, ring_backward_step's accumulator of the "
        "gradient of the mapped queries, turned into q's gradient in place; returns {gradient: "
        "this rank's rows' part} of the maps' parameters (the whole problem's is the sum over "
        "the ranks; empty without maps).");
  m.def("heads_attention", &heads_attention, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "options"_a,
        "rank"_a, "ranks"_a,
        "An all-to-all rank's attention: its Hq / R heads of the whole sequence (q [B, N, Hq / R, "
        "Dk]) with the options of the whole problem (dropout streams, ALiBi slopes and sinks of "
        "those heads).");
  m.def("heads_attention_backward", &heads_attention_backward, "q"_a, "k"_a, "v"_a, "out"_a,
        "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "options"_a, "rank"_a, "ranks"_a,
        "The gradients of heads_attention into dq, dk, dv; returns {row name: gradient} of the "
        "parameters the options use, for this rank's heads.");
}

}  // namespace qkv::python
