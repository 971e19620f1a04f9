/* Packed documents end to end on the cpu backend:
 *   - token files of version 2 (rows, a flag byte per token): what the
 *     writer writes reads back, counts of documents, targets and padding,
 *     every damaged flag byte is an error, a layout set late is refused;
 *   - packing: first fit leaves little padding, --no-pack gives each
 *     document its rows, the too-long rules, documents with nothing to
 *     learn dropped, the shuffle a permutation of the documents;
 *   - the loader on rows: targets only where flagged, -1 at each document's
 *     start, in padding and at the row's end; positions restarting; a
 *     resumed loader draws the same batches;
 *   - the loss of a packed file equals the token-weighted mean of its
 *     documents evaluated one by one with the whole-model reference
 *     (GPT-2's learned positions, LLaMA's RoPE with grouped-query
 *     attention), within 1e-5; a training step counts exactly the flagged
 *     targets;
 *   - `tidal prepare` on JSONL (plain and gzip): rows, the summary, a bad
 *     line named by its line number, --skip-bad, an unknown role, exit
 *     codes; `tidal eval --batches all --json` counts every target once. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_proc.h"
#include "td_train_test.h"
#include "tidal/data.h"
#include "tidal/model_ref.h"

#define R 48 /* row length of these tests */

typedef struct docs {
    int n;
    uint32_t *ids[200];
    uint8_t *cnt[200];
    size_t len[200];
} docs;

/* Random documents of 2 .. max tokens below vocab, a random mask of which
 * count (at least one after the first token). */
static void make_docs(docs *D, int n, int max, int vocab, uint64_t seed)
{
    td_rng rng;
    td_rng_seed(&rng, seed);
    D->n = n;
    for (int d = 0; d < n; d++) {
        size_t len = 2 + td_rng_below(&rng, (uint64_t)max - 1);
        D->len[d] = len;
        D->ids[d] = malloc(len * sizeof(uint32_t));
        D->cnt[d] = malloc(len);
        for (size_t i = 0; i < len; i++) {
            D->ids[d][i] = (uint32_t)td_rng_below(&rng, (uint64_t)vocab);
            D->cnt[d][i] = (uint8_t)(i > 0 && td_rng_below(&rng, 3) != 0);
        }
        D->cnt[d][len - 1] = 1;
    }
}

static void free_docs(docs *D)
{
    for (int d = 0; d < D->n; d++) {
        free(D->ids[d]);
        free(D->cnt[d]);
    }
}

/* Packs D into a token file at path; returns the stats. */
static td_pack_stats write_packed(const docs *D, const char *path, int pack, int vocab, td_pack_long rule)
{
    td_pack *p;
    td_tokfile_writer *w;
    td_pack_stats s;
    TD_ASSERT_OK(td_pack_create(R, pack, &p));
    for (int d = 0; d < D->n; d++) TD_ASSERT_OK(td_pack_add(p, D->ids[d], D->cnt[d], D->len[d], rule));
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, (uint32_t)vocab, (uint32_t)vocab - 1, &w));
    TD_ASSERT_OK(td_pack_write(p, 1, 7, (uint32_t)vocab - 1, w, &s));
    TD_ASSERT_OK(td_tokfile_writer_commit(w));
    td_pack_free(p);
    return s;
}

static char tmp_dir[128];

static int setup(void **state)
{
    (void)state;
    return td_proc_tmpdir(tmp_dir, sizeof tmp_dir, "td-packed");
}

static int teardown(void **state)
{
    (void)state;
    return td_proc_rmdir(tmp_dir);
}

static void path_of(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", tmp_dir, name); }

/* ---- the file -------------------------------------------------------------- */

static void test_file_roundtrip_and_damage(void **state)
{
    (void)state;
    docs D;
    make_docs(&D, 60, 30, 100, 1);
    char path[256];
    path_of(path, sizeof path, "a.tok");
    td_pack_stats s = write_packed(&D, path, 1, 101, TD_PACK_DROP);
    uint64_t tokens = 0, targets = 0;
    for (int d = 0; d < D.n; d++) {
        tokens += D.len[d];
        for (size_t i = 1; i < D.len[d]; i++) targets += D.cnt[d][i];
    }
    assert_int_equal(s.documents, 60);
    assert_int_equal(s.tokens, s.rows * R);
    assert_int_equal(s.tokens - s.padding, tokens);
    assert_int_equal(s.targets, targets);
    assert_true(s.padding < R * 2); /* first fit: at most about a row's worth is lost */
    td_tokfile *f;
    TD_ASSERT_OK(td_tokfile_open(path, &f));
    const td_tokfile_info *in = td_tokfile_get_info(f);
    assert_int_equal(in->version, 2);
    assert_int_equal(in->row_tokens, R);
    assert_true(in->has_flags);
    assert_int_equal(in->documents, 60);
    assert_int_equal(in->targets, targets);
    assert_int_equal(in->padding, s.padding);
    /* the documents read back, as a multiset: each row split at its starts */
    int found = 0;
    for (uint64_t i = 0; i < in->token_count;) {
        uint64_t j = i + 1;
        while (j < in->token_count && !(td_tokfile_flags_at(f, j) & TD_TOKFLAG_DOC_START)) j++;
        if (!(td_tokfile_flags_at(f, i) & TD_TOKFLAG_PAD)) {
            int match = -1;
            for (int d = 0; d < D.n && match < 0; d++) {
                if (D.len[d] != j - i || !D.ids[d]) continue;
                int same = 1;
                for (size_t k = 0; k < D.len[d] && same; k++)
                    same = td_tokfile_at(f, i + k) == D.ids[d][k] &&
                           (k == 0 || !!(td_tokfile_flags_at(f, i + k) & TD_TOKFLAG_TARGET) == D.cnt[d][k]);
                if (same) match = d;
            }
            assert_true(match >= 0);
            free(D.ids[match]);
            D.ids[match] = NULL; /* found once */
            found++;
        }
        i = j;
    }
    assert_int_equal(found, 60);
    const size_t token_count = (size_t)in->token_count; /* the info goes with the file */
    td_tokfile_close(f);
    /* every single-byte change of the flags is an error */
    size_t len;
    char *bytes = td_test_slurp(path, &len);
    const size_t flags_at = TD_TOKFILE_HEADER_BYTES + token_count * 2;
    for (size_t i = flags_at; i < len; i += 7) {
        bytes[i] ^= 0x10;
        assert_int_not_equal(td_tokfile_open_buffer(bytes, len, "damaged", &f), TD_OK);
        bytes[i] ^= 0x10;
    }
    bytes[flags_at] &= (char)~TD_TOKFLAG_DOC_START; /* a row that does not start a document */
    assert_int_equal(td_tokfile_open_buffer(bytes, len, "x", &f), TD_ERR_INVALID);
    free(bytes);
    /* the layout comes before the tokens */
    td_tokfile_writer *w;
    uint32_t id = 3;
    TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 257, 256, &w));
    TD_ASSERT_OK(td_tokfile_writer_append(w, &id, 1));
    assert_int_equal(td_tokfile_writer_set_layout(w, 4, 1), TD_ERR_STATE);
    td_tokfile_writer_abort(w);
    free_docs(&D);
}

static void test_packing_rules(void **state)
{
    (void)state;
    char path[256];
    path_of(path, sizeof path, "b.tok");
    docs D;
    make_docs(&D, 40, 20, 50, 2);
    td_pack_stats packed = write_packed(&D, path, 1, 51, TD_PACK_DROP);
    td_pack_stats alone = write_packed(&D, path, 0, 51, TD_PACK_DROP);
    assert_int_equal(alone.rows, 40); /* each document a row of its own */
    assert_true(packed.rows < alone.rows / 2);
    assert_true((double)packed.padding / (double)packed.tokens < 0.1);
    free_docs(&D);
    /* too long: 120 tokens in rows of 48 */
    uint32_t ids[120];
    uint8_t cnt[120];
    for (int i = 0; i < 120; i++) ids[i] = (uint32_t)i % 50, cnt[i] = 1;
    td_pack_long rules[3] = {TD_PACK_SPLIT, TD_PACK_CUT, TD_PACK_DROP};
    for (int k = 0; k < 3; k++) {
        td_pack *p;
        TD_ASSERT_OK(td_pack_create(R, 1, &p));
        TD_ASSERT_OK(td_pack_add(p, ids, cnt, 120, rules[k]));
        uint8_t none[5] = {0};
        TD_ASSERT_OK(td_pack_add(p, ids, none, 5, rules[k])); /* nothing counts: dropped */
        const td_pack_stats *s = td_pack_get_stats(p);
        assert_int_equal(s->split, k == 0);
        assert_int_equal(s->cut, k == 1);
        assert_int_equal(s->dropped_long, k == 2);
        assert_int_equal(s->dropped_empty, 1);
        td_tokfile_writer *w;
        td_pack_stats out;
        TD_ASSERT_OK(td_tokfile_writer_open(path, TD_TOKENIZER_BYTE, 51, 50, &w));
        if (k < 2) {
            TD_ASSERT_OK(td_pack_write(p, 0, 0, 50, w, &out));
            assert_int_equal(out.documents, k == 0 ? 3 : 1);
            assert_int_equal(out.tokens - out.padding, k == 0 ? 120 : R);
            TD_ASSERT_OK(td_tokfile_writer_commit(w));
        } else {
            td_tokfile_writer_abort(w);
        }
        td_pack_free(p);
    }
    assert_int_equal(td_pack_create(1, 1, &(td_pack *){NULL}), TD_ERR_INVALID);
}

/* ---- the loader -------------------------------------------------------------- */

static void test_loader_rows(void **state)
{
    (void)state;
    char path[256];
    path_of(path, sizeof path, "c.tok");
    docs D;
    make_docs(&D, 30, 25, 60, 3);
    write_packed(&D, path, 1, 61, TD_PACK_DROP);
    td_loader_params lp = td_loader_default_params();
    lp.batch = 2;
    lp.seq = R - 1;
    td_loader *l;
    assert_int_equal(td_loader_open(path, &lp, &l), TD_ERR_INVALID); /* rows are read at their own length */
    lp.seq = R;
    lp.shuffle = 0;
    TD_ASSERT_OK(td_loader_open(path, &lp, &l));
    const td_tokfile *f = td_loader_file(l);
    int32_t in[2 * R], tg[2 * R], pos[2 * R];
    uint64_t counted = 0;
    for (uint64_t s = 0; s < td_loader_sequences(l); s += 2) {
        TD_ASSERT_OK(td_loader_next(l, in, tg, pos));
        for (int b = 0; b < 2 && s + (uint64_t)b < td_loader_sequences(l); b++)
            for (int t = 0; t < R; t++) {
                const uint64_t i = (s + (uint64_t)b) * R + (uint64_t)t;
                const int k = b * R + t;
                assert_int_equal(in[k], (int32_t)td_tokfile_at(f, i));
                const unsigned fl = td_tokfile_flags_at(f, i);
                assert_int_equal(pos[k] == 0, t == 0 || (fl & TD_TOKFLAG_DOC_START) != 0);
                if (t > 0 && !(fl & TD_TOKFLAG_DOC_START)) assert_int_equal(pos[k], pos[k - 1] + 1);
                if (t == R - 1) {
                    assert_int_equal(tg[k], -1);
                    continue;
                }
                const unsigned nf = td_tokfile_flags_at(f, i + 1);
                const int want = (nf & TD_TOKFLAG_TARGET) && !(nf & TD_TOKFLAG_DOC_START);
                assert_int_equal(tg[k] >= 0, want);
                if (want) assert_int_equal(tg[k], (int32_t)td_tokfile_at(f, i + 1));
                counted += want;
            }
    }
    assert_int_equal(counted, td_tokfile_get_info(f)->targets);
    td_loader_destroy(l);
    /* resume: a shuffled loader seeked to a saved position draws the same
     * batches (inputs, targets, positions) as one that never stopped */
    lp.shuffle = 1;
    lp.seed = 5;
    td_loader *a, *b;
    TD_ASSERT_OK(td_loader_open(path, &lp, &a));
    TD_ASSERT_OK(td_loader_open(path, &lp, &b));
    td_loader_position at;
    for (int k = 0; k < 7; k++) TD_ASSERT_OK(td_loader_next(a, in, tg, pos)); /* past an epoch's end */
    td_loader_tell(a, &at);
    TD_ASSERT_OK(td_loader_seek(b, &at));
    for (int k = 0; k < 9; k++) {
        int32_t in2[2 * R], tg2[2 * R], pos2[2 * R];
        TD_ASSERT_OK(td_loader_next(a, in, tg, pos));
        TD_ASSERT_OK(td_loader_next(b, in2, tg2, pos2));
        assert_memory_equal(in, in2, sizeof in);
        assert_memory_equal(tg, tg2, sizeof tg);
        assert_memory_equal(pos, pos2, sizeof pos);
    }
    td_loader_destroy(a);
    td_loader_destroy(b);
    free_docs(&D);
}

/* ---- the loss ----------------------------------------------------------------- */

typedef struct eval_src { td_loader *l; uint64_t left; int B; } eval_src;

static td_status src_next(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    eval_src *e = ctx;
    td_status st = td_loader_next(e->l, tokens, targets, positions);
    for (int b = (int)(e->left < (uint64_t)e->B ? e->left : (uint64_t)e->B); b < e->B; b++)
        for (int t = 0; t < R; t++) targets[b * R + t] = -1;
    e->left -= e->left < (uint64_t)e->B ? e->left : (uint64_t)e->B;
    return st;
}

/* The loss of the packed file through the trainer against the reference
 * model on each document alone. */
static void packed_loss_case(td_model_desc mc, const char *name)
{
    char path[256];
    path_of(path, sizeof path, "d.tok");
    docs D;
    make_docs(&D, 40, 30, mc.vocab_size - 1, 4);
    td_pack_stats s = write_packed(&D, path, 1, mc.vocab_size, TD_PACK_DROP);
    td_train_config c = td_train_default_config();
    c.model = mc;
    c.micro_batch = 2;
    c.seq_len = R;
    c.backend = TD_BACKEND_CPU;
    c.threads = 2;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_loader_params lp = td_loader_default_params();
    lp.batch = 2;
    lp.seq = R;
    lp.shuffle = 0;
    td_loader *l;
    TD_ASSERT_OK(td_loader_open(path, &lp, &l));
    eval_src e = {l, td_loader_sequences(l), 2};
    double packed;
    uint64_t counted;
    TD_ASSERT_OK(td_trainer_eval(t, src_next, &e, (int)((s.rows + 1) / 2), &packed, &counted));
    assert_int_equal(counted, s.targets);
    /* each document alone through the reference: sum of mean x count */
    size_t np = td_model_params_numel(&mc);
    float *params = malloc(np * sizeof(float));
    td_model_init(&mc, params, c.seed);
    double sum = 0;
    uint64_t n = 0;
    for (int d = 0; d < D.n; d++) {
        int T = (int)D.len[d] - 1, tok[R], tg[R], cnt = 0;
        for (int i = 0; i < T; i++) {
            tok[i] = (int)D.ids[d][i];
            tg[i] = D.cnt[d][i + 1] ? (int)D.ids[d][i + 1] : -1;
        }
        float *acts = malloc(td_model_acts_numel(&mc, 1, T) * sizeof(float)), loss;
        TD_ASSERT_OK(td_model_forward(&mc, params, tok, tg, 1, T, acts, &loss, &cnt));
        sum += (double)loss * cnt;
        n += (uint64_t)cnt;
        free(acts);
    }
    const double alone = sum / (double)n;
    printf("  %s: packed %.7f over %llu targets, documents alone %.7f over %llu (%llu rows, %.1f%% padding)\n", name,
           packed, (unsigned long long)counted, alone, (unsigned long long)n, (unsigned long long)s.rows,
           100.0 * (double)s.padding / (double)s.tokens);
    assert_int_equal(n, counted);
    assert_true(fabs(packed - alone) <= 1e-5 * fmax(1.0, fabs(alone)));
    /* a training step counts the same targets */
    td_loader_destroy(l);
    lp.shuffle = 1;
    TD_ASSERT_OK(td_loader_open(path, &lp, &l));
    td_step_result r;
    int32_t probe_in[2 * R], probe_tg[2 * R];
    td_loader *twin;
    TD_ASSERT_OK(td_loader_open(path, &lp, &twin));
    TD_ASSERT_OK(td_loader_next(twin, probe_in, probe_tg, NULL));
    long want = 0;
    for (int i = 0; i < 2 * R; i++) want += probe_tg[i] >= 0;
    c.grad_accum = 1;
    td_trainer_destroy(t);
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    TD_ASSERT_OK(td_trainer_step(t, src_next, &(eval_src){l, UINT64_MAX, 2}, &r));
    assert_int_equal(r.targets, want);
    assert_true(isfinite(r.loss) && r.loss > 0);
    td_loader_destroy(twin);
    td_loader_destroy(l);
    td_trainer_destroy(t);
    free(params);
    free_docs(&D);
}

static void test_packed_loss_equals_documents_alone(void **state)
{
    (void)state;
    td_model_desc gpt2 = {.n_layer = 2, .n_head = 2, .n_embd = 32, .n_positions = R, .vocab_size = 97,
                          .padded_vocab_size = 128};
    packed_loss_case(gpt2, "GPT-2");
    td_model_desc llama = gpt2;
    TD_ASSERT_OK(td_model_desc_set_family(&llama, "llama"));
    llama.n_head = 4;
    llama.n_kv_head = 2;
    llama.n_inner = 48;
    llama.untied_head = 1;
    packed_loss_case(llama, "LLaMA (RoPE, 4 query heads on 2 kv heads)");
    td_model_desc qwen2 = llama;
    TD_ASSERT_OK(td_model_desc_set_family(&qwen2, "qwen2"));
    qwen2.n_head = 4;
    qwen2.n_kv_head = 2;
    qwen2.n_inner = 48;
    qwen2.untied_head = 1;
    qwen2.qkv_bias = 1;
    packed_loss_case(qwen2, "Qwen2 (q/k/v biases)");
    td_model_desc gemma = gpt2;
    TD_ASSERT_OK(td_model_desc_set_family(&gemma, "gemma"));
    gemma.n_head = 4;
    gemma.n_kv_head = 1;
    gemma.n_inner = 48;
    packed_loss_case(gemma, "Gemma (scaled embedding, 1 + w gains, GELU gate)");
}

/* Positions that do not restart at 0 or skip are refused by the trainer. */
static td_status bad_positions(void *ctx, int32_t *tokens, int32_t *targets, int32_t *positions)
{
    (void)ctx;
    for (int i = 0; i < 2 * R; i++) tokens[i] = 1, targets[i] = 2;
    positions[5] = 9;
    return TD_OK;
}

static void test_trainer_checks_positions(void **state)
{
    (void)state;
    td_train_config c = td_train_default_config();
    c.model = (td_model_desc){.n_layer = 1, .n_head = 2, .n_embd = 16, .n_positions = R, .vocab_size = 10,
                              .padded_vocab_size = 16};
    c.micro_batch = 2;
    c.seq_len = R;
    c.backend = TD_BACKEND_CPU;
    c.threads = 2;
    td_trainer *t;
    TD_ASSERT_OK(td_trainer_create(&c, &t));
    td_step_result r;
    assert_int_equal(td_trainer_step(t, bad_positions, NULL, &r), TD_ERR_INVALID);
    assert_non_null(strstr(td_error_msg(), "position 9 of row 0, token 5"));
    td_trainer_destroy(t);
}

/* ---- the command ---------------------------------------------------------------- */

static int run_tidal(const char *out, const char *fmt, const char *arg)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, fmt, arg);
    pid_t pid = td_proc_start(out, -1, 0, 0, "%s %s", td_test_tidal(), cmd);
    return td_proc_finish(pid, 120, cmd);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_prepare_and_eval_jsonl(void **state)
{
    (void)state;
    char jsonl[256], gz[256], tok[256], out[256], tmpl[256], cmd[1024];
    path_of(jsonl, sizeof jsonl, "r.jsonl");
    path_of(tok, sizeof tok, "r.tok");
    path_of(out, sizeof out, "out.txt");
    path_of(tmpl, sizeof tmpl, "t.jinja");
    write_text(tmpl, "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}");
    char body[8192] = "";
    for (int i = 0; i < 40; i++) {
        char line[256];
        snprintf(line, sizeof line,
                 i % 3 == 0 ? "{\"messages\": [{\"role\": \"user\", \"content\": \"question %d?\"}, "
                              "{\"role\": \"assistant\", \"content\": \"answer %d.\"}]}\n"
                 : i % 3 == 1 ? "{\"prompt\": \"say %d\", \"completion\": \" done %d\"}\n"
                              : "{\"text\": \"plain text number %d and %d\"}\n",
                 i, i);
        strcat(body, line);
    }
    write_text(jsonl, body);
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s --seq 64 --chat-template %s", jsonl, tok, tmpl);
    assert_int_equal(run_tidal(out, "%s", cmd), 0);
    const char *o = td_proc_slurp(out);
    if (!strstr(o, "rows of 64 tokens") || !strstr(o, "14 conversations, 13 prompt/completion, 13 text"))
        fail_msg("prepare said: %s", o);
    td_tokfile *f;
    TD_ASSERT_OK(td_tokfile_open(tok, &f));
    assert_int_equal(td_tokfile_get_info(f)->row_tokens, 64);
    assert_int_equal(td_tokfile_get_info(f)->documents, 40);
    const uint64_t targets = td_tokfile_get_info(f)->targets;
    td_tokfile_close(f);
    /* gzip reads alike */
    path_of(gz, sizeof gz, "r.jsonl.gz");
    snprintf(cmd, sizeof cmd, "gzip -c %s > %s", jsonl, gz);
    assert_int_equal(system(cmd), 0);
    char tok2[256];
    path_of(tok2, sizeof tok2, "r2.tok");
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s --seq 64 --chat-template %s --quiet", gz, tok2, tmpl);
    assert_int_equal(run_tidal(out, "%s", cmd), 0);
    size_t a_len, b_len;
    char *a = td_test_slurp(tok, &a_len), *b = td_test_slurp(tok2, &b_len);
    assert_int_equal(a_len, b_len);
    assert_memory_equal(a, b, a_len);
    free(a);
    free(b);
    /* a bad line stops the run naming it, or is skipped and counted */
    strcat(body, "{\"messages\": [{\"role\": \"narrator\", \"content\": \"x\"}]}\n{\"text\": \"ok\"\n");
    write_text(jsonl, body);
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s --seq 64 --chat-template %s", jsonl, tok2, tmpl);
    assert_int_equal(run_tidal(out, "%s", cmd), 1);
    if (!strstr(td_proc_slurp(out), "r.jsonl:41: message 1 has the unknown role 'narrator'"))
        fail_msg("prepare said: %s", td_proc_slurp(out));
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s --seq 64 --chat-template %s --skip-bad", jsonl, tok2, tmpl);
    assert_int_equal(run_tidal(out, "%s", cmd), 0);
    o = td_proc_slurp(out);
    if (!strstr(o, "skipped 1 lines not JSON (first: line 42:") || !strstr(o, "skipped 1 lines of the wrong shape"))
        fail_msg("prepare said: %s", o);
    /* JSONL options on text are usage errors; no template for a conversation is an error */
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s --seq 64", tmpl, tok2);
    assert_int_equal(run_tidal(out, "%s", cmd), 2);
    snprintf(cmd, sizeof cmd, "prepare --input %s --out %s", jsonl, tok2);
    assert_int_equal(run_tidal(out, "%s", cmd), 1);
    assert_non_null(strstr(td_proc_slurp(out), "needs a chat template"));
    /* eval over the whole file once counts each target once */
    char ckpt[256];
    path_of(ckpt, sizeof ckpt, "ckpt");
    snprintf(cmd, sizeof cmd, "train --data %s --layers 1 --heads 2 --width 32 --seq 64 --micro-batch 2 --steps 2 "
                              "--backend cpu --save %s", tok, ckpt);
    assert_int_equal(run_tidal(out, "%s", cmd), 0);
    snprintf(cmd, sizeof cmd, "eval --checkpoint %s --data %s --batches all --micro-batch 3 --backend cpu --json", ckpt,
             tok);
    assert_int_equal(run_tidal(out, "%s", cmd), 0);
    o = td_proc_slurp(out);
    char want[64];
    snprintf(want, sizeof want, "\"tokens\":%llu,", (unsigned long long)targets);
    if (!strstr(o, want)) fail_msg("eval said: %s (expected %s)", o, want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_file_roundtrip_and_damage),
        cmocka_unit_test(test_packing_rules),
        cmocka_unit_test(test_loader_rows),
        cmocka_unit_test(test_packed_loss_equals_documents_alone),
        cmocka_unit_test(test_trainer_checks_positions),
        cmocka_unit_test(test_prepare_and_eval_jsonl),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
