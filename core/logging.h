// Minimal glog-style logging and CHECK macros (Debian's Abseil has no
// absl/log).
//
//   LOG(INFO) << "step " << step;      // INFO, WARNING, ERROR, FATAL
//   CHECK(ptr != nullptr) << "why";    // programmer errors only: aborts
//   CHECK_EQ(a, b); CHECK_OK(status);
//
// Lines look like "I1122 01:53:32.123456 tid file.cc:12] [rank 1] message"
// and are written whole with one write(2), so lines from threads and ranks do
// not interleave. FATAL and failed CHECKs print and abort(). Fallible APIs
// return absl::Status instead; CHECK is for broken internal invariants.
#ifndef FSDPP_CORE_LOGGING_H_
#define FSDPP_CORE_LOGGING_H_

#include <sstream>
#include <string>

#include "absl/status/status.h"

namespace fsdpp {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Messages below this level are dropped (FATAL always prints). Default: INFO,
// or the FSDPP_LOG_LEVEL environment variable (0..3) when set.
void SetMinLogLevel(LogSeverity level);
LogSeverity MinLogLevel();

// Text put before every message, e.g. "[rank 3] ". Thread-safe.
void SetLogPrefix(const std::string& prefix);

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Turns the stream expression into void so CHECK can sit in a ternary.
struct Voidify {
  void operator&(std::ostream&) {}
};

template <typename A, typename B>
std::string* MakeCheckOpString(const A& a, const B& b, const char* text) {
  std::ostringstream os;
  os << text << " (" << a << " vs. " << b << ")";
  return new std::string(os.str());
}

// Holds the failure text of a CHECK_op; null means the check passed.
struct CheckOpResult {
  explicit CheckOpResult(std::string* s) : message(s) {}
  ~CheckOpResult() { delete message; }
  explicit operator bool() const { return message != nullptr; }
  std::string* message;
};

#define FSDPP_DEFINE_CHECK_OP(name, op)                                \
  template <typename A, typename B>                                    \
  inline std::string* name(const A& a, const B& b, const char* text) { \
    if (a op b) return nullptr;                                        \
    return MakeCheckOpString(a, b, text);                              \
  }
FSDPP_DEFINE_CHECK_OP(CheckEqImpl, ==)
FSDPP_DEFINE_CHECK_OP(CheckNeImpl, !=)
FSDPP_DEFINE_CHECK_OP(CheckLtImpl, <)
FSDPP_DEFINE_CHECK_OP(CheckLeImpl, <=)
FSDPP_DEFINE_CHECK_OP(CheckGtImpl, >)
FSDPP_DEFINE_CHECK_OP(CheckGeImpl, >=)
#undef FSDPP_DEFINE_CHECK_OP

}  // namespace logging_internal
}  // namespace fsdpp

#define FSDPP_LOG_INFO ::fsdpp::LogSeverity::kInfo
#define FSDPP_LOG_WARNING ::fsdpp::LogSeverity::kWarning
#define FSDPP_LOG_ERROR ::fsdpp::LogSeverity::kError
#define FSDPP_LOG_FATAL ::fsdpp::LogSeverity::kFatal

#define LOG(severity)                                         \
  ::fsdpp::logging_internal::LogMessage(__FILE__, __LINE__,   \
                                        FSDPP_LOG_##severity) \
      .stream()

#define LOG_IF(severity, condition) \
  !(condition) ? (void)0 : ::fsdpp::logging_internal::Voidify() & LOG(severity)

#define CHECK(condition)                                                  \
  (condition) ? (void)0                                                   \
              : ::fsdpp::logging_internal::Voidify() &                    \
                    ::fsdpp::logging_internal::LogMessage(                \
                        __FILE__, __LINE__, ::fsdpp::LogSeverity::kFatal) \
                            .stream()                                     \
                        << "Check failed: " #condition " "

#define FSDPP_CHECK_OP(impl, a, b, op)                                 \
  while (::fsdpp::logging_internal::CheckOpResult fsdpp_check_result_{ \
      ::fsdpp::logging_internal::impl((a), (b), #a " " #op " " #b)})   \
  ::fsdpp::logging_internal::LogMessage(__FILE__, __LINE__,            \
                                        ::fsdpp::LogSeverity::kFatal)  \
          .stream()                                                    \
      << "Check failed: " << *fsdpp_check_result_.message << " "

#define CHECK_EQ(a, b) FSDPP_CHECK_OP(CheckEqImpl, a, b, ==)
#define CHECK_NE(a, b) FSDPP_CHECK_OP(CheckNeImpl, a, b, !=)
#define CHECK_LT(a, b) FSDPP_CHECK_OP(CheckLtImpl, a, b, <)
#define CHECK_LE(a, b) FSDPP_CHECK_OP(CheckLeImpl, a, b, <=)
#define CHECK_GT(a, b) FSDPP_CHECK_OP(CheckGtImpl, a, b, >)
#define CHECK_GE(a, b) FSDPP_CHECK_OP(CheckGeImpl, a, b, >=)

#define CHECK_OK(expr)                                                        \
  for (const ::absl::Status fsdpp_check_ok_ = (expr); !fsdpp_check_ok_.ok();) \
  LOG(FATAL) << "CHECK_OK failed: " #expr ": " << fsdpp_check_ok_ << " "

#endif  // FSDPP_CORE_LOGGING_H_
