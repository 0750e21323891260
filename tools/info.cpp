#include "info.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "json_text.hpp"
#include "peak_probe.hpp"
#include "qkv/internal/kernels.hpp"

namespace qkv::tools {

int run_info(std::ostream& out, const InfoOptions& options) {
  const internal::CpuReport r = internal::cpu_report(options.probe);
  const PeakProbe fma = options.probe ? probe_fma_peak(1) : PeakProbe{};
  const char* isa = std::getenv("QKV_ISA");
  const std::string limit = isa != nullptr && *isa != '\0' ? isa : "(unset)";
  char text[256];
  if (options.json) {
    out << "{\"vendor\":" << json_string(r.vendor) << ",\"model\":" << json_string(r.model)
        << ",\"target\":" << json_string(r.target) << ",\"qkv_isa\":" << json_string(limit);
    std::snprintf(text, sizeof text, ",\"fma_gflops\":%.6g,\"fma512_gflops\":%.6g", fma.gflops,
                  r.fma_gflops);
    out << text << ",\"families\":[";
    for (std::size_t i = 0; i < r.families.size(); ++i) {
      const internal::IsaFamily& f = r.families[i];
      std::snprintf(text, sizeof text, ",\"probe_gops\":%.6g", f.probe_gops);
      out << (i > 0 ? "," : "") << "{\"name\":" << json_string(f.name)
          << ",\"listed\":" << (f.listed ? "true" : "false")
          << ",\"usable\":" << (f.usable ? "true" : "false")
          << ",\"allowed\":" << (f.allowed ? "true" : "false")
          << ",\"reason\":" << json_string(f.reason) << text << "}";
    }
    out << "],\"bf16_engine\":" << json_string(r.bf16_engine)
        << ",\"bf16_engine_reason\":" << json_string(r.bf16_engine_reason) << "}\n";
    return 0;
  }
  out << "cpu:          " << r.vendor << ", " << r.model << "\n";
  out << "kernels:      Highway target " << r.target << "; QKV_ISA " << limit << "\n";
  if (options.probe) {
    std::snprintf(text, sizeof text, "f32 FMA:      %.1f GFLOP/s on one thread (%s)", fma.gflops,
                  fma.target);
    out << text;
    if (r.fma_gflops > 0) {
      std::snprintf(text, sizeof text, "; 512-bit %.1f", r.fma_gflops);
      out << text;
    }
    out << "\n";
  }
  out << "families:\n";
  for (const internal::IsaFamily& f : r.families) {
    std::snprintf(text, sizeof text, "  %-12s ", f.name.c_str());
    out << text;
    if (!f.listed) {
      out << "not on this CPU\n";
    } else if (!f.usable) {
      out << "listed, not usable: " << f.reason << "\n";
    } else if (!f.allowed) {
      out << "usable, off (QKV_ISA)\n";
    } else if (f.probe_gops > 0) {
      std::snprintf(
          text, sizeof text, "usable: %.1f G%s/s on one thread (%.2fx the FMA)", f.probe_gops,
          f.name.find("int8") != std::string::npos || f.name.find("vnni") != std::string::npos
              ? "OP"
              : "FLOP",
          f.probe_gops / (r.fma_gflops > 0 ? r.fma_gflops : fma.gflops));
      out << text << "\n";
    } else {
      out << "usable\n";
    }
  }
  out << "bf16 products: " << r.bf16_engine << " (" << r.bf16_engine_reason << ")\n";
  return 0;
}

}  // namespace qkv::tools
