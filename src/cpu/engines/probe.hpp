// Register probes of the instruction families (core/isa.hpp): independent
// chains of one instruction on one thread, no memory traffic, the rate an
// engine reaches at best. `qkv info` prints them; select.cpp compares
// VDPBF16PS with the f32 FMA of the same width before taking it.
#pragma once

#include "core/isa.hpp"

namespace qkv::cpu::engines {

// Operations per second / 1e9 of the family's instruction on this thread
// (flops for bf16, int8 multiply-adds counted as 2 ops), over about
// `seconds`. The family must be allowed (detail::family_allowed).
double probe_family_gops(detail::Family f, double seconds);

// The 512-bit f32 FMA on this thread (needs AVX-512F, which every family
// above implies), for comparing with probe_family_gops.
double probe_avx512_fma_gflops(double seconds);

}  // namespace qkv::cpu::engines
