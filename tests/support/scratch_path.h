// Temporary paths for a test, removed once the test passed (a failed test's are kept for a
// look): end-to-end suites write run directories, logs and configs under the system's
// temporary directory, and without this every ctest run left ~100 of them behind.
#pragma once

#include <string>

namespace tessera::test {

// "<tmp>/<prefix>_<test name>_<pid>_<tag>" (the tag last: a file keeps its extension),
// removed if it exists; nothing is created.
// Registered for removal (file or directory tree) when the running test ends passing.
// Unique per test, tag and process: ctest runs the tests of a suite in parallel.
std::string scratchPath(const std::string& prefix, const std::string& tag);

}  // namespace tessera::test
