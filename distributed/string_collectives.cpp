// Collectives of strings (see string_collectives.h).
#include "distributed/string_collectives.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "distributed/communicator.h"

namespace tessera::distributed {

std::vector<std::string> allGatherStrings(Communicator* comm, const std::string& mine) {
  if (comm == nullptr || comm->worldSize() == 1) return {mine};
  const int world = comm->worldSize();
  at::Tensor lengths = at::zeros({world}, at::kLong);
  comm->allGatherInto(lengths, at::tensor({static_cast<int64_t>(mine.size())}, at::kLong));
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(length, length + world));
  at::Tensor all = at::zeros({world * longest}, at::kByte);
  at::Tensor own = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(own.data_ptr(), mine.data(), mine.size());
  comm->allGatherInto(all, own);
  std::vector<std::string> out;
  const char* bytes = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < world; ++r) out.emplace_back(bytes + r * longest, static_cast<size_t>(length[r]));
  return out;
}

std::string broadcastString(Communicator* comm, const std::string& text, int root) {
  if (comm == nullptr || comm->worldSize() == 1) return text;
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  comm->broadcast(length, root);
  const int64_t n = length.item<int64_t>();
  at::Tensor bytes = at::zeros({std::max<int64_t>(1, n)}, at::kByte);
  if (comm->rank() == root && n > 0) std::memcpy(bytes.data_ptr(), text.data(), static_cast<size_t>(n));
  comm->broadcast(bytes, root);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

}  // namespace tessera::distributed
