/* include/symmalloc_device.cuh compiles as plain C++17 (its host part: symm_peer and the signal
 * slot addresses) and agrees with symm_peer_ptr's rule: a peer's address is its heap base plus
 * the pointer's offset in this rank's heap. */
#include "symmalloc_device.cuh"

#include <cstdio>

int main() {
  symm_device_comm_t d = {};
  d.world = 2;
  d.rank = 1;
  d.heap_bases[0] = 0x100000;
  d.heap_bases[1] = 0x900000;
  d.signal_pads[0] = 0x200000;
  float *mine = reinterpret_cast<float *>(0x900040);
  float *theirs = symm_peer(d, mine, 0);
  const bool ok = reinterpret_cast<uintptr_t>(theirs) == 0x100040 && symm_peer(d, mine, 1) == mine &&
                  reinterpret_cast<uintptr_t>(symm_signal_slot(d, 0, 3)) == 0x200000 + 24 &&
                  reinterpret_cast<uintptr_t>(symm_signal_writer(d, 0, 3)) ==
                      0x200000 + SYMM_SIGNAL_WRITERS_OFFSET + 12 &&
                  sizeof(symm_device_comm_t) == SYMM_DEVICE_COMM_V1_SIZE;
  std::printf("header_device: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
