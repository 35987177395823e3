// symmalloc kernels: the library's own p2p signal and wait (comm/p2p.rs, `symm_signal` when it
// takes a kernel, and `symm_wait`), one thread each, over the public device helpers of
// include/symmalloc_device.cuh: the library waits exactly as user kernels do (bounded, acquire at
// system scope, reporting through the error words, never reading host memory while spinning).
//
// Owns: the P2pArgs struct (mirrored by src/comm/p2p/signal_pad.rs; tests/kernel_table.rs checks
// them field by field).
#include "symmalloc_device.cuh"

struct P2pArgs {
  symm_device_comm_t d;  // the communicator as device code sees it (symm_comm_device)
  uint64_t value;        // the value to store, or to wait for
  uint32_t slot;         // the signal slot
  int32_t peer;          // the rank whose slot a signal raises
};

// Holds the stream until this rank's slot is >= value, or the timeout (then recorded).
extern "C" __global__ void __launch_bounds__(32) symm_p2p_wait(P2pArgs a) {
  if (threadIdx.x == 0) symm_signal_wait(a.d, a.slot, a.value);
}

// Raises the peer's slot to value after the stream's earlier work.
extern "C" __global__ void __launch_bounds__(32) symm_p2p_signal(P2pArgs a) {
  if (threadIdx.x == 0) symm_signal_send(a.d, a.peer, a.slot, a.value);
}
