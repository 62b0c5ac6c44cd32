// Logging sink; see logging.h.
#include "core/logging.h"

#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

namespace fsdpp {
namespace {

LogSeverity InitialLevel() {
  const char* env = std::getenv("FSDPP_LOG_LEVEL");
  if (env != nullptr && env[0] >= '0' && env[0] <= '3' && env[1] == '\0') {
    return static_cast<LogSeverity>(env[0] - '0');
  }
  return LogSeverity::kInfo;
}

std::atomic<int>& MinLevel() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

std::mutex& PrefixMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

std::string& Prefix() {
  static std::string* prefix = new std::string;
  return *prefix;
}

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash == nullptr ? path : slash + 1;
}

}  // namespace

void SetMinLogLevel(LogSeverity level) {
  MinLevel().store(static_cast<int>(level));
}

LogSeverity MinLogLevel() {
  return static_cast<LogSeverity>(MinLevel().load());
}

void SetLogPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(PrefixMutex());
  Prefix() = prefix;
}

namespace logging_internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity)
    : file_(file), line_(line), severity_(severity) {}

LogMessage::~LogMessage() {
  if (severity_ != LogSeverity::kFatal &&
      static_cast<int>(severity_) < MinLevel().load()) {
    return;
  }
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm_buf;
  localtime_r(&tv.tv_sec, &tm_buf);
  char header[96];
  std::snprintf(header, sizeof(header), "%c%02d%02d %02d:%02d:%02d.%06ld %ld ",
                "IWEF"[static_cast<int>(severity_)], tm_buf.tm_mon + 1,
                tm_buf.tm_mday, tm_buf.tm_hour, tm_buf.tm_min, tm_buf.tm_sec,
                static_cast<long>(tv.tv_usec),
                static_cast<long>(syscall(SYS_gettid)));
  std::string line = header;
  line += Basename(file_);
  line += ':';
  line += std::to_string(line_);
  line += "] ";
  {
    std::lock_guard<std::mutex> lock(PrefixMutex());
    line += Prefix();
  }
  line += stream_.str();
  line += '\n';
  // One write per line keeps concurrent lines whole.
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace logging_internal
}  // namespace fsdpp
