// What the entry points share when they pick a backend: whether the fused
// kernels run, and the tile hooks that call the std::function options.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/flex.hpp"
#include "qkv/linear.hpp"

namespace qkv::detail {

// The fused kernels run for Backend::fast (validation rejected what they
// cannot run) and, on Backend::automatic, for f32, bf16 and f16 inputs that
// they support; the reference runs otherwise.
inline bool use_fast_kernels(const AttentionOptions& o, DType dtype, bool supported = true) {
  switch (o.backend) {
    case Backend::reference:
      return false;
    case Backend::fast:
      return true;
    case Backend::automatic:
      return dtype != DType::f64 && supported;
  }
  return false;
}

// Linear attention: the fast kernels run for Backend::fast, or
// Backend::automatic with f32, bf16 or f16 inputs.
inline bool use_fast_linear(const LinearAttentionOptions& options, DType dtype) {
  return options.backend == Backend::fast ||
         (options.backend == Backend::automatic && dtype != DType::f64);
}

// The options' score_mod and mask_mod as std::function calls, one per
// element of a tile, wrapped as tile hooks; hooks of empty functions are
// null so that the kernels skip them. `functions` must outlive the hooks.
inline TileMods function_tile_mods(const FlexCallables<ScoreMod, MaskMod>& functions) {
  TileMods mods = functions.tile_mods();
  if (!functions.score_mod) mods.score_mod = nullptr;
  if (!functions.mask_mod) {
    mods.mask_mod = nullptr;
    mods.admitted = nullptr;
  }
  return mods;
}

}  // namespace qkv::detail
