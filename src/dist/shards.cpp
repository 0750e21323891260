#include "dist/shards.hpp"

#include <algorithm>
#include <string>

namespace qkv::dist::detail {

namespace {

// Appends a reason for every value on which ranks disagree. Collective.
void check_agreement(MPI_Comm comm, int rank, const std::vector<Agreed>& mine, Reasons& r) {
  const auto n = static_cast<int>(mine.size());
  std::vector<std::int64_t> low(mine.size()), high(mine.size()), local(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) local[i] = mine[i].value;
  MPI_Allreduce(local.data(), low.data(), n, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(local.data(), high.data(), n, MPI_INT64_T, MPI_MAX, comm);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (low[i] != high[i]) {
      r.push_back(
          mine[i].name + ": expected the same value on every rank, but the ranks differ (rank " +
          std::to_string(rank) + ": " + std::to_string(local[i]) +
          ", range over ranks: " + std::to_string(low[i]) + " to " + std::to_string(high[i]) + ")");
    }
  }
}

// Every rank throws the first failing rank's reasons. Collective.
void raise_collectively(MPI_Comm comm, const char* function, int rank, int ranks,
                        const Reasons& r) {
  int bad = r.empty() ? ranks : rank, first = ranks;
  MPI_Allreduce(&bad, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == ranks) return;
  std::string text;
  if (rank == first) {
    for (const std::string& reason : r) text += reason + '\n';
  }
  std::int64_t length = static_cast<std::int64_t>(text.size());
  MPI_Bcast(&length, 1, MPI_INT64_T, first, comm);
  text.resize(static_cast<std::size_t>(length));
  MPI_Bcast(text.data(), static_cast<int>(length), MPI_CHAR, first, comm);
  Reasons all;
  const std::string prefix = std::string("qkv::dist::") + function + ", rank " +
                             std::to_string(first) + " of " + std::to_string(ranks) + ": ";
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = text.find('\n', at);
    all.push_back(prefix + text.substr(at, end - at));
    at = end + 1;
  }
  throw Error(all);
}

}  // namespace

Setup validate_collectively(MPI_Comm comm, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                            const AttentionOptions& o, const CallSpec& spec) {
  if (comm == MPI_COMM_NULL) {
    throw Error(std::string("comm: expected a communicator, got MPI_COMM_NULL (qkv::dist::") +
                spec.function + ")");
  }
  int inter = 0;
  MPI_Comm_test_inter(comm, &inter);
  if (inter) {
    throw Error(std::string("comm: expected an intracommunicator, got an intercommunicator "
                            "(qkv::dist::") +
                spec.function + ")");
  }
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  LocalCheck c = check_locally(q, k, v, o, spec, rank, ranks);
  Reasons& r = c.reasons;
  check_agreement(comm, rank, c.agreed, r);
  if (r.empty()) r = c.whole;
  raise_collectively(comm, spec.function, rank, ranks, r);
  return c.setup;
}

Tensor sum_over_ranks(MPI_Comm comm, const Tensor& share) {
  Tensor all(share.dtype(), {share.numel()});
  MPI_Allreduce(share.view().data(), all.view().data(), static_cast<int>(share.numel()),
                share.dtype() == DType::f64 ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM, comm);
  return all;
}

Tensor sink_gradients(MPI_Comm comm, const Setup& s, ConstTensorView out, ConstTensorView dout,
                      ConstTensorView lse, const AttentionOptions& o) {
  return sum_over_ranks(comm, local_sink_gradients(s, out, dout, lse, o));
}

namespace {
constexpr std::int64_t kMessageBytes = std::int64_t{1} << 30;
}

void post_send(const void* data, std::int64_t bytes, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  const auto* p = static_cast<const char*>(data);
  for (std::int64_t at = 0; at < bytes || at == 0; at += kMessageBytes) {
    const auto n = static_cast<int>(std::min(kMessageBytes, bytes - at));
    requests.emplace_back();
    MPI_Isend(p + at, n, MPI_BYTE, dest, tag, comm, &requests.back());
    if (bytes == 0) break;
  }
}

void post_recv(void* data, std::int64_t bytes, int source, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  auto* p = static_cast<char*>(data);
  for (std::int64_t at = 0; at < bytes || at == 0; at += kMessageBytes) {
    const auto n = static_cast<int>(std::min(kMessageBytes, bytes - at));
    requests.emplace_back();
    MPI_Irecv(p + at, n, MPI_BYTE, source, tag, comm, &requests.back());
    if (bytes == 0) break;
  }
}

void wait_all(std::vector<MPI_Request>& requests) {
  if (!requests.empty()) {
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  }
  requests.clear();
}

}  // namespace qkv::dist::detail
