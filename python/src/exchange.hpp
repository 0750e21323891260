// Tensors in and out through DLPack's C exchange API (DLPack >= 1.2,
// `type(t).__dlpack_c_exchange_api__`, which PyTorch provides): the
// producer fills a non-owning DLTensor for an input and allocates an output
// from C, with no Python call and no capsule per tensor. The Python layer
// uses it for the plain attention call on PyTorch tensors, where per-call
// overhead is measured against PyTorch's own operator; every other call goes
// through DLPack capsules (arrays.hpp).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>

#include "options.hpp"

namespace qkv::python {

namespace nb = nanobind;

// attention(q, k, v) with `options` for tensors q [B, Nq, Hq, Dk],
// k [B, Nk, Hkv, Dk], v [B, Nk, Hkv, Dv] of one type that exports the
// exchange API: returns out [B, Nq, Hq, Dv] (dtype of q, contiguous),
// allocated by that library. Returns None, having done nothing, when the
// fast exchange does not apply (another type, no or an unknown version of the
// API, not 4-D, not in CPU memory, a dtype qkv does not take): the caller
// then takes the general path, which reports any error. Errors of the
// attention call itself raise as there (ValueError).
nb::object attention_exchange(nb::handle q, nb::handle k, nb::handle v, const Options& options);

// torch.nn.functional.scaled_dot_product_attention's forward in its layout,
// for tensors of one type that exports the exchange API: query [*batch, Hq,
// L, E], key [*batch, Hkv, S, E], value [*batch, Hkv, S, Ev] (rank 3 to 8;
// or [L, E], [S, E], [S, Ev]: one head), attn_mask None or broadcasting to
// [*batch, Hq, L, S] (bool, or float32 or q's dtype: added), causal masks
// aligned to the top left. Returns out [*batch, Hq, L, Ev] (dtype of query,
// contiguous) and, with return_lse, the tuple (out, lse [*batch, Hq, L],
// float32 or float64 for float64 inputs), computed on `threads` threads (0:
// OpenMP's current count). Returns None, having done nothing, when the
// inputs break one of PyTorch's rules or the views would need a copy (batch
// dimensions that no single stride walks): the caller's general path then
// reports the error or copies. Errors of the attention call itself raise
// ValueError.
nb::object sdpa_exchange(nb::handle query, nb::handle key, nb::handle value, nb::handle attn_mask,
                         std::optional<double> scale, bool is_causal, bool enable_gqa,
                         double dropout_p, std::uint64_t dropout_seed, int threads,
                         bool return_lse);

// Its backward: (dq, dk, dv), each contiguous in the layout and dtype of
// its input, from grad_out [*batch, Hq, L, Ev] and the forward's out and
// lse; the other arguments as the forward got them. None when the path does
// not apply (as above).
nb::object sdpa_backward_exchange(nb::handle grad_out, nb::handle query, nb::handle key,
                                  nb::handle value, nb::handle out, nb::handle lse,
                                  nb::handle attn_mask, std::optional<double> scale, bool is_causal,
                                  bool enable_gqa, double dropout_p, std::uint64_t dropout_seed,
                                  int threads);

}  // namespace qkv::python
