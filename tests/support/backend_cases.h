/* Backend-generic test cases: the same bodies run on whatever backend
 * td_test_backend() gives — cpu in tests/test_backend.c (the default of
 * `make test`), cuda in tests/gpu/test_backend_gpu.c (`make gpu-test`).
 * They touch device memory only through the backend (never dereference a
 * device pointer), pin every host buffer, and order every cross-queue access
 * with events, so a pass on cuda means the same program is legal there.
 * On cpu the cases that use a debug backend delay and poison every copy, so a
 * missing wait shows up as wrong bytes. */
#ifndef TD_BACKEND_CASES_H
#define TD_BACKEND_CASES_H

#include "td_test.h"

void bcase_identity(void **state);
void bcase_copy_all_directions(void **state);
void bcase_copy_pipeline_across_queues(void **state);
void bcase_queue_order(void **state);
void bcase_cross_queue_wait(void **state);
void bcase_wait_captures_latest_record(void **state);
void bcase_events(void **state);
void bcase_event_free_while_pending(void **state);
void bcase_directions_overlap(void **state);
void bcase_memset(void **state);
void bcase_reserve_over_capacity(void **state);
void bcase_random_programs(void **state);

#define TD_BACKEND_CASES                                   \
    cmocka_unit_test(bcase_identity),                      \
    cmocka_unit_test(bcase_copy_all_directions),           \
    cmocka_unit_test(bcase_copy_pipeline_across_queues),   \
    cmocka_unit_test(bcase_queue_order),                   \
    cmocka_unit_test(bcase_cross_queue_wait),              \
    cmocka_unit_test(bcase_wait_captures_latest_record),   \
    cmocka_unit_test(bcase_events),                        \
    cmocka_unit_test(bcase_event_free_while_pending),      \
    cmocka_unit_test(bcase_directions_overlap),            \
    cmocka_unit_test(bcase_memset),                        \
    cmocka_unit_test(bcase_reserve_over_capacity),         \
    cmocka_unit_test(bcase_random_programs)

#endif
