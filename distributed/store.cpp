// Store over c10d TCPStore / HashStore / PrefixStore (see store.h).
#include "distributed/store.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/store_impl.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> toBytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string joinKeys(const std::vector<std::string>& keys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += ", ";
    out += keys[i];
  }
  return out + "]";
}

// Blocks until something accepts TCP connections at host:port or `deadline` passes.
// LibTorch 1.13's TCPStore client gives up at once on a refused connection when its
// timeout is short and otherwise retries only once a second, so ranks that start before
// rank 0 is listening would fail or lose a second; this probe retries every few ms.
bool waitForListener(const std::string& host, int port, Clock::time_point deadline, std::string& lastError) {
  auto pause = std::chrono::milliseconds(5);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* addresses = nullptr;
    const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses);
    if (resolved != 0) {
      lastError = strCat("cannot resolve ", host, ": ", ::gai_strerror(resolved));
    } else {
      for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        bool connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!connected && errno == EINPROGRESS) {
          // Bounded wait for the handshake (an unreachable host would block for minutes).
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
          pollfd pending{fd, POLLOUT, 0};
          if (::poll(&pending, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 1000))) == 1) {
            int error = 0;
            socklen_t length = sizeof error;
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
            connected = error == 0;
            if (!connected) lastError = std::strerror(error);
          } else {
            lastError = "connection attempt timed out";
          }
        } else if (!connected) {
          lastError = std::strerror(errno);
        }
        ::close(fd);
        if (connected) {
          ::freeaddrinfo(addresses);
          return true;
        }
      }
      ::freeaddrinfo(addresses);
    }
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace

std::chrono::milliseconds waitProgressInterval(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 5, std::chrono::seconds(5), std::chrono::seconds(30));
}

std::string formatDuration(std::chrono::milliseconds duration) {
  const auto ms = duration.count();
  if (ms < 1000) return strCat(ms, " ms");
  if (ms % 1000 == 0) return strCat(ms / 1000, " s");
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Store::~Store() = default;

std::shared_ptr<Store> Store::createInProcess() {
  auto impl = std::make_unique<Impl>();
  impl->store = c10::make_intrusive<c10d::HashStore>();
  impl->address = "in-process";
  return std::make_shared<Store>(std::move(impl));
}

std::shared_ptr<Store> Store::createTcp(const std::string& host, int port, bool isServer,
                                        std::chrono::milliseconds timeout) {
  TESSERA_CHECK_AS(UsageError, port >= 0 && port <= 65535, "Store::createTcp: port ", port, " is not a port");
  TESSERA_CHECK_AS(UsageError, isServer || port > 0, "Store::createTcp: a client needs the server's port, got 0");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = isServer;
  // Arrival of the ranks is checked by rendezvous() with a message naming the missing
  // ones; c10d's own worker count check would only say "timed out".
  options.numWorkers = c10::nullopt;
  options.waitWorkers = false;
  options.timeout = timeout;
  // Two stores of one process on the same host:port (e.g. two runtimes in a test) share it.
  options.multiTenant = true;
  const auto start = Clock::now();
  const auto waited = [&start]() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  };
  if (!isServer) {
    std::string lastError = "no answer";
    if (!waitForListener(host, port, start + timeout, lastError)) {
      throw TimeoutError(strCat("Store::createTcp: waited ", formatDuration(waited()), " for the store host at ", host,
                                ":", port, " (rank 0 never came up or the address is wrong): ", lastError));
    }
  }
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  try {
    tcp = c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    if (isServer) {
      throw Error(strCat("Store::createTcp: cannot host the store on port ", port, " (", host,
                         "): ", firstLine(e.what())));
    }
    throw TimeoutError(strCat("Store::createTcp: waited ", formatDuration(waited()), " for the store host at ", host, ":",
                              port, " (rank 0 never came up or the address is wrong): ", firstLine(e.what())));
  }
  auto impl = std::make_unique<Impl>();
  impl->port = tcp->getPort();
  impl->address = strCat("tcp ", host, ":", impl->port);
  impl->store = tcp;
  return std::make_shared<Store>(std::move(impl));
}

std::shared_ptr<Store> Store::withPrefix(const std::string& prefix) const {
  auto impl = std::make_unique<Impl>();
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
  impl->address = impl_->address + " /" + prefix;
  impl->port = impl_->port;
  return std::make_shared<Store>(std::move(impl));
}

void Store::set(const std::string& key, const std::string& value) { impl_->store->set(key, toBytes(value)); }

std::string Store::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  const auto bytes = impl_->store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

int64_t Store::add(const std::string& key, int64_t delta) { return impl_->store->add(key, delta); }

bool Store::check(const std::vector<std::string>& keys) { return impl_->store->check(keys); }

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  // Polls check() instead of c10d's wait(timeout): a TCPStore wait that times out leaves
  // its reply in flight on the socket, and the message names nothing.
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // A line now and then while keys are missing.
  const auto every = waitProgressInterval(timeout);
  auto nextLine = start + every;
  const auto missingKeys = [&] {
    std::vector<std::string> missing;
    for (const auto& key : keys) {
      if (!impl_->store->check({key})) missing.push_back(key);
    }
    return missing;
  };
  auto pause = std::chrono::milliseconds(1);
  while (!impl_->store->check(keys)) {
    const auto now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(strCat("Store::wait: waited ", formatDuration(timeout), " for keys ", joinKeys(missingKeys()),
                                " in store ", impl_->address));
    }
    if (now >= nextLine) {
      TLOG_WARN("Store::wait has waited "
                << formatDuration(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) << " for keys "
                << joinKeys(missingKeys()) << " in store " << impl_->address << " (timeout " << formatDuration(timeout)
                << ")");
      nextLine += every;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

const std::string& Store::address() const { return impl_->address; }

int Store::port() const { return impl_->port; }

}  // namespace tessera::distributed
