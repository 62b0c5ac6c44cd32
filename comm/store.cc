// Store base, PrefixStore and InMemoryStore; see store.h.
#include "comm/store.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace fsdpp {

absl::Status MissingKeysError(absl::string_view what,
                              const std::vector<std::string>& missing,
                              absl::Duration timeout) {
  return absl::DeadlineExceededError(
      absl::StrCat(what, ": timed out after ", absl::FormatDuration(timeout),
                   " waiting for keys [", absl::StrJoin(missing, ", "), "]"));
}

absl::StatusOr<int64_t> ParseCounter(absl::string_view key,
                                     absl::string_view value) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store key '", key, "' holds '", value, "', not an integer counter"));
  }
  return v;
}

absl::Status Store::Wait(const std::vector<std::string>& keys,
                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  for (;;) {
    std::vector<std::string> missing;
    for (const std::string& key : keys) {
      absl::StatusOr<bool> present = Check({key});
      if (!present.ok()) return present.status();
      if (!*present) missing.push_back(key);
    }
    if (missing.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline)
      return MissingKeysError("store wait", missing, timeout);
    absl::SleepFor(std::min(backoff, deadline - absl::Now()));
    backoff = std::min(backoff * 2, absl::Milliseconds(100));
  }
}

std::string PrefixStore::Key(absl::string_view key) const {
  return absl::StrCat(prefix_, "/", key);
}

std::vector<std::string> PrefixStore::Keys(
    const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(Key(k));
  return out;
}

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) {
  return base_->Set(Key(key), value);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  return base_->Get(Key(key), timeout);
}

absl::StatusOr<int64_t> PrefixStore::Add(absl::string_view key, int64_t delta) {
  return base_->Add(Key(key), delta);
}

absl::StatusOr<bool> PrefixStore::Check(const std::vector<std::string>& keys) {
  return base_->Check(Keys(keys));
}

absl::Status PrefixStore::Delete(absl::string_view key) {
  return base_->Delete(Key(key));
}

absl::Status PrefixStore::Wait(const std::vector<std::string>& keys,
                               absl::Duration timeout) {
  return base_->Wait(Keys(keys), timeout);
}

absl::Status InMemoryStore::Set(absl::string_view key,
                                absl::string_view value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[std::string(key)] = std::string(value);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key,
                                               absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) {
    const bool found =
        cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] {
          it = data_.find(key);
          return it != data_.end();
        });
    if (!found)
      return MissingKeysError("store get", {std::string(key)}, timeout);
  }
  return it->second;
}

absl::StatusOr<int64_t> InMemoryStore::Add(absl::string_view key,
                                           int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it != data_.end()) {
      absl::StatusOr<int64_t> current = ParseCounter(key, it->second);
      if (!current.ok()) return current.status();
      value = *current;
    }
    value += delta;
    data_[std::string(key)] = absl::StrCat(value);
  }
  cv_.notify_all();
  return value;
}

absl::StatusOr<bool> InMemoryStore::Check(
    const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& k : keys) {
    if (data_.find(k) == data_.end()) return false;
  }
  return true;
}

absl::Status InMemoryStore::Delete(absl::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = data_.find(key);
  if (it != data_.end()) data_.erase(it);
  return absl::OkStatus();
}

absl::Status InMemoryStore::Wait(const std::vector<std::string>& keys,
                                 absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_present = [&] {
    for (const std::string& k : keys) {
      if (data_.find(k) == data_.end()) return false;
    }
    return true;
  };
  if (cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), all_present)) {
    return absl::OkStatus();
  }
  std::vector<std::string> missing;
  for (const std::string& k : keys) {
    if (data_.find(k) == data_.end()) missing.push_back(k);
  }
  return MissingKeysError("store wait", missing, timeout);
}

}  // namespace fsdpp
