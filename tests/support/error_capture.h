// What a test asks of code that must refuse input: the message of the tessera::Error it
// throws, and the same for a read that might block (a FIFO) without hanging the test.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <string>

#include "common/errors.h"

namespace tessera::test {

// The message of the tessera::Error `f` throws ("" when it throws none).
template <typename F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// errorOf(f) on another thread, failing the test (instead of hanging it) when `f` is still
// blocked on the FIFO `fifo` after 30 s: a non-blocking writer is then opened and closed,
// which lets an open() for reading return.
template <typename F>
std::string errorWithoutBlockingOn(const std::string& fifo, F f) {
  auto pending = std::async(std::launch::async, [f] { return errorOf(f); });
  if (pending.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "reading the FIFO '" << fifo << "' still blocks after 30 s";
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  }
  return pending.get();
}

}  // namespace tessera::test
