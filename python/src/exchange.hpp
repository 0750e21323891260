// Tensors in and out through DLPack's C exchange API (DLPack >= 1.2,
// `type(t).__dlpack_c_exchange_api__`, which PyTorch provides): the
// producer fills a non-owning DLTensor for an input and allocates an output
// from C, with no Python call and no capsule per tensor. The Python layer
// uses it for the plain attention call on PyTorch tensors, where per-call
// overhead is measured against PyTorch's own operator; every other call goes
// through DLPack capsules (arrays.hpp).
#pragma once

#include <nanobind/nanobind.h>

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

}  // namespace qkv::python
