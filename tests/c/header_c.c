/* The header compiles alone as C11 with -Wall -Wextra -Werror -pedantic. */
#include "symmalloc.h"
int main(void) {
  symm_memory_stats_t s;
  symm_unique_id_t id;
  (void)s;
  (void)id;
  return sizeof(id.internal) == 128 && SYMM_SUCCESS == 0 && SYMM_ALGO_MULTIMEM == 3 ? 0 : 1;
}
