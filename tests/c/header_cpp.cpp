// The header compiles alone as C++17 with -Wall -Wextra -Werror -pedantic.
#include "symmalloc.h"
int main() {
  symm_status_t s = SYMM_ERR_INTERNAL;
  symm_dtype_t d = SYMM_FP32;
  return (s == 9 && d == 2) ? 0 : 1;
}
