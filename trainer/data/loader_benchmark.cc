// The data pipeline's hot path: DataLoader::Next (a shuffled batch of
// seq_len + 1 token windows, inputs and targets) over the byte-tokenized
// embedded corpus, reported in tokens per second; and ByteTokenizer::Encode
// of the whole embedded corpus, reported in bytes per second.
//
//   bazel run -c opt //trainer/data:loader_benchmark
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "trainer/data/byte_tokenizer.h"
#include "trainer/data/corpus.h"
#include "trainer/data/loader.h"
#include "trainer/data/token_store.h"

namespace fsdpp {
namespace trainer {
namespace {

// Args: seq_len, batch_size (rows per rank; one of 2 data-parallel ranks).
void BM_LoaderNext(benchmark::State& state) {
  std::shared_ptr<const TokenStore> store =
      TokenStore::FromVector(ByteTokenizer().Encode(EmbeddedCorpus()));
  LoaderOptions options;
  options.seq_len = state.range(0);
  options.batch_size = state.range(1);
  options.dp_rank = 0;
  options.dp_world = 2;
  options.seed = 1234;
  options.shuffle = true;
  absl::StatusOr<std::unique_ptr<DataLoader>> loader =
      DataLoader::Create(store, 0, store->size(), options);
  CHECK_OK(loader.status());
  for (auto _ : state) {
    Batch batch = (*loader)->Next();
    benchmark::DoNotOptimize(batch.inputs.data());
    benchmark::DoNotOptimize(batch.targets.data());
  }
  state.SetItemsProcessed(state.iterations() * options.seq_len *
                          options.batch_size);
}
BENCHMARK(BM_LoaderNext)->Args({1024, 8})->Args({64, 32});

// Arg: 1 to add the end-of-text id to the vocabulary, 0 not to.
void BM_ByteTokenizerEncodeCorpus(benchmark::State& state) {
  const ByteTokenizer tokenizer(/*with_eot=*/state.range(0) != 0);
  const absl::string_view corpus = EmbeddedCorpus();
  for (auto _ : state) {
    std::vector<int32_t> ids = tokenizer.Encode(corpus);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(state.iterations() *
                          static_cast<int64_t>(corpus.size()));
}
BENCHMARK(BM_ByteTokenizerEncodeCorpus)->Arg(1);

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
