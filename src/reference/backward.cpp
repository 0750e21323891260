#include "reference/backward.hpp"

#include "qkv/error.hpp"

namespace qkv::reference {

void attention_backward(const detail::AttentionProblem&, ConstTensorView, ConstTensorView,
                        ConstTensorView, ConstTensorView, ConstTensorView, ConstTensorView,
                        const GradientOutputs&, const AttentionOptions&) {
  throw Error(std::string("attention_backward: the reference backward is being written"));
}

}  // namespace qkv::reference
