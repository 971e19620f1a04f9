/* Every legal and every illegal tensor-state transition, against a list
 * written out independently of the table in memmgr/tensor_state.c. */
#include "td_test.h"
#include "tidal/tensor_state.h"

#include <stdio.h>
#include <string.h>

#define S(x) TD_TENSOR_##x
static const struct { td_tensor_state from, to; } legal[] = {
    {S(FREE), S(COMPUTE)}, {S(FREE), S(HOLD)},
    {S(COMPUTE), S(FREE)}, {S(COMPUTE), S(HOLD)}, {S(COMPUTE), S(HOLD_AFTER_FWD)},
    {S(COMPUTE), S(HOLD_AFTER_BWD)}, {S(COMPUTE), S(READY_FOR_REDUCE)},
    {S(HOLD), S(FREE)}, {S(HOLD), S(COMPUTE)},
    {S(HOLD_AFTER_FWD), S(COMPUTE)}, {S(HOLD_AFTER_FWD), S(HOLD)}, {S(HOLD_AFTER_FWD), S(FREE)},
    {S(HOLD_AFTER_BWD), S(COMPUTE)}, {S(HOLD_AFTER_BWD), S(HOLD)}, {S(HOLD_AFTER_BWD), S(READY_FOR_REDUCE)},
    {S(READY_FOR_REDUCE), S(COMPUTE)}, {S(READY_FOR_REDUCE), S(HOLD)}, {S(READY_FOR_REDUCE), S(FREE)},
};

static int in_list(td_tensor_state a, td_tensor_state b)
{
    for (size_t i = 0; i < sizeof legal / sizeof legal[0]; i++)
        if (legal[i].from == a && legal[i].to == b) return 1;
    return 0;
}

static void test_every_transition(void **state)
{
    int n_legal = 0;
    for (int a = 0; a < TD_TENSOR_STATE_COUNT; a++)
        for (int b = 0; b < TD_TENSOR_STATE_COUNT; b++) {
            int want = in_list((td_tensor_state)a, (td_tensor_state)b);
            assert_int_equal(td_tensor_state_legal((td_tensor_state)a, (td_tensor_state)b), want);
            td_status st = td_tensor_state_check("h.0.mlp.c_fc.weight", (td_tensor_state)a, (td_tensor_state)b);
            if (want) {
                assert_int_equal(st, TD_OK);
                n_legal++;
            } else {
                assert_int_equal(st, TD_ERR_STATE);
                const char *m = td_error_msg();
                char expect[128];
                snprintf(expect, sizeof expect, "illegal transition %s -> %s",
                         td_tensor_state_name((td_tensor_state)a), td_tensor_state_name((td_tensor_state)b));
                assert_non_null(strstr(m, "h.0.mlp.c_fc.weight"));
                assert_non_null(strstr(m, expect));
            }
        }
    assert_int_equal(n_legal, (int)(sizeof legal / sizeof legal[0]));
}

static void test_out_of_range_states_are_illegal(void **state)
{
    assert_false(td_tensor_state_legal((td_tensor_state)-1, S(HOLD)));
    assert_false(td_tensor_state_legal(S(HOLD), TD_TENSOR_STATE_COUNT));
    assert_int_equal(td_tensor_state_check(NULL, TD_TENSOR_STATE_COUNT, S(HOLD)), TD_ERR_STATE);
    assert_string_equal(td_tensor_state_name(TD_TENSOR_STATE_COUNT), "INVALID");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_transition),
        cmocka_unit_test(test_out_of_range_states_are_illegal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
