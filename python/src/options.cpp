#include "options.hpp"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "arrays.hpp"
#include "qkv/error.hpp"

namespace qkv::python {
namespace {

using Keep = std::vector<std::shared_ptr<void>>;

// An array of type A from `value`, kept alive in `keep`.
template <class A>
const A& hold(nb::handle value, Keep& keep) {
  auto a = std::make_shared<A>(nb::cast<A>(value));
  keep.push_back(a);
  return *a;
}

ConstTensorView view_from(nb::handle value, const std::string& name, Keep& keep) {
  if (value.is_none()) return {};
  return view_of(hold<In>(value, keep), name);
}

// From Python to the C++ type of a row. A type without a specialization is
// not a keyword (the callables, the shard offsets).
template <class T>
struct Convert {
  static constexpr bool exposed = false;
};

template <class T>
requires std::is_arithmetic_v<T>
struct Convert<T> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = nullptr;
  static constexpr const char* schema = std::is_same_v<T, bool> ? "bool"
                                        : std::is_integral_v<T> ? "int"
                                                                : "float";
  static std::string schema_default(T value) {
    if constexpr (std::is_same_v<T, bool>) {
      return value ? "True" : "False";
    } else if constexpr (std::is_integral_v<T>) {
      return std::to_string(value);
    } else {
      return nb::cast<std::string>(nb::repr(nb::float_(static_cast<double>(value))));
    }
  }
  static constexpr const char* expected = std::is_same_v<T, bool> ? "a bool"
                                          : std::is_integral_v<T> ? "an int"
                                                                  : "a float";
  static T from(nb::handle value, const char*, Keep&) { return nb::cast<T>(value); }
};

template <>
struct Convert<std::optional<double>> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = nullptr;
  static constexpr const char* schema = "float?";
  static std::string schema_default(const std::optional<double>&) { return "None"; }
  static constexpr const char* expected = "a float or None";
  static std::optional<double> from(nb::handle value, const char*, Keep&) {
    if (value.is_none()) return std::nullopt;
    return nb::cast<double>(value);
  }
};

// Enumerations by their C++ names, as strings.
template <class E>
struct Names;
template <>
struct Names<Score> {
  static constexpr std::pair<const char*, Score> all[] = {
      {"scaled_dot", Score::scaled_dot}, {"dot", Score::dot}, {"additive", Score::additive}};
};
template <>
struct Names<Align> {
  static constexpr std::pair<const char*, Align> all[] = {{"bottom_right", Align::bottom_right},
                                                          {"top_left", Align::top_left}};
};
template <>
struct Names<Backend> {
  static constexpr std::pair<const char*, Backend> all[] = {{"automatic", Backend::automatic},
                                                            {"reference", Backend::reference},
                                                            {"fast", Backend::fast}};
};
template <>
struct Names<MatmulPrecision> {
  static constexpr std::pair<const char*, MatmulPrecision> all[] = {
      {"highest", MatmulPrecision::highest},
      {"medium", MatmulPrecision::medium},
      {"int8", MatmulPrecision::int8}};
};

template <class E>
requires std::is_enum_v<E>
struct Convert<E> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = nullptr;
  static constexpr const char* schema = "str";
  static std::string schema_default(E value) {
    for (const auto& [text, e] : Names<E>::all) {
      if (e == value) return std::string("\"") + text + "\"";
    }
    return "?";
  }
  static constexpr const char* expected = "a str";
  static E from(nb::handle value, const char* name, Keep&) {
    const std::string s = nb::cast<std::string>(value);
    std::string choices;
    const std::size_t n = std::size(Names<E>::all);
    for (std::size_t i = 0; i < n; ++i) {
      const auto& [text, e] = Names<E>::all[i];
      if (s == text) return e;
      choices += (i == 0 ? "'" : i + 1 == n ? " or '" : ", '") + std::string(text) + "'";
    }
    throw Error(std::string(name) + ": expected " + choices + ", got '" + s + "'");
  }
};

template <class Elem, class Array>
struct ConvertSpan {
  static constexpr bool exposed = true;
  static constexpr const char* kind = std::is_same_v<Elem, float> ? "floats" : "ints";
  static constexpr const char* schema = "Tensor?";
  static std::string schema_default(std::span<const Elem>) { return "None"; }
  static constexpr const char* expected = "a 1-D array or None";
  static std::span<const Elem> from(nb::handle value, const char*, Keep& keep) {
    if (value.is_none()) return {};
    const Array& a = hold<Array>(value, keep);
    return {a.data(), a.size()};
  }
};
template <>
struct Convert<std::span<const std::int64_t>> : ConvertSpan<std::int64_t, Ints> {};
template <>
struct Convert<std::span<const float>> : ConvertSpan<float, Floats> {};

template <>
struct Convert<ConstTensorView> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = "array";
  static constexpr const char* schema = "Tensor?";
  static std::string schema_default(const ConstTensorView&) { return "None"; }
  static constexpr const char* expected = "an array or None";
  static ConstTensorView from(nb::handle value, const char* name, Keep& keep) {
    return view_from(value, name, keep);
  }
};

// (w_q, w_k, v) or (w_q, w_k, v, bias), as qkv.Additive.
template <>
struct Convert<AdditiveScore> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = "additive";
  static constexpr const char* schema = nullptr;
  static constexpr const char* expected = "qkv.Additive(w_q, w_k, v, bias) or None";
  static AdditiveScore from(nb::handle value, const char* name, Keep& keep) {
    if (value.is_none()) return {};
    const nb::tuple t = nb::cast<nb::tuple>(value);
    if (t.size() != 3 && t.size() != 4) {
      throw Error(std::string(name) + ": expected (w_q, w_k, v) or (w_q, w_k, v, bias), got " +
                  std::to_string(t.size()) + " items");
    }
    const std::string n(name);
    return {view_from(t[0], n + ".w_q", keep), view_from(t[1], n + ".w_k", keep),
            view_from(t[2], n + ".v", keep),
            t.size() == 4 ? view_from(t[3], n + ".bias", keep) : ConstTensorView{}};
  }
};

// (table, max_distance, bidirectional), as qkv.RelativeBias.
template <>
struct Convert<RelativePositionBias> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = "relative_bias";
  static constexpr const char* schema = nullptr;
  static constexpr const char* expected = "qkv.RelativeBias(table, max_distance, bidirectional)";
  static RelativePositionBias from(nb::handle value, const char* name, Keep& keep) {
    if (value.is_none()) return {};
    const nb::tuple t = nb::cast<nb::tuple>(value);
    if (t.size() != 3) {
      throw Error(std::string(name) + ": expected (table, max_distance, bidirectional), got " +
                  std::to_string(t.size()) + " items");
    }
    return {view_from(t[0], std::string(name) + ".table", keep), nb::cast<std::int64_t>(t[1]),
            nb::cast<bool>(t[2])};
  }
};

template <>
struct Convert<SparsePattern> {
  static constexpr bool exposed = true;
  static constexpr const char* kind = nullptr;
  static constexpr const char* schema = nullptr;
  static constexpr const char* expected = "a qkv.SparsePattern or None";
  static SparsePattern from(nb::handle value, const char*, Keep&) {
    if (value.is_none()) return {};
    return nb::cast<SparsePattern>(value);
  }
};

// Sets `field` (row `row`, called `name`) when `key` is its name; returns
// whether it did. Nothing changes when the value is refused.
template <class T>
bool set_row(Options& o, T& field, std::size_t row, const char* name, std::string_view key,
             nb::handle value) {
  if constexpr (!Convert<T>::exposed) {
    return false;
  } else {
    if (key != name) return false;
    Keep keep;
    T converted;
    try {
      converted = Convert<T>::from(value, name, keep);
    } catch (const nb::cast_error&) {
      throw nb::type_error((std::string(name) + ": expected " + Convert<T>::expected + ", got " +
                            nb::inst_name(value).c_str())
                               .c_str());
    }
    field = std::move(converted);
    o.arrays[row] = std::move(keep);
    o.py[row] = nb::borrow(value);
    return true;
  }
}

bool set_option(Options& o, std::string_view key, nb::handle value) {
  std::size_t row = 0;
#define QKV_OPTION_SET(type, name, init, doc)                      \
  if (set_row(o, o.cpp.name, row, #name, key, value)) return true; \
  ++row;
  QKV_ATTENTION_OPTIONS(QKV_OPTION_SET)
#undef QKV_OPTION_SET
  return false;
}

// Registers row `row` (`name`, of type T, default `init`): its property, its
// kind, and its argument of the PyTorch operators (schema type and default)
// when it has one.
template <class T, class Class>
void bind_row(Class& cls, nb::list& names, nb::dict& kinds, nb::list& schema, std::size_t row,
              const char* name, const T& init, const char* doc) {
  if constexpr (Convert<T>::exposed) {
    names.append(name);
    if constexpr (Convert<T>::schema != nullptr) {
      schema.append(nb::make_tuple(name, Convert<T>::schema, Convert<T>::schema_default(init)));
    }
    if constexpr (Convert<T>::kind != nullptr) kinds[name] = Convert<T>::kind;
    cls.def_prop_rw(
        name,
        [row](const Options& o) -> nb::object {
          return o.py[row].is_valid() ? o.py[row] : nb::none();
        },
        [name](Options& o, nb::handle value) { set_option(o, name, value); }, doc);
  }
}

}  // namespace

Backend parse_backend(const std::string& s) {
  Keep keep;
  return Convert<Backend>::from(nb::str(s.c_str()), "backend", keep);
}

void bind_options(nb::module_& m) {
  auto cls = nb::class_<Options>(
      m, "Options",
      "The options of qkv.attention, converted once: Options(**options) takes the keywords of "
      "qkv.attention (qkv/attention.hpp gives their meaning); each is a property, None until "
      "set.");
  cls.def("__init__", [](Options* self, nb::kwargs kwargs) {
    new (self) Options();
    for (const auto& [key, value] : kwargs) {
      const std::string k = nb::cast<std::string>(key);
      if (!set_option(*self, k, value)) {
        throw nb::type_error(("Options() got an unexpected keyword argument '" + k + "'").c_str());
      }
    }
  });
  nb::list names, schema;
  nb::dict kinds;
  const AttentionOptions defaults;
  std::size_t row = 0;
#define QKV_OPTION_BIND(type, name, init, doc) \
  bind_row<type>(cls, names, kinds, schema, row++, #name, defaults.name, doc);
  QKV_ATTENTION_OPTIONS(QKV_OPTION_BIND)
#undef QKV_OPTION_BIND
  cls.attr("names") = nb::tuple(names);
  cls.attr("kinds") = kinds;
  cls.attr("schema") = nb::tuple(schema);
}

}  // namespace qkv::python
