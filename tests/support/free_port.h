// Ports for tests that start servers (rendezvous, TCP stores, torchrun): a block of
// consecutive ports that can be bound now and lie below the kernel's ephemeral range, so
// that an outgoing connection of another test cannot take one between the pick and the bind.
#pragma once

#include <string>

namespace tessera::test {

// The first of `count` consecutive TCP ports, each bindable on 0.0.0.0 right now, below
// net.ipv4.ip_local_port_range's low end. The search starts at a point derived from the
// process id, so tests that ctest runs in parallel start apart.
int freePorts(int count);
inline int freePort() { return freePorts(1); }

// A shell loop that waits (up to `seconds`) until something on this machine listens on
// `port`, read from /proc/net/tcp{,6}: a test that starts two launchers starts the second
// only when the first hosts the rendezvous.
std::string waitForListenerScript(int port, int seconds);

}  // namespace tessera::test
