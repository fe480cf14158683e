// Library-internal: the c10d store behind tessera::distributed::Store. Included only by
// distributed/*.cpp (the backends hand the c10d store to ProcessGroupGloo); never by a
// public header.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "distributed/store.h"

namespace tessera::distributed {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::string address;  // "tcp host:port" or "in-process" (plus "/prefix" for prefixed views)
  int port = -1;
};

// The c10d store of a Store (for c10d process groups).
inline c10::intrusive_ptr<c10d::Store> c10dStore(Store& store) { return store.impl().store; }

}  // namespace tessera::distributed
