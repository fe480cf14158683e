// Collectives of strings (JSON documents, chunk tables, inventories) for the ranks'
// agreements outside the tensor path: the node-local checkpoint tier's exchanges.
#pragma once

#include <string>
#include <vector>

namespace tessera::distributed {

class Communicator;

// Every rank's `mine`, indexed by rank (two all-gathers: the lengths, then the bytes padded
// to the longest). Collective; comm may be null or of one rank.
std::vector<std::string> allGatherStrings(Communicator* comm, const std::string& mine);
// The root's `text` on every rank (two broadcasts: the length, then the bytes).
std::string broadcastString(Communicator* comm, const std::string& text, int root);

}  // namespace tessera::distributed
