/* AdamW state in checkpoints, for every moment format (--optim-state fp32,
 * bf16, int8):
 *   - checkpoints written before optim/ took over the moments' conversions
 *     (tests/data/ckpt/<format>/, written by this file's fixture mode) still
 *     load, and saving what was loaded gives back the same master, m and v,
 *     bit for bit;
 *   - a trainer's state survives save and load bit for bit: every moment
 *     chunk's bytes (int8 codes and scales, bf16 codes) and the master, and
 *     the steps after match the run that never stopped.
 *
 * Fixture mode: TD_OPTIM_CKPT_FIXTURES=DIR writes the three checkpoints into
 * DIR/<format>/ instead of testing (the files under tests/data/ckpt were
 * made so, before the change they guard). */
#include "td_train_test.h"
#include "tidal/checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FIXTURES "tests/data/ckpt"

/* Two blocks 8 wide in chunks of 1024 to 2048 elements: each chunk holds
 * several tensors, so int8 scale blocks straddle tensor boundaries. */
static td_train_config small_config(td_optim_state s)
{
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){ .n_layer = 2, .n_head = 2, .n_embd = 8, .n_positions = 16, .vocab_size = 61,
                               .padded_vocab_size = 64 };
    c.micro_batch = 2;
    c.seq_len = 16;
    c.backend = TD_BACKEND_CPU;
    c.gpu_budget = 16 * TD_MiB;
    c.mm.min_chunk_numel = 1024;
    c.mm.max_chunk_numel = 2048;
    c.optim.lr.lr = 1e-2;
    c.optim.state = s;
    c.threads = 1;
    return c;
}

static void steps(td_trainer *t, td_test_batches *b, int n, double *losses)
{
    for (int s = 0; s < n; s++) {
        td_step_result r;
        TD_ASSERT_OK(td_trainer_step(t, td_test_next_batch, b, &r));
        if (losses) losses[s] = r.loss;
    }
}

/* Every master, m and v value of two checkpoints, and their weights, are
 * the same bits. */
static void expect_same_state(const char *a, const char *b, const td_model_desc *mc)
{
    td_ckpt_reader *ra, *rb;
    TD_ASSERT_OK(td_ckpt_reader_open(a, mc, &ra));
    TD_ASSERT_OK(td_ckpt_reader_open(b, mc, &rb));
    int n = td_model_hf_count(mc);
    size_t total = 0;
    for (int k = 0; k < n; k++) {
        td_model_hf_tensor cp;
        TD_ASSERT_OK(td_model_hf_get(mc, k, &cp));
        size_t numel = (size_t)cp.numel;
        float *x = malloc(numel * sizeof *x), *y = malloc(numel * sizeof *y);
        assert_true(x && y);
        static const td_ckpt_state kinds[3] = {TD_CKPT_STATE_MASTER, TD_CKPT_STATE_ADAM_M, TD_CKPT_STATE_ADAM_V};
        for (int j = 0; j < 3; j++) {
            TD_ASSERT_OK(td_ckpt_reader_read_state(ra, k, kinds[j], 0, numel, x));
            TD_ASSERT_OK(td_ckpt_reader_read_state(rb, k, kinds[j], 0, numel, y));
            if (memcmp(x, y, numel * sizeof *x))
                fail_msg("%s vs %s: param %d state %d differs", a, b, k, j);
        }
        TD_ASSERT_OK(td_ckpt_reader_get_weight(ra, k, TD_DTYPE_F32, x));
        TD_ASSERT_OK(td_ckpt_reader_get_weight(rb, k, TD_DTYPE_F32, y));
        assert_memory_equal(x, y, numel * sizeof *x);
        total += numel;
        free(x);
        free(y);
    }
    assert_true(total > 2000);
    td_ckpt_reader_close(ra);
    td_ckpt_reader_close(rb);
}

/* The moments of a checkpoint hold what the format can store: bf16 values,
 * and int8 values that are (nearly all) not bf16 values; nonzero. */
static void expect_format_values(const char *dir, const td_model_desc *mc, td_optim_state s)
{
    td_ckpt_reader *r;
    TD_ASSERT_OK(td_ckpt_reader_open(dir, mc, &r));
    size_t nonzero = 0, bf16 = 0, all = 0;
    for (int k = 0; k < td_model_hf_count(mc); k++) {
        td_model_hf_tensor cp;
        TD_ASSERT_OK(td_model_hf_get(mc, k, &cp));
        float *x = malloc((size_t)cp.numel * sizeof *x);
        assert_non_null(x);
        TD_ASSERT_OK(td_ckpt_reader_read_state(r, k, TD_CKPT_STATE_ADAM_M, 0, (size_t)cp.numel, x));
        for (size_t i = 0; i < (size_t)cp.numel; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            nonzero += x[i] != 0;
            bf16 += (u & 0xffff) == 0;
            all++;
        }
        free(x);
    }
    td_ckpt_reader_close(r);
    assert_true(nonzero > all / 2);
    if (s == TD_OPTIM_STATE_BF16) assert_int_equal(bf16, all);
    else assert_true(all - bf16 > all / 2);
}

static int write_fixtures(const char *root)
{
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        td_train_config c = small_config((td_optim_state)s);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        td_test_batches b = td_test_batches_of(&c, 7);
        steps(t, &b, 3, NULL);
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", root, td_optim_state_name((td_optim_state)s));
        TD_ASSERT_OK(td_trainer_save(t, dir, 1, NULL));
        td_trainer_destroy(t);
        printf("wrote %s\n", dir);
    }
    return 0;
}

static char tmp[64];

static int setup(void **state)
{
    snprintf(tmp, sizeof tmp, "/tmp/td_optim_ckpt_XXXXXX");
    return mkdtemp(tmp) ? 0 : -1;
}

static int teardown(void **state)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    return system(cmd) == 0 ? 0 : -1;
}

/* Checkpoints written before: they load in the format they name, and a
 * save of what was loaded is the same state, bit for bit; they continue;
 * another format is refused, naming the one to use. */
static void test_old_checkpoints_load(void **state)
{
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        const char *name = td_optim_state_name((td_optim_state)s);
        char dir[256], again[256];
        snprintf(dir, sizeof dir, FIXTURES "/%s", name);
        snprintf(again, sizeof again, "%s/again_%s", tmp, name);
        td_train_config c = small_config((td_optim_state)s);
        td_model_desc mc;
        TD_ASSERT_OK(td_trainer_checkpoint_model(dir, &mc));
        assert_memory_equal(&mc, &c.model, sizeof mc);
        expect_format_values(dir, &mc, (td_optim_state)s);
        td_trainer *t;
        TD_ASSERT_OK(td_trainer_create(&c, &t));
        TD_ASSERT_OK(td_trainer_load(t, dir, 1, NULL));
        assert_int_equal(td_trainer_optim(t)->step, 3);
        TD_ASSERT_OK(td_trainer_save(t, again, 1, NULL));
        expect_same_state(dir, again, &mc);
        td_test_batches b = td_test_batches_of(&c, 8);
        double l[2];
        steps(t, &b, 2, l);
        assert_true(l[0] > 0 && l[0] < 5 && l[1] > 0 && l[1] < 5);
        td_trainer_destroy(t);
        td_train_config other = small_config((td_optim_state)((s + 1) % TD_OPTIM_STATE_COUNT));
        TD_ASSERT_OK(td_trainer_create(&other, &t));
        assert_int_equal(td_trainer_load(t, dir, 1, NULL), TD_ERR_INVALID);
        char want[64];
        snprintf(want, sizeof want, "resume with --optim-state %s", name);
        assert_non_null(strstr(td_error_msg(), want));
        td_trainer_destroy(t);
    }
}

/* Host bytes of every optimizer chunk (master, m, v) of a trainer, in chunk order. */
static unsigned char *optim_bytes(td_trainer *t, size_t *n)
{
    td_memmgr *mm = td_trainer_memmgr(t);
    static const td_tensor_role roles[3] = {TD_TENSOR_MASTER, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};
    size_t total = 0;
    unsigned char *all = NULL;
    TD_ASSERT_OK(td_trainer_finish_update(t));
    for (int pass = 0; pass < 2; pass++) {
        size_t at = 0;
        for (int r = 0; r < 3; r++)
            for (int i = 0; i < td_memmgr_role_chunk_count(mm, roles[r]); i++) {
                int c = td_memmgr_role_chunk(mm, roles[r], i);
                size_t bytes = td_memmgr_chunk_bytes(mm, c);
                if (pass) {
                    void *h;
                    TD_ASSERT_OK(td_memmgr_chunk_host_access(mm, c, TD_ACCESS_READ, &h));
                    memcpy(all + at, h, bytes);
                }
                at += bytes;
            }
        if (!pass) all = malloc(total = at);
        assert_non_null(all);
    }
    *n = total;
    return all;
}

/* Save and load keep a trainer's state, bit for bit, in every format: the
 * optimizer chunks' bytes, and the losses of the steps after. */
static void test_state_round_trips(void **state)
{
    for (int s = 0; s < TD_OPTIM_STATE_COUNT; s++) {
        td_train_config c = small_config((td_optim_state)s);
        c.model.n_layer = 3;
        c.grad_accum = 2;
        char dir[256];
        snprintf(dir, sizeof dir, "%s/rt_%s", tmp, td_optim_state_name((td_optim_state)s));
        td_trainer *a, *b;
        TD_ASSERT_OK(td_trainer_create(&c, &a));
        td_test_batches ba = td_test_batches_of(&c, 11);
        steps(a, &ba, 4, NULL);
        TD_ASSERT_OK(td_trainer_save(a, dir, 1, NULL));
        TD_ASSERT_OK(td_trainer_create(&c, &b));
        TD_ASSERT_OK(td_trainer_load(b, dir, 1, NULL));
        size_t na, nb;
        unsigned char *xa = optim_bytes(a, &na), *xb = optim_bytes(b, &nb);
        assert_int_equal(na, nb);
        assert_true(na > 0);
        if (memcmp(xa, xb, na))
            fail_msg("%s: the optimizer state after load differs from the one saved",
                     td_optim_state_name((td_optim_state)s));
        free(xa);
        free(xb);
        td_test_batches bb = ba;
        double la[3], lb[3];
        steps(a, &ba, 3, la);
        steps(b, &bb, 3, lb);
        assert_memory_equal(la, lb, sizeof la);
        td_trainer_destroy(a);
        td_trainer_destroy(b);
    }
}

int main(void)
{
    const char *fx = getenv("TD_OPTIM_CKPT_FIXTURES");
    if (fx && *fx) return write_fixtures(fx);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_old_checkpoints_load),
        cmocka_unit_test(test_state_round_trips),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
