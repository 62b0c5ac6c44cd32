// absl flags with exit-2 usage errors and repeatable flags; see cli.h.
#include "core/cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdpp {
namespace {

// A flag the program defines, not one of absl's own (e.g. --flagfile).
bool IsProgramFlag(const absl::CommandLineFlag* flag) {
  return flag != nullptr && !absl::StrContains(flag->Filename(), "absl/");
}

// The flags a program defines.
std::vector<absl::CommandLineFlag*> ProgramFlags() {
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsProgramFlag(flag)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](absl::CommandLineFlag* a, absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  return flags;
}

std::string FlagList() {
  std::vector<std::string> names;
  for (absl::CommandLineFlag* flag : ProgramFlags()) {
    names.push_back(absl::StrCat("--", flag->Name()));
  }
  names.push_back("--help");
  return absl::StrJoin(names, ", ");
}

std::string ProgramName(const char* argv0) {
  const std::string path = argv0 == nullptr ? "" : argv0;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLineFlags(
    int argc, const char* const* argv,
    const std::vector<std::string>& repeatable) {
  CommandLine result;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) result.positional.push_back(argv[i]);
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      result.positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    std::string value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "help" || name == "h") {
      result.help = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negated = false;
    if (!IsProgramFlag(flag) && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      negated = flag != nullptr && flag->IsOfType<bool>();
      if (!negated) flag = nullptr;
    }
    if (!IsProgramFlag(flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (flags: ", FlagList(), ")"));
    }
    const std::string flag_name(flag->Name());
    if (negated) {
      if (has_value) {
        return absl::InvalidArgumentError(
            absl::StrCat("--no", flag_name, " takes no value"));
      }
      value = "false";
    } else if (!has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag_name, " needs a value"));
      }
    }
    if (std::find(repeatable.begin(), repeatable.end(), flag_name) !=
        repeatable.end()) {
      result.repeated[flag_name].push_back(value);
      continue;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad value \"", value, "\" for --", flag_name, ": ", error));
    }
  }
  return result;
}

std::string FlagsHelp(absl::string_view usage) {
  std::string help(usage);
  if (!help.empty() && help.back() != '\n') help += '\n';
  help += "\nFlags:\n";
  for (absl::CommandLineFlag* flag : ProgramFlags()) {
    absl::StrAppend(
        &help, "  --", flag->Name(), " (default: ",
        flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue(),
        ")\n      ", flag->Help(), "\n");
  }
  absl::StrAppend(&help, "  --help\n      print this help and exit\n");
  return help;
}

CommandLine ParseCommandLineOrExit(int argc, const char* const* argv,
                                   absl::string_view usage,
                                   const std::vector<std::string>& repeatable) {
  absl::StatusOr<CommandLine> parsed =
      ParseCommandLineFlags(argc, argv, repeatable);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s: %s\n%.*s",
                 ProgramName(argc > 0 ? argv[0] : nullptr).c_str(),
                 std::string(parsed.status().message()).c_str(),
                 static_cast<int>(usage.size()), usage.data());
    std::exit(2);
  }
  if (parsed->help) {
    std::fputs(FlagsHelp(usage).c_str(), stdout);
    std::exit(0);
  }
  return *std::move(parsed);
}

}  // namespace fsdpp
