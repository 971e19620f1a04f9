/* A Hugging Face config.json as a document to read and write key by key:
 * what a model family's config_read / config_write (family.h) work on, and
 * what checkpoint/ prints into a checkpoint directory.  Reads check the
 * type and range of each value and name the file and the key in their
 * errors; a key that is absent or null counts as absent.  Writes keep the
 * order they were made in (config.json is read by people too).
 *
 * Ownership: td_hf_config_free frees a document and everything in it; a
 * sub-document (td_hf_config_object) belongs to its parent.
 * Thread-safety: one thread per document. */
#ifndef TIDAL_HF_CONFIG_H
#define TIDAL_HF_CONFIG_H

#include <stddef.h>

#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_hf_config td_hf_config;

/* An empty document; `where` names it in error messages (a path). */
td_status td_hf_config_create(const char *where, td_hf_config **out);
/* The JSON object in text[0 .. len); TD_ERR_INVALID when it is not one. */
td_status td_hf_config_parse(const char *text, size_t len, const char *where, td_hf_config **out);
/* The file at path (at most 64 MiB). */
td_status td_hf_config_load(const char *path, td_hf_config **out);
void td_hf_config_free(td_hf_config *c); /* NULL is a no-op */
/* The document as indented JSON, malloc'd (td_free it). */
td_status td_hf_config_print(const td_hf_config *c, char **text);
const char *td_hf_config_where(const td_hf_config *c);

/* --- reading: absent (or null) keys leave *out as it is --- */

/* 1 when the key is there and not null. */
int td_hf_config_has(const td_hf_config *c, const char *key);
/* 1 when the key is there, null included (null may differ from absent:
 * GemmaConfig's pad_token_id is 0 when absent, none when null). */
int td_hf_config_present(const td_hf_config *c, const char *key);
/* A positive integer up to INT32_MAX; required: absent is an error. */
td_status td_hf_config_int(const td_hf_config *c, const char *key, int required, int *out);
/* A positive finite number. */
td_status td_hf_config_float(const td_hf_config *c, const char *key, int required, float *out);
/* Any number (a value tidal compares with one it computes). */
td_status td_hf_config_number(const td_hf_config *c, const char *key, double *out);
td_status td_hf_config_bool(const td_hf_config *c, const char *key, int *out);
/* A string (valid while the document lives). */
td_status td_hf_config_string(const td_hf_config *c, const char *key, int required, const char **out);
/* An object, or *out NULL when absent (valid while the document lives). */
td_status td_hf_config_get_object(const td_hf_config *c, const char *key, const td_hf_config **out);
/* A setting tidal does not implement: absent, null, or this boolean;
 * otherwise an error ending with `why`. */
td_status td_hf_config_must_be(const td_hf_config *c, const char *key, int want, const char *why);
/* A string setting: absent, null, or one of the NULL-terminated `allowed`;
 * otherwise an error ending with `why`. */
td_status td_hf_config_one_of(const td_hf_config *c, const char *key, const char *const *allowed, const char *why);

/* --- writing (a key written twice keeps its first place, the last value) --- */

td_status td_hf_config_set_int(td_hf_config *c, const char *key, long long v);
/* As the shortest decimal that reads back as the same float (1e-05, not 9.99999974738e-06). */
td_status td_hf_config_set_float(td_hf_config *c, const char *key, float v);
td_status td_hf_config_set_number(td_hf_config *c, const char *key, double v);
td_status td_hf_config_set_bool(td_hf_config *c, const char *key, int v);
td_status td_hf_config_set_string(td_hf_config *c, const char *key, const char *v);
td_status td_hf_config_set_null(td_hf_config *c, const char *key);
/* ["v"]: a one-string list (architectures). */
td_status td_hf_config_set_strings1(td_hf_config *c, const char *key, const char *v);
/* A new object under key, to write into. */
td_status td_hf_config_object(td_hf_config *c, const char *key, td_hf_config **out);

#ifdef __cplusplus
}
#endif
#endif
