// Ports for tests that start servers: see free_port.h.
#include "tests/support/free_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace tessera::test {
namespace {

bool bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

int ephemeralLow() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 32768;
  if (!(range >> low) || low < 2048) low = 32768;
  return low;
}

}  // namespace

int freePorts(int count) {
  constexpr int kFirst = 10000;
  const int span = ephemeralLow() - kFirst - count;
  if (span <= 0) throw std::runtime_error("freePorts: no room below the ephemeral port range");
  // Successive calls in one process go on from the last block: a test may pick two before
  // it binds either.
  static int next = static_cast<int>(::getpid() * 7919L % span);
  for (int tried = 0; tried < span; ++tried) {
    const int base = kFirst + (next + tried) % span;
    bool all = true;
    for (int i = 0; i < count && all; ++i) all = bindable(base + i);
    if (all) {
      next = (base - kFirst + count) % span;
      return base;
    }
  }
  throw std::runtime_error("freePorts: no block of free ports below the ephemeral range");
}

std::string waitForListenerScript(int port, int seconds) {
  char hex[8];
  std::snprintf(hex, sizeof hex, "%04X", port);
  return "for i in $(seq " + std::to_string(seconds * 10) + "); do grep -Eqi ':" + hex +
         " 0+:0000 0A' /proc/net/tcp /proc/net/tcp6 2>/dev/null && break; sleep 0.1; done; ";
}

}  // namespace tessera::test
