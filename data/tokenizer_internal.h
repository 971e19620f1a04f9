/* Internals shared by the tokenizer sources; not a public header.
 *
 *   data/tokenizer.c       the tokenizer object, byte and GPT-2 (vocab.json +
 *                          merges.txt) loading, the GPT-2 pre-tokenizer, BPE,
 *                          encoding, decoding;
 *   data/tokenizer_json.c  Hugging Face tokenizer.json: its reader, the
 *                          Llama 3 / Qwen2 pre-tokenizers, added tokens.
 *
 * Both kinds of BPE fill the same struct td_tokenizer, so encoding and
 * decoding are one code path; tokenizer.json adds what vocab.json +
 * merges.txt cannot say (pre-tokenizer stages, added tokens, bos,
 * ignore_merges) in the fields below the BPE ones. */
#ifndef TD_TOKENIZER_INTERNAL_H
#define TD_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "tidal/tokenizer.h"

#define TD_TOK_EOT_LEN (sizeof(TD_TOKEN_EOT_TEXT) - 1)
#define TD_TOK_OUT_CAP 4096
#define TD_TOK_CP_INVALID 0xFFFFFFFFu
#define TD_TOK_MAX_STAGES 4 /* pre-tokenizer passes, each splitting the pieces of the one before */

/* Character classes of the pre-tokenizer patterns: \p{L}, \p{N}, \s
 * (White_Space) and everything else (invalid UTF-8 bytes included). */
enum { TD_TOK_LETTER, TD_TOK_NUMBER, TD_TOK_SPACE, TD_TOK_OTHER };

/* One pre-tokenizer pattern: the end of the piece that starts at i (< len). */
typedef size_t (*td_tok_pretok_fn)(const unsigned char *s, size_t len, size_t i);

typedef struct td_tok_merge_slot {
    uint64_t key; /* (left << 32) | right; TD_TOK_MERGE_EMPTY when free */
    uint32_t rank, id;
} td_tok_merge_slot;
#define TD_TOK_MERGE_EMPTY UINT64_MAX

typedef struct td_tok_cache_slot {
    uint64_t hash;
    uint32_t key_off, ids_off;
    uint16_t key_len, n_ids; /* key_len 0: free */
} td_tok_cache_slot;

typedef struct td_tok_symbol {
    uint32_t id;
    int32_t prev, next;
    uint32_t alive;
} td_tok_symbol;

typedef struct td_tok_heap_item {
    uint32_t rank, pos, new_id;
} td_tok_heap_item;

struct td_tok_json; /* tokenizer.json's added tokens (data/tokenizer_json.c) */

struct td_tokenizer {
    td_tokenizer_kind kind;
    uint32_t vocab_size, eot, bos; /* bos TD_TOKEN_NONE when there is none */
    uint32_t byte_id[256];
    char bytes[256]; /* byte kind: token b is bytes[b] */
    /* BPE: the bytes of token i are pool[tok_off[i], +tok_len[i]); len 0 = no token */
    char *pool;
    uint32_t *tok_off, *tok_len;
    /* token bytes -> id (open addressing, id + 1 per slot, 0 free) */
    uint32_t *vocab_slots;
    size_t vocab_cap;
    td_tok_merge_slot *merges;
    size_t merge_cap, merge_lines;
    /* pre-tokenization: each stage splits the pieces of the one before */
    td_tok_pretok_fn pretok[TD_TOK_MAX_STAGES];
    int n_pretok;
    int ignore_merges; /* a piece that is itself a token is that token, unmerged */
    struct td_tok_json *json;
    /* BPE scratch, grown to the longest piece seen */
    td_tok_symbol *syms;
    td_tok_heap_item *heap;
    size_t scratch_cap;
    /* piece cache */
    td_tok_cache_slot *cache;
    char *cache_keys;
    uint32_t *cache_ids;
    size_t cache_entries, cache_key_used, cache_ids_used;
    /* output buffering */
    uint32_t out[TD_TOK_OUT_CAP];
    size_t n_out;
    td_token_sink sink;
    void *sink_ctx;
    td_status sink_status;
};

/* ---- output (inline: once per token) ---- */

static inline void td_tok_flush(td_tokenizer *t)
{
    if (t->n_out && t->sink_status == TD_OK) t->sink_status = t->sink(t->sink_ctx, t->out, t->n_out);
    t->n_out = 0;
}

static inline void td_tok_emit(td_tokenizer *t, uint32_t id)
{
    t->out[t->n_out++] = id;
    if (t->n_out == TD_TOK_OUT_CAP) td_tok_flush(t);
}

/* ---- shared helpers (data/tokenizer.c) ---- */

uint64_t td_tok_hash(const void *p, size_t n);
/* A whole file into a td_malloc'd, NUL-terminated buffer; `what` names it in errors. */
td_status td_tok_read_file(const char *path, const char *what, char **buf_out, size_t *len_out);
/* The code point at s[i] and its byte length; TD_TOK_CP_INVALID of length 1
 * for a byte that does not start a valid UTF-8 sequence. */
uint32_t td_tok_utf8_at(const unsigned char *s, size_t len, size_t i, size_t *n_out);
int td_tok_class(uint32_t cp);
/* \w of the Rust regex crate (what tokenizers' single_word looks at). */
int td_tok_is_word(uint32_t cp);
/* The class of the code point at s[i] (and its length). */
int td_tok_class_at(const unsigned char *s, size_t len, size_t i, size_t *n_out);
/* The GPT-2 pattern (include/tidal/tokenizer.h). */
size_t td_tok_pretok_gpt2(const unsigned char *s, size_t len, size_t i);

/* GPT-2's byte-to-unicode alphabet (to_cp: byte -> code point, from_cp:
 * code point -> byte or -1), and an alphabet string to its bytes (-1 with
 * *bad the offending code point). */
void td_tok_byte_alphabet(uint32_t to_cp[256], int16_t from_cp[324]);
long td_tok_alphabet_to_bytes(const int16_t from_cp[324], const char *str, size_t len, char *out, uint32_t *bad);
const char *td_tok_describe_cp(uint32_t cp, char buf[32]);

/* Fills t's vocabulary from a JSON object of alphabet token -> id (vocab.json,
 * or tokenizer.json's model.vocab).  Room is left for `extra_ids` more ids
 * past the largest and `extra_bytes` more pool bytes; t->vocab_size is one
 * past the largest id of the object.  `what` starts every error message
 * (e.g. "vocab.json 'path'"). */
td_status td_tok_vocab_load(td_tokenizer *t, const cJSON *obj, size_t extra_ids, size_t extra_bytes,
                            const char *what);
/* The id of the token with these bytes, UINT32_MAX when none. */
uint32_t td_tok_vocab_find(const td_tokenizer *t, const char *b, size_t n);

/* Merges: room for `count` of them, then each pair in rank order. */
td_status td_tok_merges_alloc(td_tokenizer *t, size_t count, const char *what);
typedef enum td_tok_merge_result {
    TD_TOK_MERGE_OK,
    TD_TOK_MERGE_BAD_CHAR,   /* a character outside the alphabet (*bad) */
    TD_TOK_MERGE_NO_LEFT,    /* the left part is not a token */
    TD_TOK_MERGE_NO_RIGHT,   /* the right part is not a token */
    TD_TOK_MERGE_NO_RESULT,  /* the merged token is not in the vocabulary */
} td_tok_merge_result;
/* Adds the merge of alphabet strings a and b with the next rank; scratch has
 * room for na + nb bytes. */
td_tok_merge_result td_tok_merge_add(td_tokenizer *t, const int16_t from_cp[324], const char *a, size_t na,
                                     const char *b, size_t nb, char *scratch, uint32_t *bad);

/* Pre-tokenizes s[0, len) through t's stages and BPE-encodes each piece. */
td_status td_tok_encode_plain(td_tokenizer *t, const unsigned char *s, size_t len);

/* ---- NFC (data/tokenizer_nfc.c) ---- */

/* Buffers td_tok_nfc grows and reuses (owned by the tokenizer). */
typedef struct td_tok_nfc_buf {
    uint32_t *cps;
    size_t cps_cap;
    char *text;
    size_t text_cap;
} td_tok_nfc_buf;
/* 1 when s[0, len) is NFC for certain (no code point that NFC could change). */
int td_tok_nfc_quick(const unsigned char *s, size_t len);
/* NFC of s[0, len) into b->text (*out, *out_len); invalid UTF-8 bytes are kept. */
td_status td_tok_nfc(const unsigned char *s, size_t len, td_tok_nfc_buf *b, const char **out, size_t *out_len);
void td_tok_nfc_buf_free(td_tok_nfc_buf *b);

/* ---- tokenizer.json (data/tokenizer_json.c) ---- */

/* Encodes a whole text: added tokens first, then td_tok_encode_plain between them. */
td_status td_tok_json_encode(td_tokenizer *t, const unsigned char *s, size_t len);
/* 1 when no added token could cover the cut at p (so cutting there is safe). */
int td_tok_json_cut_ok(const td_tokenizer *t, const unsigned char *s, size_t len, size_t p);
void td_tok_json_free(struct td_tok_json *j);

#endif
