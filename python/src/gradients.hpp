// Parameter gradients between Python and C++ by their rows' names
// (QKV_ATTENTION_PARAMETERS): the dict of caller arrays an in-place
// backward writes, and the dict of owning arrays a returning one gives.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "arrays.hpp"
#include "qkv/backward.hpp"

namespace qkv::python {

// The names of the parameter gradients, in the rows' order.
std::vector<std::string> parameter_gradient_names();

// Sets grads' parameter views from `arrays` ({row name: array}); throws
// qkv::Error naming a key that is no row's.
void take_parameter_gradients(const nb::dict& arrays, GradientOutputs& grads);

// {row name: array} of g's defined parameter gradients (moved, not copied).
nb::dict parameter_arrays(AttentionGradients& g);

}  // namespace qkv::python
