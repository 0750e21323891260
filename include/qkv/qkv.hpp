// qkv — attention mechanisms for CPUs.
//
//   #include <qkv/qkv.hpp>
//
//   // Two sequences of 4 tokens, 2 heads of dimension 8, in [B, N, H, D].
//   qkv::Tensor q(qkv::DType::f32, {2, 4, 2, 8}), k = q, v = q;
//   ... fill q, k, v ...
//   qkv::AttentionOptions opt;
//   opt.causal = true;              // each token sees itself and earlier ones
//   opt.return_lse = true;
//   qkv::AttentionResult r = qkv::attention(q, k, v, opt);
//   // r.out: [2, 4, 2, 8]; r.lse: [2, 2, 4]
//
// See qkv/attention.hpp for the full semantics, shapes and options,
// qkv/flex.hpp for score_mod / mask_mod callables inlined into the kernels,
// and qkv/modules/ for the layers (qkv::nn) built on them.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/decode.hpp"
#include "qkv/dtype.hpp"
#include "qkv/error.hpp"
#include "qkv/files.hpp"
#include "qkv/flex.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/linear.hpp"
#include "qkv/modules/additive.hpp"
#include "qkv/modules/linear.hpp"
#include "qkv/modules/multihead_attention.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/modules/positional.hpp"
#include "qkv/modules/safetensors.hpp"
#include "qkv/modules/vision.hpp"
#include "qkv/npy.hpp"
#include "qkv/positional.hpp"
#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"
