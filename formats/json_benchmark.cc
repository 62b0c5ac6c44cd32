// Throughput of the strict JSON parser (ParseJson) on header-shaped documents
// of about 1 MB: a safetensors header (objects of dtype / shape /
// data_offsets per tensor) and a GPT-2 encoder.json-shaped object (string
// keys mapping to integer ids). Reports bytes parsed per second.
//
//   bazel run -c opt //formats:json_benchmark
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "formats/json.h"

namespace fsdpp {
namespace {

// A safetensors-style header of at least `target_bytes` bytes.
std::string SafetensorsHeader(int64_t target_bytes) {
  std::string out = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t offset = 0;
  for (int64_t i = 0; static_cast<int64_t>(out.size()) < target_bytes; ++i) {
    const uint64_t bytes = 768 * 768 * 4;
    absl::StrAppend(&out, ",\"h.", i,
                    ".attn.c_attn.weight\":{\"dtype\":\"F32\",",
                    "\"shape\":[768,768],\"data_offsets\":[", offset, ",",
                    offset + bytes, "]}");
    offset += bytes;
  }
  out += "}";
  return out;
}

// An encoder.json-style vocabulary object of at least `target_bytes` bytes.
std::string EncoderJson(int64_t target_bytes) {
  std::string out = "{";
  for (int64_t i = 0; static_cast<int64_t>(out.size()) < target_bytes; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", "\"\\u0120tok", i, "en\":", i);
  }
  out += "}";
  return out;
}

void ParseLoop(benchmark::State& state, const std::string& doc) {
  for (auto _ : state) {
    absl::StatusOr<Json> json = ParseJson(doc);
    CHECK_OK(json.status());
    benchmark::DoNotOptimize(json);
  }
  state.SetBytesProcessed(state.iterations() *
                          static_cast<int64_t>(doc.size()));
}

// Arg: document size in bytes.
void BM_ParseSafetensorsHeader(benchmark::State& state) {
  ParseLoop(state, SafetensorsHeader(state.range(0)));
}
BENCHMARK(BM_ParseSafetensorsHeader)->Arg(1 << 20);

// Arg: document size in bytes.
void BM_ParseEncoderJson(benchmark::State& state) {
  ParseLoop(state, EncoderJson(state.range(0)));
}
BENCHMARK(BM_ParseEncoderJson)->Arg(1 << 20);

}  // namespace
}  // namespace fsdpp
