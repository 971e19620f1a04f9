/* `tidal prepare` on JSONL records (cli_prepare.c calls it): each line a
 * record ({"text"}, {"prompt", "completion"} or {"messages"}, chat.h),
 * rendered (conversations with the chat template), tokenized with its loss
 * mask, gathered, shuffled by document, packed into rows of --seq tokens
 * and written as a token file of rows with flags (data.h).
 *
 * Input is read through zlib, so a .jsonl.gz and a plain .jsonl read alike;
 * lines may be of any length.  A bad line (not JSON, a record of the wrong
 * shape, one the template refuses) stops the run naming the file, the line
 * and what is wrong, or with --skip-bad is skipped and counted by kind. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "cli_prepare_records.h"
#include "tidal/alloc.h"
#include "tidal/chat.h"
#include "tidal/data.h"
#include "tidal/util.h"

#define READ_BYTES ((size_t)1 << 20)
#define PROGRESS_MS 250.0

typedef td_prepare_records_result counts;

static void progress(const td_prepare_records *o, uint64_t bytes, uint64_t total, const counts *c, double t0,
                     double *last, int final)
{
    if (!o->progress) return;
    double now = td_now_ms();
    if (!final && now - *last < PROGRESS_MS) return;
    *last = now;
    char a[32], b[32];
    fprintf(stderr, "\r  prepare: %s", td_format_bytes(bytes, a, sizeof a));
    if (total) fprintf(stderr, " / %s (%3.0f%%)", td_format_bytes(total, b, sizeof b), 100.0 * (double)bytes / (double)total);
    fprintf(stderr, ", %llu records, %.1f MiB/s   %s", (unsigned long long)(c->kinds[0] + c->kinds[1] + c->kinds[2]),
            now > t0 ? (double)bytes / (1 << 20) / ((now - t0) / 1e3) : 0.0, final ? "\n" : "");
    fflush(stderr);
}

static const char *const BAD_NAMES[] = {"", "not JSON", "of the wrong shape", "refused by the chat template",
                                        "needing a chat template"};

/* One line: parsed, encoded and added to the pack.  0, or 1 (said) to stop. */
static int one_line(const td_prepare_records *o, td_pack *pack, const char *line, size_t len, counts *c)
{
    td_chat_record r;
    td_record_error why;
    uint32_t *ids = NULL;
    uint8_t *counted = NULL;
    size_t n = 0;
    td_status st = td_chat_record_parse(line, len, o->chat, o->loss_on, &r, &why);
    if (!st) {
        st = td_chat_record_encode(o->tok, &r, &ids, &counted, &n);
        if (st == TD_ERR_INVALID) why = TD_RECORD_TEMPLATE;
    }
    if (st == TD_ERR_INVALID && why == TD_RECORD_NO_TEMPLATE) {
        fprintf(stderr, "tidal prepare: %s:%llu: %s\n", o->input, (unsigned long long)c->lines, td_error_msg());
        return 1;
    }
    if (st == TD_ERR_INVALID && o->skip_bad) {
        if (!c->bad[why]++)
            snprintf(c->first_bad[why], sizeof c->first_bad[why], "line %llu: %s", (unsigned long long)c->lines,
                     td_error_msg());
        return 0;
    }
    if (st) {
        fprintf(stderr, "tidal prepare: %s:%llu: %s%s\n", o->input, (unsigned long long)c->lines, td_error_msg(),
                st == TD_ERR_INVALID ? " (--skip-bad skips such lines and counts them)" : "");
        td_chat_record_free(&r);
        return 1;
    }
    c->kinds[r.kind]++;
    td_pack_long rule = o->too_long >= 0 ? (td_pack_long)o->too_long
                                         : r.kind == TD_RECORD_TEXT ? TD_PACK_SPLIT : TD_PACK_DROP;
    st = td_pack_add(pack, ids, counted, n, rule);
    td_free(ids);
    td_free(counted);
    td_chat_record_free(&r);
    if (st) {
        fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
        return 1;
    }
    return 0;
}

static int blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return 0;
    return 1;
}

void td_prepare_records_summary(const td_prepare_records *o, const td_prepare_records_result *c)
{
    char a[32];
    const td_pack_stats *s = &c->pack;
    const uint64_t bytes = c->bytes;
    const double ms = c->ms;
    static const char *const on[] = {"all", "completion", "assistant"};
    printf("wrote %s: %llu rows of %u tokens (%llu tokens, %llu of them padding: %.1f%%), %llu documents, "
           "%llu targets counted (--loss-on %s); %s of JSONL, %.2f s\n", o->output, (unsigned long long)s->rows, o->seq,
           (unsigned long long)s->tokens, (unsigned long long)s->padding,
           s->tokens ? 100.0 * (double)s->padding / (double)s->tokens : 0.0, (unsigned long long)s->documents,
           (unsigned long long)s->targets, on[o->loss_on], td_format_bytes(bytes, a, sizeof a), ms / 1e3);
    printf("records: %llu conversations, %llu prompt/completion, %llu text", (unsigned long long)c->kinds[TD_RECORD_CHAT],
           (unsigned long long)c->kinds[TD_RECORD_PROMPT], (unsigned long long)c->kinds[TD_RECORD_TEXT]);
    if (c->blank) printf(", %llu blank lines", (unsigned long long)c->blank);
    printf("\n");
    if (s->split || s->cut || s->dropped_long)
        printf("longer than --seq %u: %llu split into pieces, %llu cut to their first %u tokens, %llu dropped\n", o->seq,
               (unsigned long long)s->split, (unsigned long long)s->cut, o->seq, (unsigned long long)s->dropped_long);
    if (s->dropped_empty)
        printf("dropped %llu records with no token the loss counts (e.g. no assistant message)\n",
               (unsigned long long)s->dropped_empty);
    for (int k = 1; k < 5; k++)
        if (c->bad[k])
            printf("skipped %llu lines %s (first: %s)\n", (unsigned long long)c->bad[k], BAD_NAMES[k], c->first_bad[k]);
}

int td_prepare_records_run(const td_prepare_records *o, td_tokfile_writer *w, volatile const sig_atomic_t *interrupted,
                           td_prepare_records_result *res)
{
    int rc = 1;
    counts c;
    memset(&c, 0, sizeof c);
    td_pack *pack = NULL;
    char *buf = NULL;
    size_t cap = READ_BYTES, fill = 0;
    uint64_t bytes = 0;
    double t0 = td_now_ms(), last = 0;
    gzFile gz = !strcmp(o->input, "-") ? gzdopen(dup(STDIN_FILENO), "rb") : gzopen(o->input, "rb");
    if (!gz) {
        fprintf(stderr, "tidal prepare: cannot open --input '%s': %s\n", o->input, strerror(errno ? errno : ENOMEM));
        return 1;
    }
    gzbuffer(gz, 256 << 10);
    if (td_pack_create(o->seq, o->pack, &pack) || !(buf = td_malloc(cap, TD_ROLE_META))) {
        fprintf(stderr, "tidal prepare: %s\n", pack ? "out of memory" : td_error_msg());
        goto done;
    }
    int eof = 0;
    while (!eof) {
        if (fill == cap) { /* a line longer than the buffer: grow it */
            char *grown = td_malloc(2 * cap, TD_ROLE_META);
            if (!grown) {
                fprintf(stderr, "tidal prepare: %s:%llu: out of memory for a line of more than %zu bytes\n", o->input,
                        (unsigned long long)c.lines + 1, cap);
                goto done;
            }
            memcpy(grown, buf, fill);
            td_free(buf);
            buf = grown;
            cap *= 2;
        }
        int r = gzread(gz, buf + fill, (unsigned)(cap - fill > (1u << 30) ? 1u << 30 : cap - fill));
        if (r < 0) {
            int e;
            const char *msg = gzerror(gz, &e);
            fprintf(stderr, "tidal prepare: reading '%s' failed: %s\n", o->input,
                    e == Z_ERRNO ? strerror(errno) : msg);
            goto done;
        }
        if (*interrupted) goto done;
        eof = r == 0;
        fill += (size_t)r;
        bytes += (uint64_t)r;
        size_t at = 0;
        for (;;) {
            char *nl = memchr(buf + at, '\n', fill - at);
            if (!nl && !(eof && at < fill)) break;
            size_t end = nl ? (size_t)(nl - buf) : fill;
            c.lines++;
            if (blank(buf + at, end - at)) c.blank++;
            else if (one_line(o, pack, buf + at, end - at, &c)) goto done;
            at = nl ? end + 1 : fill;
        }
        memmove(buf, buf + at, fill - at);
        fill -= at;
        progress(o, bytes, o->input_bytes, &c, t0, &last, 0);
    }
    progress(o, bytes, o->input_bytes, &c, t0, &last, 1);
    if (!td_pack_get_stats(pack)->dropped_empty && !(c.kinds[0] + c.kinds[1] + c.kinds[2])) {
        fprintf(stderr, "tidal prepare: '%s' holds no records; nothing written\n", o->input);
        goto done;
    }
    td_pack_stats s;
    if (td_pack_write(pack, o->shuffle, o->seed, td_tokenizer_eot(o->tok), w, &s)) {
        fprintf(stderr, "tidal prepare: %s\n", td_error_msg());
        goto done;
    }
    if (!s.rows) {
        fprintf(stderr, "tidal prepare: no record of '%s' has a token the loss counts (--loss-on %s); nothing "
                        "written\n", o->input, o->loss_on == TD_LOSS_ALL ? "all" : o->loss_on == TD_LOSS_COMPLETION ?
                        "completion" : "assistant");
        goto done;
    }
    c.pack = s;
    c.bytes = bytes;
    c.ms = td_now_ms() - t0;
    *res = c;
    rc = 0;
done:
    gzclose(gz);
    td_pack_free(pack);
    td_free(buf);
    return rc;
}
