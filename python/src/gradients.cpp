#include "gradients.hpp"

#include <utility>

#include "qkv/error.hpp"

namespace qkv::python {

std::vector<std::string> parameter_gradient_names() {
  return {
#define QKV_PARAMETER_NAME(gradient, sizes, used, option, doc) #gradient,
      QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_NAME)
#undef QKV_PARAMETER_NAME
  };
}

void take_parameter_gradients(const nb::dict& arrays, GradientOutputs& grads) {
  for (auto [key, value] : arrays) {
    const std::string name = nb::cast<std::string>(key);
    const Out array = nb::cast<Out>(value);
#define QKV_PARAMETER_OUTPUT(gradient, sizes, used, option, doc) \
  if (name == #gradient) {                                       \
    grads.gradient = view_of(array, #gradient);                  \
    continue;                                                    \
  }
    QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_OUTPUT)
#undef QKV_PARAMETER_OUTPUT
    std::string known;
    for (const std::string& n : parameter_gradient_names())
      known += (known.empty() ? "" : ", ") + n;
    throw Error("parameter_grads: expected names among " + known + ", got '" + name + "'");
  }
}

nb::dict parameter_arrays(AttentionGradients& g) {
  nb::dict arrays;
#define QKV_PARAMETER_ARRAY(gradient, sizes, used, option, doc) \
  if (g.gradient.defined()) arrays[#gradient] = owning_array(std::move(g.gradient));
  QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_ARRAY)
#undef QKV_PARAMETER_ARRAY
  return arrays;
}

}  // namespace qkv::python
