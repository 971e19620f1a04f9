/* The backend-generic cases of tests/test_backend.c, on the cuda backend
 * whatever TD_BACKEND says (run by `make gpu-test` on a GPU machine). */
#include "backend_cases.h"

#include <stdlib.h>

int main(void)
{
    setenv("TD_BACKEND", "cuda", 1);
    const struct CMUnitTest tests[] = { TD_BACKEND_CASES };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
