// qkv.distributed's native half: qkv::dist's ring and all-to-all attention
// (qkv/distributed.hpp) for Python. Compiled only when the build has MPI
// (the CMake target qkv::dist; QKV_WITH_MPI).
//
// The communicator comes from mpi4py as its Fortran handle (comm.py2f())
// and is turned back into an MPI_Comm with MPI_Comm_f2c, so qkv and mpi4py
// must use the same MPI library (mpi_library_version lets the Python layer
// check). The C++ functions allocate their results; they go to Python as
// arrays that own them (owning_array, no copy). The GIL is released while
// MPI and the kernels run.
//
// qkv::dist's errors are collective: every rank throws the same qkv::Error
// and no call deadlocks on bad input. The conversions done here (arrays to
// views, option strings to enums) may fail on one rank only, before the
// library's own collective checks run; so every call first agrees on them
// (`agree`: one MPI_Allreduce when all is well), and a rank whose
// arguments were bad makes every rank throw its message.
#include "qkv/distributed.hpp"

#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "gradients.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "shards.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace qkv::python {
namespace {

// The communicator of an mpi4py Fortran handle. Throws qkv::Error (the same
// on every rank of a communicator) when MPI is not running or the handle is
// MPI_COMM_NULL or an intercommunicator.
MPI_Comm communicator(MPI_Fint handle) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    throw Error(std::string("comm: MPI is ") + (finalized ? "finalized" : "not initialized") +
                " (pass a communicator of mpi4py.MPI, which initializes MPI when imported)");
  }
  const MPI_Comm comm = MPI_Comm_f2c(handle);
  if (comm == MPI_COMM_NULL) {
    throw Error("comm: expected a communicator, got MPI.COMM_NULL");
  }
  int inter = 0;
  MPI_Comm_test_inter(comm, &inter);
  if (inter) throw Error("comm: expected an intracommunicator, got an intercommunicator");
  return comm;
}

// The reasons of what went wrong on this rank, one a line ("" for nothing).
std::string reasons_of(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  if (error == nullptr) return std::string(e.what()) + '\n';
  std::string text;
  for (const std::string& r : error->reasons()) text += r + '\n';
  return text;
}

// Collective: each rank passes the reasons its arguments failed ("" when
// they did not). When any rank has some, every rank throws the first such
// rank's, in the form of qkv::dist's own collective errors. Call without
// the GIL.
void agree(MPI_Comm comm, const char* function, const std::string& problem) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  int bad = problem.empty() ? ranks : rank, first = ranks;
  MPI_Allreduce(&bad, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == ranks) return;
  std::string text = rank == first ? problem : std::string();
  // Reasons are short (a line each), well within an int count.
  int length = static_cast<int>(text.size());
  MPI_Bcast(&length, 1, MPI_INT, first, comm);
  text.resize(static_cast<std::size_t>(length));
  MPI_Bcast(text.data(), length, MPI_CHAR, first, comm);
  const std::string prefix = std::string("qkv::dist::") + function + ", rank " +
                             std::to_string(first) + " of " + std::to_string(ranks) + ": ";
  std::vector<std::string> reasons;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    reasons.push_back(prefix + text.substr(at, end - at));
    at = end + 1;
  }
  throw Error(reasons);
}

// One call's arguments as the C++ API takes them.
struct Call {
  MPI_Comm comm = MPI_COMM_NULL;
  ConstTensorView q, k, v, out, dout, lse;
  AttentionOptions options;
  dist::RingOptions ring;
};

// Converts the arguments (`convert` fills `call`), agrees with the other
// ranks that every rank could, then runs `run(call)` without the GIL.
template <class Convert, class Run>
auto collectively(MPI_Fint handle, const char* function, Convert convert, Run run) {
  Call call;
  call.comm = communicator(handle);
  std::string problem;
  try {
    convert(call);
  } catch (const std::exception& e) {
    problem = reasons_of(e);
  }
  nb::gil_scoped_release release;
  agree(call.comm, function, problem);
  return run(call);
}

// The arrays and options every call converts; the backward's also take the
// forward's out, lse and dout.
void take_inputs(Call& c, const In& q, const In& k, const In& v, const Options& options) {
  c.q = view_of(q, "q");
  c.k = view_of(k, "k");
  c.v = view_of(v, "v");
  c.options = options.to_cpp();
}

void take_backward_inputs(Call& c, const In& q, const In& k, const In& v, const In& out,
                          const In& dout, const In& lse, const Options& options) {
  take_inputs(c, q, k, v, options);
  c.out = view_of(out, "out");
  c.dout = view_of(dout, "dout");
  c.lse = view_of(lse, "lse");
}

using Result = std::pair<Array, std::optional<Array>>;
using Gradients = std::tuple<Array, Array, Array, nb::dict>;

Result result_of(AttentionResult r, bool return_lse, bool bf16_as_bits) {
  std::optional<Array> lse;
  if (return_lse) lse = owning_array(std::move(r.lse));
  return {owning_array(std::move(r.out), bf16_as_bits), std::move(lse)};
}

Gradients gradients_of(AttentionGradients g, bool bf16_as_bits) {
  nb::dict parameters = parameter_arrays(g);
  return {owning_array(std::move(g.dq), bf16_as_bits), owning_array(std::move(g.dk), bf16_as_bits),
          owning_array(std::move(g.dv), bf16_as_bits), std::move(parameters)};
}

Result ring_attention_py(MPI_Fint comm, const In& q, const In& k, const In& v,
                         const Options& options, const std::string& layout, bool return_lse,
                         bool bf16_as_bits) {
  AttentionResult r = collectively(
      comm, "ring_attention",
      [&](Call& c) {
        take_inputs(c, q, k, v, options);
        c.options.return_lse = return_lse;
        c.ring.layout = parse_layout(layout);
      },
      [](const Call& c) { return dist::ring_attention(c.comm, c.q, c.k, c.v, c.options, c.ring); });
  return result_of(std::move(r), return_lse, bf16_as_bits);
}

Gradients ring_attention_backward_py(MPI_Fint comm, const In& q, const In& k, const In& v,
                                     const In& out, const In& dout, const In& lse,
                                     const Options& options, const std::string& layout,
                                     bool bf16_as_bits) {
  AttentionGradients g = collectively(
      comm, "ring_attention_backward",
      [&](Call& c) {
        take_backward_inputs(c, q, k, v, out, dout, lse, options);
        c.ring.layout = parse_layout(layout);
      },
      [](const Call& c) {
        return dist::ring_attention_backward(c.comm, c.q, c.k, c.v, c.out, c.dout, c.lse, c.options,
                                             c.ring);
      });
  return gradients_of(std::move(g), bf16_as_bits);
}

Result ulysses_attention_py(MPI_Fint comm, const In& q, const In& k, const In& v,
                            const Options& options, bool return_lse, bool bf16_as_bits) {
  AttentionResult r = collectively(
      comm, "ulysses_attention",
      [&](Call& c) {
        take_inputs(c, q, k, v, options);
        c.options.return_lse = return_lse;
      },
      [](const Call& c) { return dist::ulysses_attention(c.comm, c.q, c.k, c.v, c.options); });
  return result_of(std::move(r), return_lse, bf16_as_bits);
}

Gradients ulysses_attention_backward_py(MPI_Fint comm, const In& q, const In& k, const In& v,
                                        const In& out, const In& dout, const In& lse,
                                        const Options& options, bool bf16_as_bits) {
  AttentionGradients g = collectively(
      comm, "ulysses_attention_backward",
      [&](Call& c) { take_backward_inputs(c, q, k, v, out, dout, lse, options); },
      [](const Call& c) {
        return dist::ulysses_attention_backward(c.comm, c.q, c.k, c.v, c.out, c.dout, c.lse,
                                                c.options);
      });
  return gradients_of(std::move(g), bf16_as_bits);
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  return std::string(text, static_cast<std::size_t>(length));
}

}  // namespace

void bind_distributed(nb::module_& m) {
  m.def("ring_attention", &ring_attention_py, "comm"_a, "q"_a, "k"_a, "v"_a, "options"_a,
        "layout"_a, "return_lse"_a, "bf16_as_bits"_a,
        "qkv::dist::ring_attention over the communicator with Fortran handle `comm` "
        "(mpi4py's comm.py2f()): this rank's shards q [B, nq, Hq, Dk], k [B, nk, Hkv, Dk], "
        "v [B, nk, Hkv, Dv] in `layout` ('contiguous' or 'zigzag') -> (out [B, nq, Hq, Dv], "
        "lse [B, Hq, nq] or None). Collective.");
  m.def("ring_attention_backward", &ring_attention_backward_py, "comm"_a, "q"_a, "k"_a, "v"_a,
        "out"_a, "dout"_a, "lse"_a, "options"_a, "layout"_a, "bf16_as_bits"_a,
        "qkv::dist::ring_attention_backward: this rank's (dq, dk, dv) and {row name: the whole "
        "problem's gradient} of the parameters the options use (sinks, score_scale). "
        "Collective.");
  m.def("ulysses_attention", &ulysses_attention_py, "comm"_a, "q"_a, "k"_a, "v"_a, "options"_a,
        "return_lse"_a, "bf16_as_bits"_a,
        "qkv::dist::ulysses_attention (all-to-all; contiguous shards, Hq and Hkv multiples of "
        "the rank count) -> (out, lse or None). Collective.");
  m.def("ulysses_attention_backward", &ulysses_attention_backward_py, "comm"_a, "q"_a, "k"_a, "v"_a,
        "out"_a, "dout"_a, "lse"_a, "options"_a, "bf16_as_bits"_a,
        "qkv::dist::ulysses_attention_backward: as ring_attention_backward. Collective.");
  m.def(
      "dist_agree",
      [](MPI_Fint comm, const std::string& function, const std::string& problem) {
        const MPI_Comm c = communicator(comm);
        nb::gil_scoped_release release;
        agree(c, function.c_str(),
              problem.empty() || problem.back() == '\n' ? problem : problem + '\n');
      },
      "comm"_a, "function"_a, "problem"_a,
      "The collective check of the functions above, for arguments the Python layer could not "
      "convert: every rank passes its problem ('' for none); when any rank has one, every rank "
      "raises ValueError with the first such rank's.");
  m.def("mpi_library_version", &mpi_library_version,
        "MPI_Get_library_version of the MPI library qkv was built with.");
}

}  // namespace qkv::python
