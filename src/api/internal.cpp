// qkv/internal/kernels.hpp: the kernels' internals that the tools use, behind
// a declared interface so that the tools include no private header.
#include "core/isa.hpp"
#include "core/sparse.hpp"
#include "cpu/engines/probe.hpp"
#include "cpu/engines/select.hpp"
#include "cpu/flash.hpp"
#include "qkv/internal/kernels.hpp"

namespace qkv::internal {

const char* kernel_target() { return cpu::flash_target(); }

CpuReport cpu_report(bool probe, double seconds) {
  detail::isa_limit();  // refuses a QKV_ISA it does not know, whatever else is set
  CpuReport r;
  r.vendor = detail::cpu_vendor();
  r.model = detail::cpu_model_name();
  r.target = cpu::flash_target();
  for (const detail::Family f : detail::kFamilies) {
    const detail::FamilySupport& s = detail::family_support(f);
    IsaFamily family{detail::family_name(f),    s.listed, s.usable,
                     detail::family_allowed(f), s.reason, 0.0};
    if (probe && family.allowed) family.probe_gops = cpu::engines::probe_family_gops(f, seconds);
    r.families.push_back(family);
  }
  const bool avx512 = detail::family_support(detail::Family::avx512_bf16).usable ||
                      detail::family_support(detail::Family::avx512_vnni).usable;
  if (probe && avx512) r.fma_gflops = cpu::engines::probe_avx512_fma_gflops(seconds);
  const auto engine = cpu::engines::bf16_engine();
  r.bf16_engine = engine ? cpu::engines::engine_name(*engine) : "f32";
  r.bf16_engine_reason = cpu::engines::bf16_engine_reason();
  return r;
}

const char* last_products_isa() { return detail::last_products_isa(); }

void exp_row(const float* src, std::int64_t n, float* dst) { cpu::exp_row(src, n, dst); }

void store_row(const float* src, std::int64_t n, void* dst, DType dtype) {
  cpu::store_row(src, n, dst, dtype);
}

bool admitted_pairs(const SparsePattern& pattern, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t p0, std::int64_t j0, std::int64_t cols,
                    std::uint8_t* keep) {
  const detail::PatternTile tile{h, i0, rows, p0, j0, cols};
  if (detail::coverage(pattern, tile) == detail::Coverage::none) return false;
  detail::fill_admitted(pattern, tile, keep);
  return true;
}

}  // namespace qkv::internal
