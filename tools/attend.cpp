#include "attend.hpp"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <fstream>
#include <set>
#include <span>
#include <sstream>
#include <string_view>
#include <tuple>
#include <vector>

#include "cli_error.hpp"
#include "json_text.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/positional.hpp"

namespace qkv::tools {

namespace {

// "[2, 6, 4, 8]"; with the separator ",", the JSON array [2,6,4,8].
std::string shape_text(ConstTensorView t, const char* separator = ", ") {
  std::string s = "[";
  for (int d = 0; d < t.rank(); ++d) s += (d ? separator : "") + std::to_string(t.size(d));
  return s + "]";
}

// An integer from `text` (all of it), or an error naming `what`.
std::int64_t parse_int(const std::string& text, const std::string& what) {
  std::size_t used = 0;
  std::int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw Error(what + ": expected an integer, got '" + text + "'");
  }
  return v;
}

// Integers separated by commas (and, with `spaces`, white space); empty
// items are errors unless white space separates them.
std::vector<std::int64_t> parse_ints(std::string text, const std::string& what,
                                     bool spaces = false) {
  if (spaces) {
    std::replace_if(
        text.begin(), text.end(), [](char c) { return c == '\n' || c == '\r' || c == '\t'; }, ' ');
  }
  std::vector<std::int64_t> out;
  std::string item;
  std::stringstream in(text);
  while (std::getline(in, item, ',')) {
    if (!spaces) {
      out.push_back(parse_int(item, what));
      continue;
    }
    std::stringstream words(item);
    std::string word;
    bool any = false;
    while (words >> word) {
      out.push_back(parse_int(word, what));
      any = true;
    }
    if (!any) throw Error(what + ": expected an integer between two commas");
  }
  if (!text.empty() && text.back() == ',') throw Error(what + ": expected an integer after ','");
  return out;
}

// "L,R" -> (left, right).
std::pair<std::int64_t, std::int64_t> parse_window(const std::string& text) {
  const std::vector<std::int64_t> v = parse_ints(text, "--window");
  if (v.size() != 2) {
    throw Error("--window: expected L,R (two integers, -1 = unbounded), got '" + text + "'");
  }
  return {v[0], v[1]};
}

// "N,N,..." or a text file of integers separated by commas or white space.
std::vector<std::int64_t> parse_key_lengths(const std::string& arg) {
  if (arg.find_first_not_of("0123456789,-") == std::string::npos) {
    return parse_ints(arg, "--key-lengths");
  }
  std::ifstream file(arg);
  if (!file) throw Error("--key-lengths: cannot read '" + arg + "' (not a list N,N,... either)");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return parse_ints(text, "--key-lengths (" + arg + ")", true);
}

// [B, N, H, D] view of a rank-4 array in `layout`.
ConstTensorView as_bnhd(ConstTensorView t, const std::string& layout, const std::string& name) {
  if (t.rank() != 4) {
    throw Error(name + ": expected a 4-D array (" +
                (layout == "bnhd" ? "[B, N, H, D]" : "[B, H, N, D]") + "), got shape " +
                shape_text(t));
  }
  if (layout == "bnhd") return t;
  const std::vector<std::int64_t> sizes = {t.size(0), t.size(2), t.size(1), t.size(3)};
  const std::vector<std::int64_t> strides = {t.stride(0), t.stride(2), t.stride(1), t.stride(3)};
  return ConstTensorView(t.data(), t.dtype(), sizes, strides);
}

TensorView as_bnhd(TensorView t, const std::string& layout) {
  if (layout == "bnhd") return t;
  const std::vector<std::int64_t> sizes = {t.size(0), t.size(2), t.size(1), t.size(3)};
  const std::vector<std::int64_t> strides = {t.stride(0), t.stride(2), t.stride(1), t.stride(3)};
  return TensorView(t.data(), t.dtype(), sizes, strides);
}

// An array in `layout` for a [B, N, H, D] result of these sizes.
Tensor allocate(DType dtype, std::int64_t b, std::int64_t n, std::int64_t h, std::int64_t d,
                const std::string& layout) {
  return layout == "bnhd" ? Tensor(dtype, {b, n, h, d}) : Tensor(dtype, {b, h, n, d});
}

DType dtype_named(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  if (name == "f64") return DType::f64;
  throw Error("--dtype: expected f32, bf16, f16 or f64, got '" + name + "'");
}

std::string number(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// The learned per-head parameters ([Hq] .npy files): --NAME reads one and
// --d-NAME writes its gradient (NAME the option's, '-' for '_').
struct Learned {
  const char* name;  // the option: "sinks"
  const char* help;  // of --NAME
  std::span<const float> AttentionOptions::*option;
  TensorView GradientOutputs::*gradient;
};
constexpr Learned kLearned[] = {
    {"sinks", "Learned sink logits [Hq] (.npy): each joins\nits head's softmax denominators",
     &AttentionOptions::sinks, &GradientOutputs::d_sinks},
    {"score_scale",
     "Learned logit scales [Hq] (.npy): head h's\ndot-product scores times score_scale[h]",
     &AttentionOptions::score_scale, &GradientOutputs::d_score_scale},
};
constexpr std::size_t kLearnedCount = std::size(kLearned);

// Switches that modify a learned parameter: --NAME sets the option.
struct Switch {
  const char* name;     // the option: "score_scale_log_n"
  const char* help;     // of --NAME
  const char* summary;  // in the summary line
  bool AttentionOptions::*option;
};
constexpr Switch kSwitches[] = {
    {"score_scale_log_n",
     "With --score-scale: also times ln of each\nrow's keys (Scalable-Softmax)",
     "score_scale times ln n", &AttentionOptions::score_scale_log_n},
};

// "--score-scale" for "score_scale", after `prefix`.
std::string flag_of(std::string_view name, std::string_view prefix = "--") {
  std::string flag(prefix);
  for (const char c : name) flag += c == '_' ? '-' : c;
  return flag;
}

std::string gradient_flag_of(std::string_view name) { return flag_of(name, "--d-"); }

// A map's value, or "" where the key is absent.
template <class Map>
typename Map::mapped_type entry(const Map& map, const std::string& key) {
  const auto it = map.find(key);
  return it == map.end() ? typename Map::mapped_type{} : it->second;
}

// The library names an option by its field (options.dropout_p), the
// command line by its flag: each reason about an option a flag sets is
// reworded to name the flag, with the expected and actual values the
// library gave.
Error naming_flags(const Error& e) {
  std::vector<std::pair<std::string, std::string>> flags = {
      {"options.scale", "--scale"},
      {"options.window_left", "--window L"},
      {"options.window_right", "--window R"},
      {"options.key_lengths", "--key-lengths"},
      {"options.mask_requires_grad", "--d-mask"},
      {"options.mask", "--mask"},
      {"options.alibi_slopes", "--alibi-slopes"},
      {"options.softcap", "--softcap"},
      {"options.dropout_p", "--dropout"}};
  for (const Learned& l : kLearned)
    flags.emplace_back(std::string("options.") + l.name, flag_of(l.name));
  for (const Switch& w : kSwitches)
    flags.emplace_back(std::string("options.") + w.name, flag_of(w.name));
  std::vector<std::string> reasons;
  for (std::string r : e.reasons()) {
    for (const auto& [field, flag] : flags) {
      // The whole field: followed by ':' or an index, not a longer name.
      if (r.starts_with(field) && r.size() > field.size() &&
          (r[field.size()] == ':' || r[field.size()] == '[')) {
        r = flag + r.substr(field.size());
        break;
      }
    }
    reasons.push_back(std::move(r));
  }
  return Error(std::move(reasons));
}

// How many of an input's values are NaN and how many infinite, in the dtype
// the call reads them in.
struct NonFinite {
  std::int64_t nan = 0, inf = 0;
};

// `plus_only` counts +inf alone: a float mask's -inf drops a key, as meant.
NonFinite count_non_finite(const Tensor& t, bool plus_only = false) {
  NonFinite n;
  const auto count = [&](const auto* x) {
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      if (std::isnan(x[i])) {
        ++n.nan;
      } else if (std::isinf(x[i]) && (!plus_only || x[i] > 0)) {
        ++n.inf;
      }
    }
  };
  if (t.dtype() == DType::f64) {
    count(t.data<double>());
  } else if (t.dtype() == DType::f32) {
    count(t.data<float>());
  } else if (t.dtype() == DType::bf16 || t.dtype() == DType::f16) {
    const Tensor wide = to_dtype(t, DType::f32);  // exact
    count(wide.data<float>());
  }
  return n;
}

// "q (q.npy) holds 3 NaN and 1 inf values, v (v.npy) holds 1 NaN value" for
// the inputs that hold any; empty when none does.
std::string non_finite_inputs(
    const std::vector<std::tuple<std::string, NonFinite, const char*>>& inputs) {
  std::string text;
  for (const auto& [name, n, inf_word] : inputs) {
    if (n.nan + n.inf == 0) continue;
    std::string counts;
    if (n.nan > 0) counts = std::to_string(n.nan) + " NaN";
    if (n.inf > 0)
      counts += (counts.empty() ? "" : " and ") + std::to_string(n.inf) + " " + inf_word;
    text += (text.empty() ? "" : ", ") + name + " holds " + counts +
            (n.nan + n.inf == 1 ? " value" : " values");
  }
  return text;
}

// The option values, checked; the files each output goes to.
// The values of a floating-point .npy file, as f32, into `values`; returns
// the file's shape as text.
std::string load_floats(const std::string& file, const std::string& flag,
                        std::vector<float>& values) {
  const Tensor t = load_npy(file);
  if (t.dtype() == DType::boolean) {
    throw Error(flag + ": expected floating-point values, got bool in '" + file + "'");
  }
  const Tensor f = to_dtype(t, DType::f32);
  values.assign(f.data<float>(), f.data<float>() + f.numel());
  return shape_text(t);
}

struct Plan {
  AttentionOptions options;
  std::vector<std::int64_t> key_lengths;
  std::vector<float> slopes;
  std::array<std::vector<float>, kLearnedCount> learned;  // kLearned's values
  Tensor mask;
  std::vector<std::string> described;  // options as text, for the summary
};

// Every output path: given once, not an input, in a folder that exists and
// can be written (so that no output is written unless all can be).
void check_outputs(const AttendOptions& o) {
  std::set<std::string> seen;
  std::set<std::string> inputs = {o.q, o.k, o.v, o.mask, o.alibi_slopes, o.dout};
  std::vector<std::pair<std::string, std::string>> outputs = {
      {"-o", o.out},  {"--lse", o.lse}, {"--probs", o.probs},  {"--dq", o.dq},
      {"--dk", o.dk}, {"--dv", o.dv},   {"--d-mask", o.d_mask}};
  for (const Learned& l : kLearned) {
    inputs.insert(entry(o.learned, l.name));
    outputs.emplace_back(gradient_flag_of(l.name), entry(o.learned_gradients, l.name));
  }
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    if (!seen.insert(path).second) throw Error(flag + ": '" + path + "' is also another output");
    if (inputs.count(path) != 0) throw Error(flag + ": '" + path + "' is also an input");
    const std::size_t slash = path.find_last_of('/');
    const std::string folder = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    if (slash + 1 == path.size()) throw Error(flag + ": expected a file name, got '" + path + "'");
    if (::access(folder.c_str(), W_OK) != 0) {
      throw Error(flag + ": cannot write into folder '" + folder + "' of '" + path + "'");
    }
  }
}

Plan plan_of(const AttendOptions& o, std::int64_t hq) {
  Plan p;
  AttentionOptions& a = p.options;
  if (o.score == "scaled") {
    a.score = Score::scaled_dot;
  } else if (o.score == "dot") {
    a.score = Score::dot;
  } else {
    throw Error("--score: expected scaled or dot, got '" + o.score + "'");
  }
  a.scale = o.scale;
  if (o.scale) p.described.push_back("scale " + number(*o.scale));
  if (a.score == Score::dot) p.described.push_back("dot scores");
  a.causal = o.causal;
  if (o.align == "bottom-right") {
    a.align = Align::bottom_right;
  } else if (o.align == "top-left") {
    a.align = Align::top_left;
  } else {
    throw Error("--align: expected bottom-right or top-left, got '" + o.align + "'");
  }
  if (o.causal) p.described.push_back("causal (" + o.align + ")");
  if (!o.window.empty()) {
    std::tie(a.window_left, a.window_right) = parse_window(o.window);
    p.described.push_back("window (" + std::to_string(a.window_left) + ", " +
                          std::to_string(a.window_right) + ")");
  }
  if (!o.key_lengths.empty()) {
    p.key_lengths = parse_key_lengths(o.key_lengths);
    a.key_lengths = p.key_lengths;
    p.described.push_back("key lengths");
  }
  if (!o.mask.empty()) {
    p.mask = load_npy(o.mask);
    a.mask = p.mask;
    p.described.push_back(std::string(p.mask.dtype() == DType::boolean ? "bool" : "float") +
                          " mask " + shape_text(p.mask));
  }
  if (o.alibi && !o.alibi_slopes.empty()) {
    throw Error("--alibi and --alibi-slopes: expected one of them, got both");
  }
  if (o.alibi) {
    p.slopes = alibi_slopes(hq);
    p.described.push_back("ALiBi");
  } else if (!o.alibi_slopes.empty()) {
    p.described.push_back("ALiBi slopes " +
                          load_floats(o.alibi_slopes, "--alibi-slopes", p.slopes));
  }
  a.alibi_slopes = p.slopes;
  for (std::size_t i = 0; i < kLearnedCount; ++i) {
    const Learned& l = kLearned[i];
    const std::string file = entry(o.learned, l.name);
    if (file.empty()) continue;
    p.described.push_back(std::string(l.name) + " " +
                          load_floats(file, flag_of(l.name), p.learned[i]));
    a.*l.option = p.learned[i];
  }
  for (const Switch& w : kSwitches) {
    a.*w.option = entry(o.switches, w.name);
    if (a.*w.option) p.described.push_back(w.summary);
  }
  a.softcap = o.softcap;
  if (o.softcap != 0.0) p.described.push_back("softcap " + number(o.softcap));
  a.dropout_p = o.dropout;
  a.dropout_seed = o.seed;
  if (o.dropout != 0.0) {
    p.described.push_back("dropout " + number(o.dropout) + " seed " + std::to_string(o.seed));
  }
  if (o.backend == "automatic") {
    a.backend = Backend::automatic;
  } else if (o.backend == "fast") {
    a.backend = Backend::fast;
  } else if (o.backend == "reference") {
    a.backend = Backend::reference;
  } else {
    throw Error("--backend: expected automatic, fast or reference, got '" + o.backend + "'");
  }
  return p;
}

void check_flags(const AttendOptions& o) {
  if (o.layout != "bnhd" && o.layout != "bhnd") {
    throw Error("--layout: expected bnhd or bhnd, got '" + o.layout + "'");
  }
  if (o.out.empty()) throw Error("-o: expected an output file");
  if (o.threads < 0)
    throw Error("--threads: expected a count >= 1, got " + std::to_string(o.threads));
  const bool backward = !o.dout.empty();
  std::string gradient_flags = "--dq, --dk, --dv, --d-mask";
  bool any = !o.dq.empty() || !o.dk.empty() || !o.dv.empty();
  if (!o.d_mask.empty()) {
    any = true;
    if (!backward) throw Error("--d-mask: expected --backward DOUT with it");
    if (o.mask.empty()) throw Error("--d-mask: expected --mask FILE with it");
  }
  for (const Learned& l : kLearned) {
    const std::string flag = gradient_flag_of(l.name);
    gradient_flags += ", " + flag;
    if (entry(o.learned_gradients, l.name).empty()) continue;
    any = true;
    if (!backward) throw Error(flag + ": expected --backward DOUT with it");
    if (entry(o.learned, l.name).empty()) {
      throw Error(flag + ": expected " + flag_of(l.name) + " FILE with it");
    }
  }
  if (!backward && any) throw Error("--dq/--dk/--dv: expected --backward DOUT with them");
  if (backward && !any) {
    throw Error("--backward: expected at least one of " + gradient_flags);
  }
}

}  // namespace

LearnedFlags learned_flags() {
  LearnedFlags flags;
  for (const Learned& l : kLearned) {
    flags.inputs.push_back({l.name, flag_of(l.name), l.help});
    flags.gradients.push_back({l.name, gradient_flag_of(l.name),
                               std::string("Write dLoss/d") + l.name +
                                   " [Hq] (with --backward\nand " + flag_of(l.name) + ")"});
  }
  for (const Switch& w : kSwitches) flags.switches.push_back({w.name, flag_of(w.name), w.help});
  return flags;
}

int run_attend(const AttendOptions& o, std::ostream& out, std::ostream& err) {
  try {
    check_flags(o);
    check_outputs(o);
    if (o.threads > 0) omp_set_num_threads(o.threads);
    Tensor q = load_npy(o.q), k = load_npy(o.k), v = load_npy(o.v);
    if (!o.dtype.empty()) {
      const DType compute = dtype_named(o.dtype);
      q = to_dtype(q, compute);
      k = to_dtype(k, compute);
      v = to_dtype(v, compute);
    }
    const ConstTensorView qv = as_bnhd(q, o.layout, "q (" + o.q + ")");
    const ConstTensorView kv = as_bnhd(k, o.layout, "k (" + o.k + ")");
    const ConstTensorView vv = as_bnhd(v, o.layout, "v (" + o.v + ")");
    Plan plan = plan_of(o, qv.size(2));
    std::vector<std::tuple<std::string, NonFinite, const char*>> non_finite = {
        {"q (" + o.q + ")", count_non_finite(q), "inf"},
        {"k (" + o.k + ")", count_non_finite(k), "inf"},
        {"v (" + o.v + ")", count_non_finite(v), "inf"}};
    if (plan.mask.defined()) {
      non_finite.emplace_back("mask (" + o.mask + ")", count_non_finite(plan.mask, true), "+inf");
    }
    const std::int64_t b = qv.size(0), nq = qv.size(1), hq = qv.size(2), nk = kv.size(1);
    const std::int64_t dv = vv.size(3);
    const DType stat = q.dtype() == DType::f64 ? DType::f64 : DType::f32;

    Tensor result = allocate(q.dtype(), b, nq, hq, dv, o.layout);
    Tensor lse(stat, {b, hq, nq});
    Tensor probs = o.probs.empty() ? Tensor() : Tensor(stat, {b, hq, nq, nk});
    const auto start = std::chrono::steady_clock::now();
    attention_into(qv, kv, vv, {as_bnhd(result.view(), o.layout), lse.view(), probs.view()},
                   plan.options);
    Tensor dout, dq, dk, dvt, d_mask;
    std::array<Tensor, kLearnedCount> learned;  // the parameters' gradients
    if (!o.dout.empty()) {
      dout = load_npy(o.dout);
      if (dout.dtype() != q.dtype()) dout = to_dtype(dout, q.dtype());
      dq = allocate(q.dtype(), b, nq, hq, qv.size(3), o.layout);
      dk = allocate(q.dtype(), b, nk, kv.size(2), kv.size(3), o.layout);
      dvt = allocate(q.dtype(), b, nk, vv.size(2), dv, o.layout);
      GradientOutputs grads{.dq = as_bnhd(dq.view(), o.layout),
                            .dk = as_bnhd(dk.view(), o.layout),
                            .dv = as_bnhd(dvt.view(), o.layout)};
      for (std::size_t i = 0; i < kLearnedCount; ++i) {
        if (plan.learned[i].empty()) continue;
        learned[i] = Tensor(stat, {hq});
        grads.*kLearned[i].gradient = learned[i].view();
      }
      AttentionOptions backward = plan.options;
      if (!o.d_mask.empty()) {
        backward.mask_requires_grad = true;
        d_mask = Tensor(stat, plan.mask.view().size_span());
        grads.d_mask = d_mask.view();
      }
      attention_backward_into(qv, kv, vv, as_bnhd(result.view(), o.layout),
                              as_bnhd(dout, o.layout, "dout (" + o.dout + ")"), lse, grads,
                              backward);
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (dout.defined())
      non_finite.emplace_back("dout (" + o.dout + ")", count_non_finite(dout), "inf");

    std::vector<std::pair<std::string, const Tensor*>> written = {{o.out, &result}};
    if (!o.lse.empty()) written.emplace_back(o.lse, &lse);
    if (!o.probs.empty()) written.emplace_back(o.probs, &probs);
    if (!o.dq.empty()) written.emplace_back(o.dq, &dq);
    if (!o.dk.empty()) written.emplace_back(o.dk, &dk);
    if (!o.dv.empty()) written.emplace_back(o.dv, &dvt);
    if (!o.d_mask.empty()) written.emplace_back(o.d_mask, &d_mask);
    for (std::size_t i = 0; i < kLearnedCount; ++i) {
      if (const std::string file = entry(o.learned_gradients, kLearned[i].name); !file.empty()) {
        written.emplace_back(file, &learned[i]);
      }
    }
    for (const auto& [path, t] : written) save_npy(path, *t);

    // Inputs with NaN or infinities are computed as semantics.md defines, and noted.
    const std::string noted = non_finite_inputs(non_finite);
    if (!noted.empty()) {
      err << "qkv attend: note: " << noted
          << "; see docs/semantics.md, \"Fully masked rows, NaN and infinities\"\n";
    }
    std::string options;
    for (const std::string& d : plan.described) options += (options.empty() ? "" : ", ") + d;
    if (o.json) {
      out << "{\"q\":" << shape_text(q, ",") << ",\"k\":" << shape_text(k, ",")
          << ",\"v\":" << shape_text(v, ",") << ",\"layout\":" << json_string(o.layout)
          << ",\"dtype\":" << json_string(std::string(dtype_name(q.dtype())))
          << ",\"options\":" << json_string(options)
          << ",\"backward\":" << (o.dout.empty() ? "false" : "true")
          << ",\"threads\":" << omp_get_max_threads() << ",\"milliseconds\":" << ms
          << ",\"outputs\":[";
      for (std::size_t i = 0; i < written.size(); ++i) {
        out << (i ? "," : "") << "{\"path\":" << json_string(written[i].first)
            << ",\"shape\":" << shape_text(*written[i].second, ",") << "}";
      }
      out << "]}\n";
    } else {
      err << "qkv attend: q " << shape_text(q) << " k " << shape_text(k) << " v " << shape_text(v)
          << " " << dtype_name(q.dtype()) << " " << o.layout
          << (options.empty() ? "" : ", " + options) << (o.dout.empty() ? "" : ", backward")
          << " -> " << o.out << " " << shape_text(result) << " in " << ms << " ms on "
          << omp_get_max_threads() << (omp_get_max_threads() == 1 ? " thread\n" : " threads\n");
    }
    return 0;
  } catch (const Error& e) {
    return report_error(err, "qkv attend", naming_flags(e));
  }
}

}  // namespace qkv::tools
