// Filesystem helpers that must not go through std::filesystem::remove_all.
//
// Why hand-written: PyTorch 2.x wheels' libtorch.so exports its own copy of
// std::filesystem::remove_all, and a program linked with it binds to that copy, which
// crashed (a call through a null pointer) on an H100 machine with torch 2.11. nftw(3)
// does the same depth-first removal with libc alone.
#pragma once

#include <string>
#include <system_error>

namespace tessera {

// Removes `path` and everything below it (symbolic links are removed, not followed).
// A missing path is not an error. Sets `ec` on failure, never throws.
void removeTree(const std::string& path, std::error_code& ec) noexcept;

// The same, throwing tessera::Error naming the path on failure.
void removeTree(const std::string& path);

}  // namespace tessera
