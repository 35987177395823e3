/* Built against the installed headers and library (CMake package, and pkg-config in `make
 * test-install`): <symmalloc_device.cuh> is found beside <symmalloc.h>, and its host part agrees
 * with the library: one rank on the host backend rendezvouses a buffer, and symm_peer over the
 * symm_comm_device view gives what symm_peer_ptr gives. */
#include <cstdio>

#include <symmalloc_device.cuh>

int main() {
  symm_unique_id_t id;
  symm_comm_t *comm = nullptr;
  if (symm_get_unique_id(&id) != SYMM_SUCCESS || symm_comm_init(&comm, 1, 0, 0, &id) != SYMM_SUCCESS) {
    std::fprintf(stderr, "init: %s\n", symm_last_error());
    return 1;
  }
  const size_t bytes = 4096;
  float *buf = static_cast<float *>(symm_malloc(bytes, 0, nullptr));
  symm_device_comm_t d;
  void *peer = nullptr;
  if (!buf || symm_rendezvous(comm, buf, bytes) != SYMM_SUCCESS ||
      symm_comm_device(comm, &d, sizeof d) != SYMM_SUCCESS ||
      symm_peer_ptr(comm, buf + 7, 0, &peer) != SYMM_SUCCESS) {
    std::fprintf(stderr, "p2p: %s\n", symm_last_error());
    return 1;
  }
  if (symm_peer(d, buf + 7, 0) != peer || d.world != 1 || d.version != SYMM_DEVICE_COMM_VERSION) {
    std::fprintf(stderr, "symm_peer disagrees with symm_peer_ptr\n");
    return 1;
  }
  symm_free(buf, bytes, 0, nullptr);
  std::printf("consumer_device: symmalloc_device.cuh found; symm_peer agrees with symm_peer_ptr\n");
  return symm_comm_destroy(comm) == SYMM_SUCCESS ? 0 : 1;
}
