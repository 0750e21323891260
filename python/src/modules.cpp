// qkv's modules (qkv/modules/additive.hpp, qkv/modules/vision.hpp) for
// Python: construction from a config, forward, backward, and the parameters.
// A parameter's value is a view of the module's own memory whose owner is
// the Python object, so torch.from_dlpack shares it and writes through it
// reach the module; gradients and results come back as arrays that own
// their memory. The GIL is released while a module computes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "qkv/modules/additive.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/modules/vision.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace qkv::python {
namespace {

DType parameter_dtype(const std::string& s) {
  if (s == "float32") return DType::f32;
  if (s == "float64") return DType::f64;
  if (s == "bfloat16") return DType::bf16;
  if (s == "float16") return DType::f16;
  throw Error("dtype: expected 'float32', 'float64', 'bfloat16' or 'float16', got '" + s + "'");
}

const char* dtype_string(DType d) {
  switch (d) {
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::f16:
      return "float16";
    case DType::bf16:
      return "bfloat16";
    case DType::boolean:
      return "bool";
  }
  return "unknown";
}

nn::ImageLayout parse_layout(const std::string& s) {
  if (s == "nchw") return nn::ImageLayout::nchw;
  if (s == "nhwc") return nn::ImageLayout::nhwc;
  throw Error("layout: expected 'nchw' or 'nhwc', got '" + s + "'");
}

// (name, value) of every parameter: views of the module's memory, owned by
// `self` (the Python object of the module).
template <class Module>
std::vector<std::pair<std::string, Array>> parameter_views(nb::handle self) {
  Module& module = nb::cast<Module&>(self);
  std::vector<std::pair<std::string, Array>> out;
  for (const nn::NamedParameter& p : module.named_parameters()) {
    out.emplace_back(p.name, array_of(p.parameter->value.view(), self));
  }
  return out;
}

// (name, gradient) of every parameter: a copy of Parameter::grad, or None
// where no backward call reached it since the last zero_grad.
template <class Module>
std::vector<std::pair<std::string, std::optional<Array>>> parameter_grads(Module& module) {
  std::vector<std::pair<std::string, std::optional<Array>>> out;
  for (const nn::NamedParameter& p : module.named_parameters()) {
    std::optional<Array> grad;
    if (p.parameter->grad.defined()) grad = owning_array(p.parameter->grad);
    out.emplace_back(p.name, std::move(grad));
  }
  return out;
}

// What the three module classes share: their parameters and gradients.
template <class Module>
void bind_parameters(nb::class_<Module>& c) {
  c.def(
       "parameters", [](nb::handle self) { return parameter_views<Module>(self); },
       "[(name, value)] under the state-dict names: views of the module's memory (writes "
       "through them change the module; each view keeps the module alive).")
      .def("grads", &parameter_grads<Module>,
           "[(name, grad or None)]: copies of the accumulated gradients (float32; float64 "
           "after a float64 backward), None where no backward call reached the parameter.")
      .def(
          "zero_grad", [](Module& m) { nn::zero_grad(m.named_parameters()); },
          "Drops every gradient (the next backward starts from zero).")
      .def_prop_ro("dtype", [](Module& m) {
        const nn::NamedParameters ps = m.named_parameters();
        return std::string(ps.empty() ? "float32"
                                      : dtype_string(ps.front().parameter->value.dtype()));
      });
}

}  // namespace

void bind_modules(nb::module_& m) {
  // Tensors made by torch.from_dlpack from a parameter view keep its module
  // alive, and torch may still hold some (in autograd graphs, in caches) when
  // the interpreter exits: nanobind would report those modules as leaked.
  nb::set_leak_warnings(false);

  nb::class_<nn::AdditiveAttention> additive(
      m, "AdditiveAttention",
      "One decoder step of additive (Bahdanau) attention (qkv/modules/additive.hpp).");
  additive
      .def(
          "__init__",
          [](nn::AdditiveAttention* self, std::int64_t hidden_size, const std::string& dtype) {
            new (self) nn::AdditiveAttention(hidden_size, parameter_dtype(dtype));
          },
          "hidden_size"_a, "dtype"_a = "float32")
      .def_prop_ro("hidden_size", &nn::AdditiveAttention::hidden_size)
      .def(
          "forward",
          [](const nn::AdditiveAttention& a, const In& decoder_hidden, const In& encoder_outputs,
             const std::optional<Ints>& source_lengths) {
            const ConstTensorView h = view_of(decoder_hidden, "decoder_hidden");
            const ConstTensorView e = view_of(encoder_outputs, "encoder_outputs");
            const std::span<const std::int64_t> lengths = span_of(source_lengths);
            nn::AdditiveAttentionOutput out;
            {
              nb::gil_scoped_release release;
              out = a.forward(h, e, lengths);
            }
            return std::make_pair(owning_array(std::move(out.context)),
                                  owning_array(std::move(out.weights)));
          },
          "decoder_hidden"_a, "encoder_outputs"_a, "source_lengths"_a.none() = nb::none(),
          "decoder_hidden [B, H], encoder_outputs [B, S, H], source_lengths [B] (None: all S) "
          "-> (context [B, H], weights [B, S]).")
      .def(
          "backward",
          [](nn::AdditiveAttention& a, const In& decoder_hidden, const In& encoder_outputs,
             const std::optional<Ints>& source_lengths, const std::optional<In>& d_context,
             const std::optional<In>& d_weights) {
            const ConstTensorView h = view_of(decoder_hidden, "decoder_hidden");
            const ConstTensorView e = view_of(encoder_outputs, "encoder_outputs");
            const ConstTensorView dc = view_of(d_context, "d_context");
            const ConstTensorView dw = view_of(d_weights, "d_weights");
            const std::span<const std::int64_t> lengths = span_of(source_lengths);
            nn::AdditiveAttentionGradients g;
            {
              nb::gil_scoped_release release;
              g = a.backward(h, e, lengths, dc, dw);
            }
            return std::make_pair(owning_array(std::move(g.d_decoder_hidden)),
                                  owning_array(std::move(g.d_encoder_outputs)));
          },
          "decoder_hidden"_a, "encoder_outputs"_a, "source_lengths"_a.none(), "d_context"_a.none(),
          "d_weights"_a.none(),
          "(d_decoder_hidden, d_encoder_outputs) given d_context [B, H] and d_weights [B, S] "
          "(None = zero); adds to the parameters' gradients.");
  bind_parameters(additive);

  nb::class_<nn::SqueezeExcitation> se(
      m, "SqueezeExcitation", "Squeeze-and-excitation, timm's SEModule (qkv/modules/vision.hpp).");
  se.def(
        "__init__",
        [](nn::SqueezeExcitation* self, std::int64_t channels, double rd_ratio,
           std::int64_t rd_channels, std::int64_t rd_divisor, bool bias, const std::string& dtype) {
          nn::SqueezeExcitationOptions o;
          o.rd_ratio = rd_ratio;
          o.rd_channels = rd_channels;
          o.rd_divisor = rd_divisor;
          o.bias = bias;
          o.dtype = parameter_dtype(dtype);
          new (self) nn::SqueezeExcitation(channels, o);
        },
        "channels"_a, "rd_ratio"_a = 1.0 / 16, "rd_channels"_a = 0, "rd_divisor"_a = 8,
        "bias"_a = true, "dtype"_a = "float32")
      .def_prop_ro("channels", &nn::SqueezeExcitation::channels)
      .def_prop_ro("rd_channels", &nn::SqueezeExcitation::rd_channels)
      .def(
          "forward",
          [](const nn::SqueezeExcitation& s, const In& x, const std::string& layout) {
            const ConstTensorView xv = view_of(x, "x");
            const nn::ImageLayout l = parse_layout(layout);
            Tensor y;
            {
              nb::gil_scoped_release release;
              y = s.forward(xv, l);
            }
            return owning_array(std::move(y));
          },
          "x"_a, "layout"_a = "nchw", "y = x * gate, of x's sizes and dtype.")
      .def(
          "backward",
          [](nn::SqueezeExcitation& s, const In& x, const In& dy, const std::string& layout) {
            const ConstTensorView xv = view_of(x, "x"), dyv = view_of(dy, "dy");
            const nn::ImageLayout l = parse_layout(layout);
            Tensor dx;
            {
              nb::gil_scoped_release release;
              dx = s.backward(xv, dyv, l);
            }
            return owning_array(std::move(dx));
          },
          "x"_a, "dy"_a, "layout"_a = "nchw", "dx given dy; adds to the parameters' gradients.");
  bind_parameters(se);

  nb::class_<nn::Cbam> cbam(m, "Cbam", "CBAM, timm's CbamModule (qkv/modules/vision.hpp).");
  cbam.def(
          "__init__",
          [](nn::Cbam* self, std::int64_t channels, double rd_ratio, std::int64_t rd_channels,
             std::int64_t rd_divisor, bool mlp_bias, std::int64_t spatial_kernel_size,
             double bn_eps, const std::string& dtype) {
            nn::CbamOptions o;
            o.rd_ratio = rd_ratio;
            o.rd_channels = rd_channels;
            o.rd_divisor = rd_divisor;
            o.mlp_bias = mlp_bias;
            o.spatial_kernel_size = spatial_kernel_size;
            o.bn_eps = bn_eps;
            o.dtype = parameter_dtype(dtype);
            new (self) nn::Cbam(channels, o);
          },
          "channels"_a, "rd_ratio"_a = 1.0 / 16, "rd_channels"_a = 0, "rd_divisor"_a = 1,
          "mlp_bias"_a = false, "spatial_kernel_size"_a = 7, "bn_eps"_a = 1e-5,
          "dtype"_a = "float32")
      .def_prop_ro("channels", &nn::Cbam::channels)
      .def_prop_ro("rd_channels", &nn::Cbam::rd_channels)
      .def_prop_ro("kernel_size", &nn::Cbam::kernel_size)
      .def(
          "forward",
          [](const nn::Cbam& c, const In& x, const std::string& layout) {
            const ConstTensorView xv = view_of(x, "x");
            const nn::ImageLayout l = parse_layout(layout);
            Tensor y;
            {
              nb::gil_scoped_release release;
              y = c.forward(xv, l);
            }
            return owning_array(std::move(y));
          },
          "x"_a, "layout"_a = "nchw",
          "y = x1 * spatial gate, x1 = x * channel gate; of x's sizes and dtype.")
      .def(
          "backward",
          [](nn::Cbam& c, const In& x, const In& dy, const std::string& layout) {
            const ConstTensorView xv = view_of(x, "x"), dyv = view_of(dy, "dy");
            const nn::ImageLayout l = parse_layout(layout);
            Tensor dx;
            {
              nb::gil_scoped_release release;
              dx = c.backward(xv, dyv, l);
            }
            return owning_array(std::move(dx));
          },
          "x"_a, "dy"_a, "layout"_a = "nchw",
          "dx given dy; adds to the parameters' gradients (not to the running statistics').");
  bind_parameters(cbam);

  m.def("make_divisible", &nn::make_divisible, "value"_a, "divisor"_a = 8, "min_value"_a = 0,
        "round_limit"_a = 0.9, "timm's make_divisible (qkv/modules/vision.hpp).");
}

}  // namespace qkv::python
