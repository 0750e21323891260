// core/hwy_namespace.hpp — the namespace of per-target code, in the manner
// of Abseil's ABSL_NAMESPACE_BEGIN or fmt's FMT_BEGIN_NAMESPACE. Every
// Highway body (the -inl.h files, compiled once per target by
// foreach_target.h) lives in qkv::<ns>::HWY_NAMESPACE, with `hn` naming
// Highway's ops for that target, between HWY_BEFORE_NAMESPACE and
// HWY_AFTER_NAMESPACE, which set and restore the target's attributes:
//
//   QKV_HWY_NAMESPACE_BEGIN(cpu);
//   ...
//   QKV_HWY_NAMESPACE_END(cpu);
//
// Include after hwy/highway.h.
#pragma once

#define QKV_HWY_NAMESPACE_BEGIN(ns) \
  HWY_BEFORE_NAMESPACE();           \
  namespace qkv::ns {               \
  namespace HWY_NAMESPACE {         \
  namespace hn = hwy::HWY_NAMESPACE

#define QKV_HWY_NAMESPACE_END(ns) \
  } /* namespace HWY_NAMESPACE */ \
  } /* namespace qkv::ns */       \
  HWY_AFTER_NAMESPACE()
