// The resolved geometry of a linear attention call, which validation
// (api/validate.hpp) produces and the reference and the fast kernels
// consume, and the states a causal pass starts from and reports.
#pragma once

#include <cstdint>

#include "qkv/linear.hpp"

namespace qkv::detail {

// The geometry of a validated linear attention call.
struct LinearProblem {
  std::int64_t batch = 0;          // B
  std::int64_t nq = 0;             // query rows
  std::int64_t nk = 0;             // key rows
  std::int64_t hq = 0;             // query heads
  std::int64_t hkv = 0;            // KV heads
  std::int64_t d = 0;              // head dim of q and k
  std::int64_t dv = 0;             // head dim of v
  std::int64_t features = 0;       // M: D for the built-in maps, custom.features otherwise
  DType dtype = DType::f32;        // of q, k, v, out and the gradients
  DType state_dtype = DType::f32;  // of the state: f32, f64 for f64 inputs

  std::int64_t group() const { return hkv == 0 ? 0 : hq / hkv; }
};

// Where a causal pass starts and what it reports: the initial state (s_in,
// z_in; undefined = the empty prefix) and the final state (s_out, z_out;
// undefined = not requested), shaped [B, Hkv, M, Dv] and [B, Hkv, M]. The
// final state may be the initial state's memory (a step updates in place).
struct LinearStates {
  ConstTensorView s_in, z_in;
  TensorView s_out, z_out;
};

}  // namespace qkv::detail
