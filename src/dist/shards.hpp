// What the ring and all-to-all functions share over MPI: the collective
// validation, parameter gradients summed over the ranks, and non-blocking
// transfers of large buffers. The geometry, the pieces and their merges
// are transport-free (pieces.hpp).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "dist/pieces.hpp"
#include "qkv/distributed.hpp"

namespace qkv::dist::detail {

// Validates this rank's inputs and that every rank passes the same shapes
// and options; collective. When any rank fails, every rank throws the same
// qkv::Error naming the first failing rank and its reasons.
Setup validate_collectively(MPI_Comm comm, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                            const AttentionOptions& options, const CallSpec& spec);

// The sum over the ranks of each rank's share [n] (f32 or f64), on every
// rank. Collective.
Tensor sum_over_ranks(MPI_Comm comm, const Tensor& share);

// d_sinks of the whole problem on every rank: each rank's rows' part
// (local_sink_gradients), summed over the ranks. Collective.
Tensor sink_gradients(MPI_Comm comm, const Setup& s, ConstTensorView out, ConstTensorView dout,
                      ConstTensorView lse, const AttentionOptions& options);

// Non-blocking transfers of a byte buffer, split into messages of at most
// 1 GiB (MPI counts are int). Appends the requests.
void post_send(const void* data, std::int64_t bytes, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);
void post_recv(void* data, std::int64_t bytes, int source, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);
// Waits for every request and clears the list.
void wait_all(std::vector<MPI_Request>& requests);

}  // namespace qkv::dist::detail
