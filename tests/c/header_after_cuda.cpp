/* The header compiles after cuda.h (C++17); its stream type is the driver's CUstream. */
#include <cuda.h>
#include "symmalloc.h"
int main(void) {
  /* A driver CUstream passes where the header takes struct CUstream_st *. */
  CUstream s = 0;
  void (*f)(void *, size_t, int, struct CUstream_st *) = symm_free;
  f(NULL, 0, 0, s); /* freeing NULL is a no-op, also without a GPU */
  return symm_last_error()[0] == 0 ? 0 : 1;
}
