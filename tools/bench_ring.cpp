// `qkv bench --suite ring`, run under mpiexec: ring attention (contiguous
// and zigzag shards) and all-to-all attention across the ranks, against one
// process running qkv::attention on the whole problem with as many threads
// as all ranks together, timed in the same run. Per case and rank: compute,
// waiting and total time, bytes sent, and how many transfers were complete
// when the compute they overlapped ended. Also a ping-pong probe of the
// link's bandwidth between ranks 0 and 1, the input of the scaling model in
// docs/distributed.md.
#include <mpi.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "bench_common.hpp"
#include "qkv/distributed.hpp"
#include "qkv/qkv.hpp"

namespace qkv::tools {
namespace {

constexpr std::uint32_t kSeed = 20261202;
constexpr std::int64_t kHeads = 8, kDim = 64;

// Waits at a barrier without spinning, so that an idle rank leaves its core
// to the ranks (or the threads) still working.
void quiet_barrier(MPI_Comm comm) {
  MPI_Request request;
  MPI_Ibarrier(comm, &request);
  int done = 0;
  while (true) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Seconds for one round trip of `bytes` between ranks 0 and 1, best of 5,
// as a one-way bandwidth in bytes/s (0 with one rank).
double link_bandwidth(MPI_Comm comm, int rank, int ranks, std::int64_t bytes) {
  if (ranks < 2) return 0.0;
  std::vector<char> buffer(static_cast<std::size_t>(bytes), 1);
  double best = 1e30;
  for (int round = 0; round < 6; ++round) {
    MPI_Barrier(comm);
    const double start = MPI_Wtime();
    if (rank == 0) {
      MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, comm);
      MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, comm, MPI_STATUS_IGNORE);
    } else if (rank == 1) {
      MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, comm, MPI_STATUS_IGNORE);
      MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, comm);
    }
    if (round > 0) best = std::min(best, MPI_Wtime() - start);
  }
  MPI_Bcast(&best, 1, MPI_DOUBLE, 0, comm);
  return 2.0 * static_cast<double>(bytes) / best;
}

enum class Method : std::uint8_t { ring_contiguous, ring_zigzag, ulysses };
const char* method_name(Method m) {
  return m == Method::ring_contiguous ? "ring_contiguous"
         : m == Method::ring_zigzag   ? "ring_zigzag"
                                      : "ulysses";
}

// Global rows of a rank's shard (as qkv/distributed.hpp defines the layouts).
std::vector<std::int64_t> shard_rows(Method m, int rank, int ranks, std::int64_t n) {
  std::vector<std::int64_t> rows;
  if (m != Method::ring_zigzag) {
    for (std::int64_t i = 0; i < n; ++i) rows.push_back(rank * n + i);
    return rows;
  }
  for (std::int64_t i = 0; i < n / 2; ++i) rows.push_back(rank * (n / 2) + i);
  for (std::int64_t i = 0; i < n / 2; ++i) rows.push_back((2 * ranks - 1 - rank) * (n / 2) + i);
  return rows;
}

Tensor take_rows(const Tensor& t, const std::vector<std::int64_t>& rows) {
  Tensor out(t.dtype(), {t.size(0), static_cast<std::int64_t>(rows.size()), t.size(2), t.size(3)});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    copy(t.view().slice(1, rows[i], 1), out.view().slice(1, static_cast<std::int64_t>(i), 1));
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct RankLine {
  double compute_s, wait_s, total_s, bytes, arrived, receives;
};

}  // namespace

int run_ring_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  const MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  const std::regex filter(options.filter);
  const double bandwidth = link_bandwidth(comm, rank, ranks, std::int64_t{64} << 20);
  // mpiexec binds each rank to a core by default; the single-process
  // baseline then runs all its threads on rank 0's core.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  if (rank == 0 && usable > 0 && usable < options.threads * ranks) {
    progress << "qkv bench: rank 0 may run on " << usable << " CPU(s), fewer than the "
             << options.threads * ranks
             << " threads of the single-process baseline: run mpiexec with --bind-to none\n";
  }
  if (rank == 0) {
    char line[256];
    std::snprintf(line, sizeof line,
                  options.json ? "{\"suite\":\"ring\",\"ranks\":%d,\"threads_per_rank\":%d,"
                                 "\"link_bytes_per_s\":%.6g}\n"
                               : "ranks %d x %d threads; link (ping-pong, 64 MiB, ranks 0-1): "
                                 "%.3g GB/s\n",
                  ranks, options.threads, options.json ? bandwidth : bandwidth / 1e9);
    out << line;
    if (!options.json) {
      out << "case                              method            seconds   single_s  "
             "speed_vs_single  compute_s(max)  wait_s(max)  MB_sent(max)  arrived_early\n";
    }
  }
  for (const std::int64_t full : {std::int64_t{16384}, std::int64_t{65536}}) {
    const std::int64_t n_total = std::max<std::int64_t>(full / options.shrink, 2 * ranks);
    const std::int64_t n = n_total / ranks / 2 * 2;  // rows per rank, even for zigzag
    const std::int64_t total = n * ranks;
    const std::string name = "causal_N" + std::to_string(total) + "_H8_D64";
    if (!std::regex_search(name, filter)) continue;
    std::mt19937 rng(kSeed);
    const Tensor q = random_tensor(DType::f32, {1, total, kHeads, kDim}, rng);
    const Tensor k = random_tensor(DType::f32, {1, total, kHeads, kDim}, rng);
    const Tensor v = random_tensor(DType::f32, {1, total, kHeads, kDim}, rng);
    AttentionOptions o;
    o.causal = true;
    // The single process: rank 0 with every rank's threads; the others idle.
    double single_s = 0;
    if (rank == 0) {
      omp_set_num_threads(options.threads * ranks);
      std::vector<double> times;
      attention(q, k, v, o);  // warm-up
      for (int r = 0; r < options.repeats; ++r) {
        const auto start = std::chrono::steady_clock::now();
        attention(q, k, v, o);
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      single_s = median(times);
      omp_set_num_threads(options.threads);
    }
    quiet_barrier(comm);
    MPI_Bcast(&single_s, 1, MPI_DOUBLE, 0, comm);
    omp_set_num_threads(options.threads);
    for (const Method m : {Method::ring_contiguous, Method::ring_zigzag, Method::ulysses}) {
      if (m == Method::ulysses && kHeads % ranks != 0) continue;
      const std::vector<std::int64_t> rows = shard_rows(m, rank, ranks, n);
      const Tensor qs = take_rows(q, rows), ks = take_rows(k, rows), vs = take_rows(v, rows);
      std::vector<double> totals;
      std::vector<dist::RingStats> stats;
      for (int r = 0; r <= options.repeats; ++r) {
        if (rank == 0) {
          report_progress(progress, options, static_cast<std::size_t>(r),
                          static_cast<std::size_t>(options.repeats), name + " " + method_name(m));
        }
        MPI_Barrier(comm);
        const double start = MPI_Wtime();
        dist::RingStats st;
        if (m == Method::ulysses) {
          dist::ulysses_attention(comm, qs, ks, vs, o);
        } else {
          const dist::Layout layout =
              m == Method::ring_zigzag ? dist::Layout::zigzag : dist::Layout::contiguous;
          dist::ring_attention(comm, qs, ks, vs, o, {.layout = layout, .stats = &st});
        }
        double elapsed = MPI_Wtime() - start, slowest = 0;
        MPI_Allreduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
        if (r == 0) continue;  // warm-up
        totals.push_back(slowest);
        stats.push_back(st);
      }
      // This rank's figures from the run of median time.
      std::vector<std::size_t> order(totals.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](std::size_t a, std::size_t b) { return totals[a] < totals[b]; });
      const dist::RingStats& kept = stats[order[order.size() / 2]];
      const RankLine mine{kept.compute_s,
                          kept.wait_s,
                          kept.total_s,
                          static_cast<double>(kept.bytes_sent),
                          static_cast<double>(kept.arrived_early),
                          static_cast<double>(kept.receives)};
      std::vector<RankLine> all(static_cast<std::size_t>(ranks));
      MPI_Gather(&mine, 6, MPI_DOUBLE, all.data(), 6, MPI_DOUBLE, 0, comm);
      if (rank != 0) continue;
      const double seconds = median(totals);
      double compute = 0, wait = 0, bytes = 0, arrived = 0, receives = 0;
      for (const RankLine& l : all) {
        compute = std::max(compute, l.compute_s);
        wait = std::max(wait, l.wait_s);
        bytes = std::max(bytes, l.bytes);
        arrived += l.arrived;
        receives += l.receives;
      }
      char line[512];
      if (options.json) {
        std::string per_rank = "[";
        for (std::size_t i = 0; i < all.size(); ++i) {
          char item[200];
          std::snprintf(
              item, sizeof item,
              "%s{\"compute_s\":%.6g,\"wait_s\":%.6g,\"total_s\":%.6g,\"bytes_sent\":%.0f,"
              "\"arrived_early\":%.0f,\"receives\":%.0f}",
              i ? "," : "", all[i].compute_s, all[i].wait_s, all[i].total_s, all[i].bytes,
              all[i].arrived, all[i].receives);
          per_rank += item;
        }
        per_rank += "]";
        std::snprintf(line, sizeof line,
                      "{\"suite\":\"ring\",\"name\":\"%s\",\"method\":\"%s\",\"ranks\":%d,"
                      "\"threads_per_rank\":%d,\"seconds\":%.6g,\"single_seconds\":%.6g,"
                      "\"speed_vs_single\":%.4g,\"per_rank\":",
                      name.c_str(), method_name(m), ranks, options.threads, seconds, single_s,
                      single_s / seconds);
        out << line << per_rank << "}\n";
      } else {
        std::snprintf(line, sizeof line,
                      "%-33s %-16s %8.3f  %8.3f  %15.2f  %14.3f  %11.4f  %12.1f  %6.0f/%.0f\n",
                      name.c_str(), method_name(m), seconds, single_s, single_s / seconds, compute,
                      wait, bytes / 1e6, arrived, receives);
        out << line;
      }
      out.flush();
    }
  }
  if (!initialized) MPI_Finalize();
  return 0;
}

}  // namespace qkv::tools
