// Where a config key's value came from (a file's line and column, a --set, or the
// default), kept apart from the schema so that the options a run carries can still say it.
#pragma once

#include <map>
#include <string>

namespace tessera::config {

// Where a value came from, for error messages: "file.yaml:12:7" or "--set a.b=c".
struct SourceLocation {
  std::string source;  // file name, "--set a.b=c", or "" when the default is in effect
  int line = 0;        // 1-based; 0 = unknown
  int column = 0;      // 1-based; 0 = unknown
  std::string str() const;
  bool isDefault() const { return source.empty(); }
};

// Where each key's value came from, kept after the schema that loaded them is gone, so a
// check made later (a data file that is missing, a device that is not there) still says
// where the value was written: in which file, or by which --set.
class KeyOrigins {
 public:
  void add(const std::string& path, SourceLocation location);
  // Where `path`'s value came from; "<default>" for a key nobody set (or not known here).
  SourceLocation of(const std::string& path) const;
  // "<where path was set>: <path>: <what>", followed by where each other key that `what`
  // names was set, when a file or a --set set it: "... (data.micro_batch: --set
  // data.micro_batch=7)". Cross-field refusals so name every key a user may have to change.
  std::string errorMessage(const std::string& path, const std::string& what) const;

 private:
  std::map<std::string, SourceLocation> byPath_;
};

}  // namespace tessera::config
