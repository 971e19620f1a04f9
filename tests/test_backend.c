/* The backend interface, on the backend td_test_backend() gives (cpu unless
 * TD_BACKEND says otherwise): copies in every direction, queue order, events,
 * cross-queue waits, overlap of the two copy directions, memsets, device
 * capacity errors, and random programs that must end byte-identical to a
 * model.  The bodies live in tests/support/backend_cases.c, shared with
 * tests/gpu/test_backend_gpu.c, which runs them on cuda. */
#include "backend_cases.h"

int main(void)
{
    const struct CMUnitTest tests[] = { TD_BACKEND_CASES };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
