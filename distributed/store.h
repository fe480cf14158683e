// Store: the key-value store that ranks rendezvous through (c10d TCPStore across
// processes, c10d HashStore across threads of one process), behind a project-owned type
// so that no c10d header leaks into Tessera's public headers.
//
// Every blocking call has a timeout and throws tessera::TimeoutError naming the keys it
// waited for and the store's address; c10d's own waits report neither.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera::distributed {

class Store {
 public:
  struct Impl;  // holds the c10d store; defined in store_impl.h (library-internal)

  // A store in this process's memory, shared by threads (ranks as threads in tests).
  static std::shared_ptr<Store> createInProcess();

  // TCPStore. isServer=true hosts it on `port` of every interface of this machine
  // (port 0 = any free port; read it back with port()); false connects to host:port,
  // retrying until `timeout`. Throws TimeoutError when no server answers in time,
  // tessera::Error when the port cannot be bound.
  static std::shared_ptr<Store> createTcp(const std::string& host, int port, bool isServer,
                                          std::chrono::milliseconds timeout);

  explicit Store(std::unique_ptr<Impl> impl);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // A view of this store whose keys are all prefixed with `prefix` + "/".
  std::shared_ptr<Store> withPrefix(const std::string& prefix) const;

  void set(const std::string& key, const std::string& value);
  // Blocks until `key` exists (up to `timeout`), then returns its value.
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  // Atomically adds `delta` to the integer stored at `key` (0 when absent); returns the sum.
  int64_t add(const std::string& key, int64_t delta);
  // True when every key exists. Never blocks.
  bool check(const std::vector<std::string>& keys);
  // Blocks until every key exists; TimeoutError "Store::wait: waited 2 s for keys [...]".
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  // "tcp 127.0.0.1:29500" or "in-process"; for messages.
  const std::string& address() const;
  // The TCP port (the one chosen when created with port 0); -1 for in-process stores.
  int port() const;

  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// "2 s", "1.5 s", "250 ms": durations in messages.
std::string formatDuration(std::chrono::milliseconds duration);

// How often a wait of `timeout` that has not ended says what it waits for (Store::wait,
// the rendezvous): timeout / 5, at least 5 s (most waits take less), at most 30 s.
// Silence for the whole timeout looks like a hang.
std::chrono::milliseconds waitProgressInterval(std::chrono::milliseconds timeout);

}  // namespace tessera::distributed
