/* `tidal prepare` on JSONL records (cli_prepare_records.c), called by
 * cli_prepare.c once the tokenizer and the output are open. */
#ifndef TIDAL_CLI_PREPARE_RECORDS_H
#define TIDAL_CLI_PREPARE_RECORDS_H

#include <signal.h>
#include <stdint.h>

#include "tidal/chat.h"
#include "tidal/data.h"
#include "tidal/tokenizer.h"

typedef struct td_prepare_records {
    const char *input, *output;  /* a .jsonl / .jsonl.gz path, or "-" */
    uint64_t input_bytes;        /* for the progress line; 0 unknown */
    td_tokenizer *tok;
    const td_chat_template *chat; /* NULL: no template (a conversation is then an error) */
    td_loss_on loss_on;
    uint32_t seq;                /* the rows' length */
    int pack, shuffle, skip_bad, progress;
    uint64_t seed;
    int too_long;                /* td_pack_long, or -1: split text records, drop the others */
} td_prepare_records;

typedef struct td_prepare_records_result {
    td_pack_stats pack;
    uint64_t lines, blank, kinds[3], bad[5]; /* kinds by td_record_kind, bad by td_record_error */
    char first_bad[5][300];
    uint64_t bytes;
    double ms;
} td_prepare_records_result;

/* Reads, packs and appends the rows to w (not committed).  0, or 1 with the
 * reason on stderr. */
int td_prepare_records_run(const td_prepare_records *o, td_tokfile_writer *w, volatile const sig_atomic_t *interrupted,
                           td_prepare_records_result *res);
void td_prepare_records_summary(const td_prepare_records *o, const td_prepare_records_result *res);

#endif
