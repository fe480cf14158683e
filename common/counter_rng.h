// Counter-based random bits: each value is a pure function of (key, counter), so any part
// of a stream — a rank's rows of a parameter, one sample's noise — can be drawn on its
// own and comes out the same whoever draws it, in whatever order. The mixing function is
// splitmix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", 2014): a bijection on 64 bits that passes BigCrush in this construction.
#pragma once

#include <cstdint>

namespace tessera {

inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// 64 random bits for position `counter` of stream `key`.
inline uint64_t counterBits(uint64_t key, uint64_t counter) { return mix64(mix64(key) ^ counter); }

// The top 53 bits as a double in [0, 1).
inline double uniform01(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

}  // namespace tessera
