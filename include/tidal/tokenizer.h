/* Tokenizers: text (bytes) to token ids and back.
 *
 * Three kinds:
 *   - byte: one token per byte (ids 0..255) plus the end-of-text token 256;
 *     vocabulary 257.  Needs no files and round-trips any byte string.
 *   - gpt2: GPT-2's byte-level BPE from Hugging Face `vocab.json` +
 *     `merges.txt`: the GPT-2 pre-tokenization pattern (implemented by hand,
 *     no regex engine), the byte-to-unicode alphabet, and merges applied by
 *     rank (lowest rank first, leftmost first on ties: Hugging Face
 *     tokenizers' order).  End of text is vocab.json's "<|endoftext|>" (id
 *     50256 in GPT-2); a vocabulary without it gets it as one id past the
 *     largest.
 *   - json: byte-level BPE from a Hugging Face tokenizer.json (GPT-2,
 *     Llama 3, Qwen2, SmolLM2 and the like): model.vocab and model.merges
 *     ("a b" strings or ["a", "b"] pairs), model.ignore_merges; the
 *     pre-tokenizer (ByteLevel, Split with the GPT-2, Llama 3 or Qwen2
 *     pattern, Digits, or a Sequence of those; each pattern a hand-written
 *     scanner); the NFC normalizer; added tokens (found in the text before
 *     pre-tokenization, leftmost first and longest there, with their lstrip /
 *     rstrip / single_word flags); the begin-of-text token a
 *     TemplateProcessing post-processor puts first (Llama 3).  Ids equal the
 *     `tokenizers` library's encode(text, add_special_tokens=False) on valid
 *     UTF-8.  End of text is the token named <|endoftext|>, <|end_of_text|>,
 *     </s>, <|im_end|> or <eos> (the first present, in that order), else the
 *     one eos_token names in a tokenizer_config.json beside the file, else a
 *     new <|endoftext|> one past the largest id.  docs/data.md has the detail.
 *
 * byte and gpt2 treat the literal text "<|endoftext|>" as the end-of-text
 * token (as transformers' GPT2TokenizerFast does) and decode that token back
 * to the same literal; json treats the literal text of each of its added
 * tokens so.  decode(encode(x)) == x for every byte string x (json: unless
 * NFC changes x or an added token strips the whitespace beside it).  Bytes
 * that are not valid UTF-8 are encoded like any other bytes; the
 * pre-tokenizer takes each such byte as one "other" character.
 *
 * Ownership: a td_tokenizer owns its tables (td_malloc, TD_ROLE_META) and
 * copies what it needs from the inputs.  td_tokenizer_decode returns a
 * td_malloc'd buffer the caller frees with td_free; td_tokenizer_token_bytes
 * points into the tokenizer and lives as long as it does.
 * Thread-safety: encoding uses per-tokenizer scratch and a cache, so one
 * tokenizer must not encode from two threads at once; the const calls
 * (decode, token bytes, sizes) may run concurrently. */
#ifndef TIDAL_TOKENIZER_H
#define TIDAL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_TOKEN_EOT_TEXT "<|endoftext|>"
#define TD_TOKENIZER_MAX_VOCAB (1u << 24) /* larger ids in vocab.json are refused */
#define TD_TOKEN_NONE UINT32_MAX          /* no such token (td_tokenizer_bos) */

typedef enum td_tokenizer_kind {
    TD_TOKENIZER_BYTE = 1,
    TD_TOKENIZER_GPT2 = 2,
    TD_TOKENIZER_JSON = 3,
} td_tokenizer_kind;

/* "byte" / "gpt2" / "json"; "?" for anything else. */
const char *td_tokenizer_kind_name(td_tokenizer_kind kind);
/* Parses "byte" or "gpt2" (TD_ERR_INVALID naming the choices otherwise; a
 * json tokenizer is named by its file, see td_tokenizer_json_path). */
td_status td_tokenizer_kind_parse(const char *name, td_tokenizer_kind *out);

typedef struct td_tokenizer td_tokenizer;

td_status td_tokenizer_create_byte(td_tokenizer **out);
/* Loads a GPT-2 BPE from files.  Errors (TD_ERR_IO for unreadable files,
 * TD_ERR_INVALID for bad content) name the file, the line of merges.txt and
 * what is wrong: not a JSON object of token -> id, an id out of range or used
 * twice, a token outside GPT-2's byte alphabet, a missing single-byte token,
 * a merge line that is not "A B", a merge whose parts or result are not in
 * the vocabulary. */
td_status td_tokenizer_load_gpt2(const char *vocab_path, const char *merges_path, td_tokenizer **out);
/* The same from memory; the names only label error messages. */
td_status td_tokenizer_create_gpt2(const char *vocab_json, size_t vocab_len, const char *vocab_name,
                                   const char *merges, size_t merges_len, const char *merges_name,
                                   td_tokenizer **out);
/* Loads a tokenizer.json (`path` is the file, or a folder holding one).
 * Errors (TD_ERR_IO unreadable, TD_ERR_INVALID bad content) name the file and
 * the JSON field: not JSON, a missing or wrong-typed field, a model type
 * other than "BPE", a pre-tokenizer, pattern, normalizer or decoder this
 * reader does not implement (named, with the supported ones), the vocab.json
 * errors above, a merge that is neither "A B" nor a pair of strings, a merge
 * naming a token not in model.vocab, an added token without id or content. */
td_status td_tokenizer_load_json(const char *path, td_tokenizer **out);
/* The same from memory; `name` labels error messages and `config_json`
 * (NULL or tokenizer_config.json's text) may name the eos token. */
td_status td_tokenizer_create_json(const char *json, size_t len, const char *name, const char *config_json,
                                   size_t config_len, td_tokenizer **out);
/* 1 when `path` names a tokenizer.json: a path ending in ".json" or a folder
 * holding tokenizer.json.  Writes the file's path into buf (when not NULL). */
int td_tokenizer_json_path(const char *path, char *buf, size_t buf_bytes);
void td_tokenizer_destroy(td_tokenizer *t); /* NULL is a no-op */

td_tokenizer_kind td_tokenizer_kind_of(const td_tokenizer *t);
/* One past the largest id (ids below it may be unused in a gpt2 vocabulary). */
uint32_t td_tokenizer_vocab_size(const td_tokenizer *t);
uint32_t td_tokenizer_eot(const td_tokenizer *t);
/* The token a document starts with (json with a TemplateProcessing that puts
 * one before $A, e.g. Llama 3's <|begin_of_text|>), else TD_TOKEN_NONE.
 * Encoding never adds it: callers put it before each document. */
uint32_t td_tokenizer_bos(const td_tokenizer *t);
size_t td_tokenizer_merge_count(const td_tokenizer *t); /* 0 for byte */

/* Receives ids in order, in pieces of any size; a non-OK return stops the
 * encoding and is returned by it. */
typedef td_status (*td_token_sink)(void *ctx, const uint32_t *ids, size_t n);

/* Encodes the complete text `text[0, len)`. */
td_status td_tokenizer_encode(td_tokenizer *t, const char *text, size_t len, td_token_sink sink, void *ctx);
/* The same into a td_malloc'd array (*ids_out NULL when *n_out is 0). */
td_status td_tokenizer_encode_alloc(td_tokenizer *t, const char *text, size_t len, uint32_t **ids_out,
                                    size_t *n_out);
/* For streaming a long text in blocks: the largest p <= len such that, for
 * every continuation c, encode(text[0,p)) followed by encode(text[p,len) + c)
 * equals encode(text[0,len) + c), for both kinds; 0 if the block has no
 * such point.  It is a single whitespace character between two
 * non-whitespace characters (the pre-tokenizer never joins across it, and
 * the end-of-text literal contains no whitespace). */
size_t td_tokenizer_split_point(const char *text, size_t len);
/* The same promise for tokenizer t, any kind: for json the cut also avoids a
 * newline after punctuation (the Llama 3 / Qwen2 patterns keep "[\r\n]*"
 * with it) and any place an added token containing whitespace could cover;
 * with no pre-tokenizer pattern at all there is no such point (0). */
size_t td_tokenizer_cut_point(const td_tokenizer *t, const char *text, size_t len);

/* The bytes of token `id` (the literal "<|endoftext|>" for end of text),
 * or NULL when `id` is not a token of this vocabulary. */
const char *td_tokenizer_token_bytes(const td_tokenizer *t, uint32_t id, size_t *len_out);
/* Concatenates the tokens' bytes into a td_malloc'd, NUL-terminated buffer
 * (*len_out excludes the NUL).  TD_ERR_INVALID naming the position of the
 * first id that is not a token. */
td_status td_tokenizer_decode(const td_tokenizer *t, const uint32_t *ids, size_t n, char **text_out,
                              size_t *len_out);

/* The GPT-2 pre-tokenizer on its own: calls fn for each piece of `text`, in
 * order; the pieces concatenate to the text.  The pattern is
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with Unicode 14 letters, numbers and White_Space. */
typedef void (*td_piece_fn)(void *ctx, const char *piece, size_t len);
void td_gpt2_pretokenize(const char *text, size_t len, td_piece_fn fn, void *ctx);
/* The pre-tokenizer of t (every stage of a json Sequence; byte: one piece a
 * byte) on its own, the same way; added tokens are not looked for. */
void td_tokenizer_pretokenize(const td_tokenizer *t, const char *text, size_t len, td_piece_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
