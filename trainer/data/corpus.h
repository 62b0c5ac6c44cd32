// The default training corpus, compiled into the binary so the trainer runs
// offline and from `bazel run` with no data files: "The Devil's Dictionary"
// by Ambrose Bierce (1911 edition, public domain; 383 KB of English text).
//
// The bytes come from trainer/data/corpus/devils_dictionary.txt through a
// genrule (embed_file) that writes them into a .cc file; source, licence and
// preparation are in trainer/data/README.md.
#ifndef FSDPP_TRAINER_DATA_CORPUS_H_
#define FSDPP_TRAINER_DATA_CORPUS_H_

#include "absl/strings/string_view.h"

namespace fsdpp {
namespace trainer {

// The corpus text (ASCII, "\n" line ends); valid for the program's life.
absl::string_view EmbeddedCorpus();

// One line naming the text, its source and its licence.
absl::string_view EmbeddedCorpusDescription();

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_CORPUS_H_
