// removeTree over nftw(3) (see filesystem.h for why not std::filesystem::remove_all).
#include "common/filesystem.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include "common/errors.h"

namespace tessera {
namespace {

thread_local int tRemoveErrno = 0;

int removeEntry(const char* path, const struct stat*, int, struct FTW*) {
  if (std::remove(path) != 0 && errno != ENOENT) {
    tRemoveErrno = errno;
    return 1;  // stops the walk
  }
  return 0;
}

}  // namespace

void removeTree(const std::string& path, std::error_code& ec) noexcept {
  ec.clear();
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return;
  }
  tRemoveErrno = 0;
  // FTW_DEPTH: children before their directory; FTW_PHYS: never follow links.
  if (::nftw(path.c_str(), removeEntry, 32, FTW_DEPTH | FTW_PHYS) != 0) {
    ec.assign(tRemoveErrno != 0 ? tRemoveErrno : errno, std::generic_category());
  }
}

void removeTree(const std::string& path) {
  std::error_code ec;
  removeTree(path, ec);
  if (ec) throw Error(strCat("cannot remove ", path, ": ", ec.message()));
}

}  // namespace tessera
