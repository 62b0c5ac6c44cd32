// Command lines of fsdpp's binaries: absl flags (ABSL_FLAG in the binary's
// main file) parsed with usage errors that name the problem and exit 2, the
// way the trainer's and tools' tests expect, instead of absl's exit 1.
//
// Accepted forms: --name=value, --name value (non-bool flags), --name and
// --noname (bool flags); a single leading dash works too; everything after
// "--" is positional. Flags listed as repeatable (e.g. the trainer's --set)
// collect every occurrence in CommandLine::repeated rather than keeping the
// last one, which absl's own parser cannot express. --help (or -h) prints
// the usage and every flag of the program with its default.
#ifndef FSDPP_CORE_CLI_H_
#define FSDPP_CORE_CLI_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdpp {

// What a command line held besides the flags it set.
struct CommandLine {
  std::vector<std::string> positional;  // In order; argv[0] excluded.
  // Every value of each repeatable flag, in order.
  std::map<std::string, std::vector<std::string>> repeated;
  bool help = false;  // --help or -h was given.
};

// Sets the absl flags named on the command line and returns the rest.
// InvalidArgument naming the flag for an unknown flag (listing the
// program's flags), a bad value or a missing value.
absl::StatusOr<CommandLine> ParseCommandLineFlags(
    int argc, const char* const* argv,
    const std::vector<std::string>& repeatable = {});

// `usage`, then every flag defined outside absl itself, sorted, with its
// type, default and help text.
std::string FlagsHelp(absl::string_view usage);

// ParseCommandLineFlags for a main(): on a usage error prints
// "<program>: <problem>" and `usage` to stderr and exits 2; on --help prints
// FlagsHelp(usage) to stdout and exits 0.
CommandLine ParseCommandLineOrExit(
    int argc, const char* const* argv, absl::string_view usage,
    const std::vector<std::string>& repeatable = {});

}  // namespace fsdpp

#endif  // FSDPP_CORE_CLI_H_
