// Checkpoint benchmark (issue 7): one run prints, each next to a baseline measured in the
// same run on the same disk:
//   save:   a sharded checkpoint of --mib MiB over --world ranks (threads, gloo), sync,
//           vs raw sequential 1 MiB write()s + fsync of the same bytes (one file per rank, same
//           threads); ratio = raw seconds / save seconds (1.0 = as fast as raw).
//   load:   loading it back on the same world size (checksums verified) and resharded to
//           world-1 ranks, vs raw sequential 1 MiB preads of the same files by world readers (and,
//           for the resharded load, also by world-1 readers: the disk's speed depends on
//           how many read at once); page cache dropped (posix_fadvise DONTNEED) before
//           each, so all read from the disk.
//   async:  the training stall of an async save (after a first save allocated the
//           staging buffers) vs the bare copy of the same rows into buffers allocated
//           beforehand, and vs the synchronous save.
//   export: peak RSS of `tessera-export` (child process) exporting the checkpoint vs the
//           largest tensor, and vs the RSS of a process that only loads the libraries
//           (`tessera-ckpt info`).
// With --device cuda the state lives on the GPU (ranks share it): saves then include the
// device-to-host staging (pinned memory), while the raw baselines write and read host
// memory, and the bare-copy baseline is a copy into pinned host memory.
// Usage: bench_checkpoint_bench [--mib 256] [--world 4] [--dir /tmp/tessera_ckpt_bench] [--device cpu|cuda]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/file_io.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "common/logging.h"
#include "distributed/gloo_communicator.h"
#include "distributed/store.h"
#include "common/filesystem.h"

namespace fs = std::filesystem;
namespace ckpt = tessera::checkpoint;
using tessera::dtensor::ShardSpec;

namespace {

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs fn(rank) on `world` threads and returns the wall time.
double onThreads(int world, const std::function<void(int)>& fn) {
  const double start = nowSec();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
  return nowSec() - start;
}

void dropCacheOf(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) ckpt::File::openRead(e.path().string()).dropCache();
  }
}

// The raw baselines read and write in pieces of 1 MiB: measured here ~1.1x faster than one
// call for a whole file or tensor (into fresh memory, or out of it), and the size the
// checkpoint reads and writes in; the faster form makes the stricter baseline.
constexpr int64_t kRawPiece = 1 << 20;

// Bytes [offset, offset + bytes) of f into dst.
void rawRead(const ckpt::File& f, uint8_t* dst, int64_t offset, int64_t bytes) {
  for (int64_t done = 0; done < bytes; done += kRawPiece) {
    f.readAt(dst + done, static_cast<size_t>(std::min(kRawPiece, bytes - done)), offset + done);
  }
}

// `bytes` of src appended to f.
void rawWrite(ckpt::File& f, const uint8_t* src, int64_t bytes) {
  for (int64_t done = 0; done < bytes; done += kRawPiece) {
    f.writeAll(src + done, static_cast<size_t>(std::min(kRawPiece, bytes - done)));
  }
}

// A model of `tensors` global tensors of [rows, 4096] fp32 (rows uneven over the ranks).
struct Model {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  int64_t bytes = 0;
  int64_t largest = 0;
};

Model makeModel(int64_t mib) {
  Model m;
  const int64_t total = mib << 20;
  // Tensors of decreasing size: 1/2, 1/4, ... so the largest one is half the model.
  int64_t left = total;
  for (int i = 0; left > (1 << 20); ++i) {
    int64_t bytes = i == 0 ? total / 2 : left / 2;
    if (left - bytes < (1 << 20)) bytes = left;
    const int64_t rows = std::max<int64_t>(1, bytes / (4096 * 4)) + (i % 3);  // not divisible by the world
    m.names.push_back("model/layers." + std::to_string(i) + ".weight");
    m.shapes.push_back({rows, 4096});
    m.bytes += rows * 4096 * 4;
    m.largest = std::max(m.largest, rows * 4096 * 4);
    left -= bytes;
  }
  return m;
}

at::Device gDevice = at::kCPU;

std::vector<ckpt::StateEntry> entriesOf(const Model& m, int world, int rank, bool fill) {
  std::vector<ckpt::StateEntry> out;
  for (size_t i = 0; i < m.names.size(); ++i) {
    ShardSpec spec(m.shapes[i], at::kFloat, world, rank);
    at::Tensor local = fill ? at::rand(spec.localShape()) : at::empty(spec.localShape());
    if (fill) spec.realRows(local);  // (validates the buffer)
    if (fill && spec.chunkRows() > spec.localRows()) local.narrow(0, spec.localRows(), spec.chunkRows() - spec.localRows()).zero_();
    out.push_back({m.names[i], spec, local.to(gDevice)});
  }
  return out;
}

std::vector<std::shared_ptr<tessera::distributed::Communicator>> makeComms(int world, const std::string& name) {
  auto store = tessera::distributed::Store::createInProcess();
  std::vector<std::shared_ptr<tessera::distributed::Communicator>> comms(static_cast<size_t>(world));
  onThreads(world, [&](int r) {
    tessera::distributed::GlooOptions o;
    o.hostname = "127.0.0.1";
    o.comm.name = name;
    comms[static_cast<size_t>(r)] = tessera::distributed::makeGlooCommunicator(store, r, world, o);
  });
  return comms;
}

// Peak RSS (KiB) of a child running `argv`: its VmHWM, polled from /proc until it exits.
// (getrusage's ru_maxrss of a forked child would include this big process's pages
// from before the exec.)
long readHwmKiB(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "r");
  if (f == nullptr) return -1;
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

long childPeakRssKiB(const std::vector<std::string>& argv) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::freopen("/dev/null", "w", stdout);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  long peak = -1;
  // Poll while the child runs; waitid(WNOWAIT) leaves the zombie so /proc/pid stays valid
  // until the last read.
  for (;;) {
    siginfo_t info{};
    info.si_pid = 0;
    ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
    if (info.si_pid == pid) break;
    // Only once the child runs the new program: before exec it is a copy of this process.
    std::error_code ec;
    if (fs::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec) == fs::path(argv[0])) {
      peak = std::max(peak, readHwmKiB(pid));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) std::fprintf(stderr, "%s failed (status %d)\n", argv[0].c_str(), status);
  return peak;
}

// Disks on shared machines are noisy: every figure is the median of --reps runs, the
// sharded and raw runs interleaved.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// What the four benchmarks share: the model, every rank's entries and, for the raw
// baselines, their real rows in host memory.
struct Bench {
  int world = 4;
  int reps = 3;
  std::string dir, rawDir, root;  // scratch; raw baseline files; checkpoints
  Model model;
  std::vector<std::vector<ckpt::StateEntry>> entries;  // per rank
  std::vector<std::vector<at::Tensor>> hostRows;       // per rank: the real rows, on the host
  double gib = 0;                                      // the model's size
};

// Sharded sync save vs raw sequential write + fsync of the same rows. Returns the save's
// median seconds.
double benchSave(const Bench& b) {
  auto comms = makeComms(b.world, "bench_save");
  std::vector<double> rawWrites, saves;
  for (int rep = 0; rep < b.reps; ++rep) {
    // --- raw sequential write baseline: each rank's real rows, one file per rank, fsync.
    tessera::removeTree(b.rawDir);
    fs::create_directories(b.rawDir);
    rawWrites.push_back(onThreads(b.world, [&](int r) {
      ckpt::File f = ckpt::File::openWrite(b.rawDir + "/rank_" + std::to_string(r) + ".bin");
      for (const auto& rows : b.hostRows[static_cast<size_t>(r)]) {
        rawWrite(f, static_cast<const uint8_t*>(rows.data_ptr()), rows.numel() * 4);
      }
      f.sync();
      f.close();
      if (r == 0) ckpt::syncDirectory(b.rawDir);
    }));
    // --- sharded sync save. The previous rep's checkpoint is deleted outside the timing
    // (keep_last would delete it inside the save, which the raw baseline does not do).
    for (const auto& old : ckpt::listCheckpoints(b.root)) tessera::removeTree(old.dir);
    saves.push_back(onThreads(b.world, [&](int r) {
      ckpt::Checkpointer c(b.root, comms[static_cast<size_t>(r)]);
      ckpt::SaveRequest req;
      req.step = 1 + rep;
      req.entries = b.entries[static_cast<size_t>(r)];
      c.save(req);
    }));
  }
  const double rawWrite = median(rawWrites), save = median(saves);
  std::printf("save   sharded %.3f s (%.2f GiB/s)  raw write+fsync %.3f s (%.2f GiB/s)  ratio %.2fx  (median of %d)\n",
              save, b.gib / save, rawWrite, b.gib / rawWrite, rawWrite / save, b.reps);
  return save;
}

// Load at the same world size and resharded to world - 1 ranks (verified) vs raw reads;
// caches dropped before each; all read into fresh, untouched buffers allocated outside
// the timing.
void benchLoad(const Bench& b) {
  const std::string stepDir = b.root + "/" + ckpt::stepDirName(b.reps);
  std::vector<double> rawReads, rawReadsByOther, loads, reshards;
  // The raw files' sizes; a raw read by `other` readers splits their concatenation evenly.
  std::vector<int64_t> rawSizes;
  for (int r = 0; r < b.world; ++r) {
    rawSizes.push_back(static_cast<int64_t>(fs::file_size(b.rawDir + "/rank_" + std::to_string(r) + ".bin")));
  }
  const int64_t rawTotal = std::accumulate(rawSizes.begin(), rawSizes.end(), int64_t{0});
  int64_t reshardBytes = 0;  // read by all ranks of a resharded load (edge blocks included)
  const int other = std::max(1, b.world - 1);
  bool same = true;
  std::vector<std::vector<ckpt::StateEntry>> dest;
  for (int rep = 0; rep < b.reps; ++rep) {
    std::vector<at::Tensor> rawBuffers;
    for (int r = 0; r < b.world; ++r) rawBuffers.push_back(at::empty({rawSizes[static_cast<size_t>(r)]}, at::kByte));
    dropCacheOf(b.rawDir);
    rawReads.push_back(onThreads(b.world, [&](int r) {
      ckpt::File f = ckpt::File::openRead(b.rawDir + "/rank_" + std::to_string(r) + ".bin");
      rawRead(f, static_cast<uint8_t*>(rawBuffers[static_cast<size_t>(r)].data_ptr()), 0, f.size());
    }));
    rawBuffers.clear();
    // The same bytes read by as many readers as the resharded load has: reader r reads
    // [total * r / other, total * (r + 1) / other) of the files' concatenation.
    at::Tensor all = at::empty({rawTotal}, at::kByte);
    dropCacheOf(b.rawDir);
    rawReadsByOther.push_back(onThreads(other, [&](int r) {
      const int64_t begin = rawTotal * r / other, end = rawTotal * (r + 1) / other;
      int64_t base = 0;
      for (int f = 0; f < b.world; ++f) {
        const int64_t size = rawSizes[static_cast<size_t>(f)];
        const int64_t fb = std::max(begin, base), fe = std::min(end, base + size);
        if (fe > fb) {
          ckpt::File file = ckpt::File::openRead(b.rawDir + "/rank_" + std::to_string(f) + ".bin");
          rawRead(file, static_cast<uint8_t*>(all.data_ptr()) + fb, fb - base, fe - fb);
        }
        base += size;
      }
    }));
    all = at::Tensor();
    dest.clear();
    for (int r = 0; r < b.world; ++r) dest.push_back(entriesOf(b.model, b.world, r, false));
    dropCacheOf(stepDir);
    loads.push_back(onThreads(b.world, [&](int r) { ckpt::loadCheckpoint(stepDir, dest[static_cast<size_t>(r)]); }));
    for (int r = 0; r < b.world; ++r) {
      for (size_t i = 0; i < dest[static_cast<size_t>(r)].size(); ++i) {
        same = same && dest[static_cast<size_t>(r)][i].local.equal(b.entries[static_cast<size_t>(r)][i].local);
      }
    }
    // Resharded to b.world - 1 ranks.
    dest.clear();
    for (int r = 0; r < other; ++r) dest.push_back(entriesOf(b.model, other, r, false));
    dropCacheOf(stepDir);
    std::vector<int64_t> bytesRead(static_cast<size_t>(other));
    reshards.push_back(onThreads(other, [&](int r) {
      bytesRead[static_cast<size_t>(r)] = ckpt::loadCheckpoint(stepDir, dest[static_cast<size_t>(r)]).bytesRead;
    }));
    reshardBytes = std::accumulate(bytesRead.begin(), bytesRead.end(), int64_t{0});
  }
  const double rawRead = median(rawReads), load = median(loads);
  std::printf("load   sharded %.3f s (%.2f GiB/s, verified, %s)  raw read %.3f s (%.2f GiB/s)  ratio %.2fx\n", load,
              b.gib / load, same ? "identical" : "MISMATCH", rawRead, b.gib / rawRead, rawRead / load);
  const double reshard = median(reshards), rawReadByOther = median(rawReadsByOther);
  std::printf("load   resharded %d -> %d ranks %.3f s (%.2f GiB/s)  ratio to raw read %.2fx; raw read by %d readers "
              "%.3f s, ratio %.2fx  (read %.2fx the checkpoint's bytes: whole checksum blocks at the edges)\n",
              b.world, other, reshard, b.gib / reshard, rawRead / reshard, other, rawReadByOther, rawReadByOther / reshard,
              reshardBytes / static_cast<double>(b.model.bytes));
  dest.clear();
}

// Async save: the training stall vs the bare copy of the same rows into buffers
// allocated beforehand (what a stall can at best be), both timed per rank from a barrier
// (the slowest rank counts), and vs a copy into fresh buffers (clone, the staging before
// issue 20). One Checkpointer per rank for the whole section, as in a run: its first save
// allocates the staging buffers (a warm-up save, reported apart), the --reps timed saves
// reuse them. Medians, interleaved. `save`: the sync save's seconds.
void benchAsync(const Bench& b, double save) {
  auto asyncComms = makeComms(b.world, "bench_async");
  std::vector<std::vector<at::Tensor>> bareBuffers(static_cast<size_t>(b.world));
  for (int r = 0; r < b.world; ++r) {
    for (const auto& e : b.entries[static_cast<size_t>(r)]) {
      const at::Tensor rows = e.spec.realRows(e.local);
      bareBuffers[static_cast<size_t>(r)].push_back(
          at::zeros(rows.sizes(), rows.options().device(at::kCPU).pinned_memory(rows.is_cuda())));
    }
  }
  std::vector<std::unique_ptr<ckpt::Checkpointer>> cps(static_cast<size_t>(b.world));
  ckpt::CheckpointOptions asyncOptions;
  asyncOptions.async = true;
  for (int r = 0; r < b.world; ++r) {
    cps[static_cast<size_t>(r)] = std::make_unique<ckpt::Checkpointer>(b.root, asyncComms[static_cast<size_t>(r)], asyncOptions);
  }
  // One async save on every rank; returns {max stall, max staging, seconds until all
  // committed}.
  auto asyncSave = [&](int64_t step) {
    for (const auto& old : ckpt::listCheckpoints(b.root)) tessera::removeTree(old.dir);
    std::vector<double> stall(static_cast<size_t>(b.world)), staging(static_cast<size_t>(b.world));
    const double start = nowSec();
    onThreads(b.world, [&](int r) {
      ckpt::SaveRequest req;
      req.step = step;
      req.entries = b.entries[static_cast<size_t>(r)];
      // The ranks leave a training step together (its last collective): start together.
      asyncComms[static_cast<size_t>(r)]->barrier();
      const auto st = cps[static_cast<size_t>(r)]->save(req);
      stall[static_cast<size_t>(r)] = st.stallSeconds;
      staging[static_cast<size_t>(r)] = st.stagingSeconds;
    });
    onThreads(b.world, [&](int r) { cps[static_cast<size_t>(r)]->finish(); });
    return std::array<double, 3>{*std::max_element(stall.begin(), stall.end()),
                                 *std::max_element(staging.begin(), staging.end()), nowSec() - start};
  };
  const auto firstSave = asyncSave(999);
  std::vector<double> bareCopies, clones, stalls, stagings, asyncTotals;
  for (int rep = 0; rep < b.reps; ++rep) {
    // Timed like the stall: per rank from a common start, the slowest rank counts.
    std::vector<double> copySeconds(static_cast<size_t>(b.world));
    onThreads(b.world, [&](int r) {
      asyncComms[static_cast<size_t>(r)]->barrier();
      const double start = nowSec();
      const auto& mine = b.entries[static_cast<size_t>(r)];
      for (size_t i = 0; i < mine.size(); ++i) {
        bareBuffers[static_cast<size_t>(r)][i].copy_(mine[i].spec.realRows(mine[i].local));
      }
      copySeconds[static_cast<size_t>(r)] = nowSec() - start;
    });
    bareCopies.push_back(*std::max_element(copySeconds.begin(), copySeconds.end()));
    clones.push_back(onThreads(b.world, [&](int r) {
      for (const auto& e : b.entries[static_cast<size_t>(r)]) {
        const at::Tensor rows = e.spec.realRows(e.local);
        at::Tensor copy = at::empty(rows.sizes(), rows.options().device(at::kCPU).pinned_memory(rows.is_cuda()));
        copy.copy_(rows);
      }
    }));
    const auto timed = asyncSave(1000 + rep);
    stalls.push_back(timed[0]);
    stagings.push_back(timed[1]);
    asyncTotals.push_back(timed[2]);
  }
  cps.clear();
  const double bareCopy = median(bareCopies), clone = median(clones), maxStall = median(stalls);
  std::printf("async  stall %.3f s (max over ranks; staging inside save %.3f s)  bare copy into allocated buffers "
              "%.3f s  ratio %.2fx; stall / sync save %.2fx; copy into fresh buffers (clone) %.3f s; first save "
              "(allocates the staging buffers) stall %.3f s; whole save done in the background after %.3f s\n",
              maxStall, median(stagings), bareCopy, maxStall / bareCopy, maxStall / save, clone, firstSave[0],
              median(asyncTotals));
}

// tessera-export's peak RSS vs the largest tensor, on the last async save's checkpoint.
void benchExportRss(const Bench& b) {
  const std::string binDir = fs::canonical("/proc/self/exe").parent_path().string();
  const std::string exporter = binDir + "/tessera-export";
  const std::string info = binDir + "/tessera-ckpt";
  const auto remaining = ckpt::listCheckpoints(b.root);  // the last async save's checkpoint
  if (fs::exists(exporter) && fs::exists(info) && !remaining.empty()) {
    const std::string exportDir = remaining.back().dir;
    const long baseline = childPeakRssKiB({info, "info", exportDir});
    const long exportRss =
        childPeakRssKiB({exporter, exportDir, "--what", "model", "--out", b.dir + "/export/b.model.safetensors"});
    const long exportBf16 = childPeakRssKiB(
        {exporter, exportDir, "--what", "model", "--dtype", "bf16", "--out", b.dir + "/export/model_bf16.safetensors"});
    std::printf("export peak RSS %.1f MiB (bf16 cast: %.1f MiB); process baseline (tessera-ckpt info) %.1f MiB; "
                "largest tensor %.1f MiB; model %.1f MiB; export above baseline %.1f MiB = %.2fx the largest tensor\n",
                exportRss / 1024.0, exportBf16 / 1024.0, baseline / 1024.0, b.model.largest / 1048576.0,
                b.model.bytes / 1048576.0, (exportRss - baseline) / 1024.0,
                (exportRss - baseline) * 1024.0 / static_cast<double>(b.model.largest));
  } else {
    std::printf("export: build tessera-export and tessera-ckpt next to this program to measure peak RSS\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpoint save/load/async/export benchmark"};
  int64_t mib = 256;
  Bench b;
  std::string dir = (fs::temp_directory_path() / "tessera_ckpt_bench").string();
  app.add_option("--mib", mib, "Checkpoint size in MiB");
  app.add_option("--world", b.world, "Ranks (threads)");
  app.add_option("--reps", b.reps, "Repetitions (medians are printed)");
  app.add_option("--dir", dir, "Scratch directory (removed at the end)");
  std::string deviceName = "cpu";
  app.add_option("--device", deviceName, "Where the state lives")->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  // Line by line into a log file too: a run stopped by its time limit keeps what it printed
  // (scripts/gpu-session.sh's stages).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (deviceName == "cuda") {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "bench_checkpoint_bench: --device cuda but no CUDA device\n");
      return 2;
    }
    gDevice = at::kCUDA;
  }
  tessera::log::LogOptions logOptions;
  logOptions.level = "warn";
  tessera::log::init(logOptions);
  at::set_num_threads(1);
  tessera::removeTree(dir);
  fs::create_directories(dir);

  b.dir = dir;
  b.rawDir = dir + "/raw";
  b.root = dir + "/checkpoints";
  b.model = makeModel(mib);
  b.gib = b.model.bytes / double(1 << 30);
  for (int r = 0; r < b.world; ++r) b.entries.push_back(entriesOf(b.model, b.world, r, true));
  std::printf("checkpoint bench: %.1f MiB in %zu tensors (largest %.1f MiB) over %d ranks (threads), state on %s, dir %s\n",
              b.model.bytes / 1048576.0, b.model.names.size(), b.model.largest / 1048576.0, b.world, deviceName.c_str(),
              dir.c_str());
  b.hostRows.resize(static_cast<size_t>(b.world));
  for (int r = 0; r < b.world; ++r) {
    for (const auto& e : b.entries[static_cast<size_t>(r)]) {
      b.hostRows[static_cast<size_t>(r)].push_back(e.spec.realRows(e.local).cpu().contiguous());
    }
  }
  const double save = benchSave(b);
  benchLoad(b);
  benchAsync(b, save);
  benchExportRss(b);
  tessera::removeTree(dir);
  return 0;
}
