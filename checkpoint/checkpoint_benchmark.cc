// Checkpoint throughput against the disk's own speed, measured in the same
// run on the same bytes: Save vs a raw sequential write (+ fdatasync) of the
// state's bytes to one file, Load vs a raw sequential read of that file
// (page cache warm, and cold after POSIX_FADV_DONTNEED), and an asynchronous
// save's blocking time vs a synchronous save. Also CRC-32C speed on both
// paths. One process saves alone (world 1), so the comparison isolates the
// checkpoint code's overhead (planning, checksums, metadata, commit).
//
//   bazel run -c opt //checkpoint:checkpoint_benchmark
//
// FSDPP_CKPT_BENCH_MB sets the state size (default 256 MiB, in 16 MiB f32
// tensors); FSDPP_CKPT_BENCH_DIR the scratch directory (default /tmp). A
// summary of the ratios is printed after the benchmark table.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/crc32c.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "formats/file_util.h"

namespace fsdpp {
namespace {

constexpr int64_t kTensorBytes = int64_t{16} << 20;

// Seconds per iteration of each benchmark (by name), for the summary.
std::map<std::string, double>& Results() {
  static std::map<std::string, double> results;
  return results;
}

struct Fixture {
  std::string dir;
  std::vector<Tensor> tensors;
  StateDict state;
  uint64_t bytes = 0;
  int64_t step = 0;
};

Fixture& F() {
  static Fixture* f = [] {
    auto* fixture = new Fixture;
    const char* mb = std::getenv("FSDPP_CKPT_BENCH_MB");
    const int64_t total = (mb != nullptr ? std::atoll(mb) : 256) << 20;
    const char* base = std::getenv("FSDPP_CKPT_BENCH_DIR");
    fixture->dir = absl::StrCat(base != nullptr ? base : "/tmp",
                                "/fsdpp_ckpt_bench_", ::getpid());
    CHECK_OK(RemoveTree(fixture->dir));
    CHECK_OK(MakeDirs(fixture->dir));
    const int64_t count = std::max<int64_t>(1, total / kTensorBytes);
    for (int64_t i = 0; i < count; ++i) {
      Tensor t = *Tensor::Empty({2048, 2048}, DType::kF32, Device::Cpu());
      auto* p = static_cast<uint64_t*>(t.raw_data());
      for (size_t w = 0; w < t.nbytes() / 8; ++w) {
        p[w] = (w + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(i);
        // Finite f32s (clear an exponent bit of each float's): the checked
        // save refuses inf / NaN.
        p[w] &= ~0x4000000040000000ull;
      }
      CHECK_OK(fixture->state.AddTensor(absl::StrCat("layers.", i, ".w"), t));
      fixture->tensors.push_back(t);
      fixture->bytes += t.nbytes();
    }
    return fixture;
  }();
  return *f;
}

std::string RawPath() { return F().dir + "/raw.bin"; }
std::string Root() { return F().dir + "/ckpt"; }

// Drops the page cache of `path` (a file, or every file of a directory).
void DropCache(const std::string& path) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(path);
  std::vector<std::string> files;
  if (names.ok()) {
    for (const std::string& n : *names) files.push_back(path + "/" + n);
  } else {
    files.push_back(path);
  }
  for (const std::string& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// The raw baseline: the state's bytes in one file, written and read
// sequentially in kRawPieceBytes calls (the piece size the checkpoint code
// uses, so the comparison measures only its extra work).
constexpr size_t kRawPieceBytes = size_t{1} << 20;

void WriteRaw(bool sync) {
  ScopedFd fd = *CreateExclusive(RawPath());
  for (const Tensor& t : F().tensors) {
    const char* p = static_cast<const char*>(t.raw_data());
    for (size_t at = 0; at < t.nbytes(); at += kRawPieceBytes) {
      CHECK_OK(WriteAll(fd.get(), p + at,
                        std::min(kRawPieceBytes, t.nbytes() - at), RawPath()));
    }
  }
  if (sync) CHECK_EQ(::fdatasync(fd.get()), 0);
  CHECK_OK(fd.Close(RawPath()));
}

void ReadRaw() {
  ScopedFd fd = *OpenForRead(RawPath());
  uint64_t offset = 0;
  for (const Tensor& t : F().tensors) {
    char* p = static_cast<char*>(t.raw_data());
    for (size_t at = 0; at < t.nbytes(); at += kRawPieceBytes) {
      const size_t n = std::min(kRawPieceBytes, t.nbytes() - at);
      CHECK_EQ(*PreadFully(fd.get(), {{p + at, n}}, offset, RawPath()), n);
      offset += n;
    }
  }
}

void Record(benchmark::State& state, const std::string& name, double seconds,
            int64_t iterations) {
  Results()[name] = seconds / static_cast<double>(iterations);
  state.SetBytesProcessed(static_cast<int64_t>(F().bytes) * iterations);
}

void BM_RawWrite(benchmark::State& state) {
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    CHECK_OK(RemoveTree(RawPath()));
    state.ResumeTiming();
    const absl::Time start = absl::Now();
    WriteRaw(/*sync=*/true);
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    state.SetIterationTime(s);
    seconds += s;
  }
  Record(state, "raw_write", seconds, state.iterations());
}
BENCHMARK(BM_RawWrite)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// Old checkpoints are removed between iterations, outside the timing, as
// the raw benchmark removes its file (the cost of retention deletes is
// reported separately by the summary).
void BM_Save(benchmark::State& state) {
  double seconds = 0;
  for (auto _ : state) {
    CHECK_OK(RemoveTree(Root()));
    absl::StatusOr<SaveResult> saved = Save(F().state, Root(), ++F().step);
    CHECK_OK(saved.status());
    const double s = absl::ToDoubleSeconds(saved->total_time);
    state.SetIterationTime(s);
    seconds += s;
  }
  Record(state, "save", seconds, state.iterations());
}
BENCHMARK(BM_Save)->UseManualTime()->Iterations(3)->Unit(
    benchmark::kMillisecond);

// Arg: 0 = page cache warm, 1 = cold.
void BM_RawRead(benchmark::State& state) {
  const bool cold = state.range(0) == 1;
  if (!PathExists(RawPath())) WriteRaw(/*sync=*/true);
  double seconds = 0;
  for (auto _ : state) {
    if (cold) DropCache(RawPath());
    const absl::Time start = absl::Now();
    ReadRaw();
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    state.SetIterationTime(s);
    seconds += s;
  }
  Record(state, cold ? "raw_read_cold" : "raw_read_warm", seconds,
         state.iterations());
}
BENCHMARK(BM_RawRead)
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

void BM_Load(benchmark::State& state) {
  const bool cold = state.range(0) == 1;
  if (!LatestCheckpoint(Root()).ok()) {
    CHECK_OK(Save(F().state, Root(), ++F().step).status());
  }
  const std::string dir = *LatestCheckpoint(Root());
  double seconds = 0;
  for (auto _ : state) {
    if (cold) DropCache(dir);
    absl::StatusOr<LoadResult> loaded = Load(&F().state, dir);
    CHECK_OK(loaded.status());
    const double s = absl::ToDoubleSeconds(loaded->time);
    state.SetIterationTime(s);
    seconds += s;
  }
  Record(state, cold ? "load_cold" : "load_warm", seconds, state.iterations());
}
BENCHMARK(BM_Load)->Arg(0)->Arg(1)->UseManualTime()->Iterations(3)->Unit(
    benchmark::kMillisecond);

// Manual time is the caller's blocking time; the background write is waited
// for outside it (and reported as a counter).
void BM_AsyncSaveBlocking(benchmark::State& state) {
  SaveOptions options;
  options.keep_last = 1;
  std::unique_ptr<AsyncSaver> saver = *AsyncSaver::Create(Root(), options);
  // A first save allocates the staging buffer, which later saves reuse.
  CHECK_OK((*saver->Save(F().state, ++F().step))->Wait().status());
  double blocking = 0, total = 0;
  for (auto _ : state) {
    std::shared_ptr<PendingSave> pending = *saver->Save(F().state, ++F().step);
    const double b = absl::ToDoubleSeconds(pending->blocking_time());
    state.SetIterationTime(b);
    blocking += b;
    absl::StatusOr<SaveResult> result = pending->Wait();
    CHECK_OK(result.status());
    total += absl::ToDoubleSeconds(result->total_time);
  }
  Record(state, "async_blocking", blocking, state.iterations());
  Results()["async_total"] = total / state.iterations();
  state.counters["total_ms"] = 1e3 * total / state.iterations();
}
BENCHMARK(BM_AsyncSaveBlocking)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// Arg: 0 = portable tables, 1 = SSE4.2.
void BM_Crc32c(benchmark::State& state) {
  const bool hardware = state.range(0) == 1;
  if (hardware && !crc32c_internal::HardwareAvailable()) {
    state.SkipWithError("no SSE4.2");
    return;
  }
  const Tensor& t = F().tensors[0];
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        hardware
            ? crc32c_internal::ExtendHardware(0, t.raw_data(), t.nbytes())
            : crc32c_internal::ExtendPortable(0, t.raw_data(), t.nbytes()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(t.nbytes()) *
                          state.iterations());
}
BENCHMARK(BM_Crc32c)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// The finite check's scan (SaveOptions::check_finite), f32.
void BM_CountNonFinite(benchmark::State& state) {
  const Tensor& t = F().tensors[0];
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        CountNonFinite(t.raw_data(), t.numel(), DType::kF32));
  }
  state.SetBytesProcessed(static_cast<int64_t>(t.nbytes()) *
                          state.iterations());
}
BENCHMARK(BM_CountNonFinite)->Unit(benchmark::kMillisecond);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double RawWriteSeconds() {
  CHECK_OK(RemoveTree(RawPath()));
  const absl::Time start = absl::Now();
  WriteRaw(/*sync=*/true);
  return absl::ToDoubleSeconds(absl::Now() - start);
}

double RawReadSeconds() {
  const absl::Time start = absl::Now();
  ReadRaw();
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// Alternates raw and checkpoint runs (so both see the same machine load)
// and prints medians of kRounds rounds.
void PairedSummary() {
  constexpr int kRounds = 5;
  std::map<std::string, std::vector<double>> t;
  std::string dir;
  std::unique_ptr<AsyncSaver> saver = *AsyncSaver::Create(Root(), {});
  // A first save allocates the staging buffer, which later saves reuse.
  CHECK_OK((*saver->Save(F().state, ++F().step))->Wait().status());
  for (int round = 0; round < kRounds; ++round) {
    std::shared_ptr<PendingSave> pending = *saver->Save(F().state, ++F().step);
    t["async_blocking"].push_back(
        absl::ToDoubleSeconds(pending->blocking_time()));
    absl::StatusOr<SaveResult> async_result = pending->Wait();
    CHECK_OK(async_result.status());
    t["async_total"].push_back(absl::ToDoubleSeconds(async_result->total_time));
    t["raw_write"].push_back(RawWriteSeconds());
    CHECK_OK(RemoveTree(Root()));
    absl::StatusOr<SaveResult> saved = Save(F().state, Root(), ++F().step);
    CHECK_OK(saved.status());
    t["save"].push_back(absl::ToDoubleSeconds(saved->total_time));
    // The same save refusing inf / NaN (the trainer's): the check runs in
    // the checksum pass.
    CHECK_OK(RemoveTree(Root()));
    SaveOptions checked;
    checked.check_finite = true;
    absl::StatusOr<SaveResult> checked_save =
        Save(F().state, Root(), ++F().step, checked);
    CHECK_OK(checked_save.status());
    t["save_checked"].push_back(
        absl::ToDoubleSeconds(checked_save->total_time));
    dir = checked_save->path;
    // Retention: one more save with keep_last = 1 drops the previous one
    // (renamed at once, deleted in the background: not the caller's time,
    // but waited for here so it does not slow the next measurement).
    SaveOptions keep1;
    keep1.keep_last = 1;
    saved = Save(F().state, Root(), ++F().step, keep1);
    CHECK_OK(saved.status());
    t["save_keep1"].push_back(absl::ToDoubleSeconds(saved->total_time));
    CHECK_OK(WaitForCheckpointCleanup());
    dir = saved->path;
    for (bool cold : {false, true}) {
      if (cold) DropCache(RawPath());
      t[cold ? "raw_read_cold" : "raw_read_warm"].push_back(RawReadSeconds());
      if (cold) DropCache(dir);
      absl::StatusOr<LoadResult> loaded = Load(&F().state, dir);
      CHECK_OK(loaded.status());
      t[cold ? "load_cold" : "load_warm"].push_back(
          absl::ToDoubleSeconds(loaded->time));
    }
  }
  std::map<std::string, double> m;
  for (const auto& [name, values] : t) m[name] = Median(values);
  const double gib = static_cast<double>(F().bytes) / (1 << 30);
  std::printf(
      "\nsummary: medians of %d alternating rounds, %.0f MiB of f32 "
      "tensors, world 1\n(ratio = checkpoint throughput / raw "
      "throughput of the same bytes)\n",
      kRounds, static_cast<double>(F().bytes) / (1 << 20));
  auto compare = [&](const char* what, const char* raw, const char* ours) {
    std::printf("  %-34s raw %6.2f GiB/s | checkpoint %6.2f GiB/s -> %5.1f%%\n",
                what, gib / m[raw], gib / m[ours], 100 * m[raw] / m[ours]);
  };
  compare("write+fdatasync vs Save", "raw_write", "save");
  std::printf(
      "  finite check (SaveOptions::check_finite): Save %.1f ms -> %.1f ms "
      "(%+.1f%%)\n",
      1e3 * m["save"], 1e3 * m["save_checked"],
      100 * (m["save_checked"] / m["save"] - 1));
  compare("write+fdatasync vs Save(keep 1)", "raw_write", "save_keep1");
  compare("read (page cache) vs Load", "raw_read_warm", "load_warm");
  compare("read (cold, fadvise) vs Load", "raw_read_cold", "load_cold");
  std::printf(
      "  async save: caller blocked %.1f ms (write + commit in the "
      "background: %.1f ms) vs sync save %.1f ms -> %.1f%% of a sync save\n",
      1e3 * m["async_blocking"], 1e3 * m["async_total"], 1e3 * m["save"],
      100 * m["async_blocking"] / m["save"]);
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  fsdpp::F();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  fsdpp::PairedSummary();
  CHECK_OK(fsdpp::RemoveTree(fsdpp::F().dir));
  return 0;
}
