/* Chat templates and fine-tuning records: a model's Jinja chat template
 * rendered as transformers renders it, and the JSONL records `tidal
 * prepare` reads turned into text with the byte ranges whose tokens the
 * loss counts, then into tokens with their loss mask.
 *
 * The template is the chat_template of a Hugging Face tokenizer_config.json
 * (or a chat_template.jinja beside it), run by tidal's own interpreter of
 * the Jinja subset chat templates use (data/jinja_*.c; docs/data.md lists
 * what it supports).  Rendering equals transformers'
 * apply_chat_template(..., tokenize=False): jinja2's ImmutableSandboxedEnvironment
 * with trim_blocks and lstrip_blocks, the loopcontrols extension,
 * raise_exception(), strftime_now() and transformers' tojson filter
 * (ensure_ascii off), the template's variables messages, tools (None when
 * the record has none), documents (None), add_generation_prompt and the
 * tokenizer's special tokens (bos_token, eos_token, ...) as
 * tokenizer_config.json names them.  strftime_now reads the clock at load
 * time, or SOURCE_DATE_EPOCH (seconds) when that is set, so one run renders
 * one date.  A construct the interpreter does not implement is an error at
 * load time naming it, its line and column.
 *
 * Records (one JSON object a line):
 *   {"text": "..."}                              the whole text counts
 *   {"prompt": "...", "completion": "..."}       prompt + completion, plain text
 *   {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}
 *                                                rendered with the chat template
 * Roles are system, user, assistant, tool and ipython; content is a string,
 * a list of content parts (passed to the template as they are), or null on
 * an assistant message with tool_calls.  A message's other keys
 * (tool_calls, name, ...) reach the template unchanged; of a record, only
 * messages and tools do (as transformers' apply_chat_template(messages,
 * tools=tools) gets them).
 *
 * What counts (td_loss_on): ALL every token; COMPLETION the completion of a
 * prompt/completion record and the last assistant message of a
 * conversation; ASSISTANT every assistant message (and a completion).  A
 * text record counts whole in every mode.  An assistant message's range is
 * found by rendering the conversation up to it with the generation prompt
 * and up to and with it: what the second adds to the first (the message
 * and the template's end-of-turn marker) counts.
 *
 * Ownership: td_malloc'd results the caller frees (td_chat_record_free,
 * td_free).  Thread-safety: a template is immutable after load; renders may
 * run on several threads at once. */
#ifndef TIDAL_CHAT_H
#define TIDAL_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "tidal/status.h"
#include "tidal/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_chat_template td_chat_template;

/* Loads a chat template from `path`: a tokenizer_config.json (its
 * "chat_template": a string, or a list of {"name", "template"} where the one
 * named "default" is used), a .jinja file (special tokens then from a
 * tokenizer_config.json beside it, if any), or a folder holding
 * chat_template.jinja or tokenizer_config.json.  Errors (TD_ERR_IO,
 * TD_ERR_INVALID) name the file and, for the template, the line, column and
 * construct. */
td_status td_chat_template_load(const char *path, td_chat_template **out);
/* The same from memory: the template source and (NULL or) the text of a
 * tokenizer_config.json for the special tokens; `name` labels messages. */
td_status td_chat_template_create(const char *source, size_t len, const char *config_json, size_t config_len,
                                  const char *name, td_chat_template **out);
void td_chat_template_free(td_chat_template *t); /* NULL is a no-op */

/* The clock strftime_now() reads (seconds since the epoch, local time). */
void td_chat_template_set_clock(td_chat_template *t, int64_t epoch_seconds);
/* A special token's text as tokenizer_config.json gives it ("bos_token",
 * "eos_token", ...), NULL when it has none. */
const char *td_chat_template_token(const td_chat_template *t, const char *name);

/* Renders the template with a JSON object of variables (conversation_json:
 * at least "messages"; "tools" and any others are passed as they are).
 * *text_out is td_malloc'd and NUL-terminated.  A template that calls
 * raise_exception() fails with its message. */
td_status td_chat_template_render(const td_chat_template *t, const char *conversation_json, size_t len,
                                  int add_generation_prompt, char **text_out, size_t *len_out);

typedef enum td_loss_on { TD_LOSS_ALL, TD_LOSS_COMPLETION, TD_LOSS_ASSISTANT } td_loss_on;
/* "all" / "completion" / "assistant"; TD_ERR_INVALID naming the choices otherwise. */
td_status td_loss_on_parse(const char *name, td_loss_on *out);

typedef enum td_record_kind { TD_RECORD_TEXT, TD_RECORD_PROMPT, TD_RECORD_CHAT } td_record_kind;

/* Why a record was refused (td_chat_record_parse's *why). */
typedef enum td_record_error {
    TD_RECORD_OK,
    TD_RECORD_BAD_JSON,      /* the line is not a JSON value */
    TD_RECORD_BAD_FIELDS,    /* not an object with text / prompt and completion / messages of the right types,
                                a message with an unknown role or without content */
    TD_RECORD_TEMPLATE,      /* the template refused it (raise_exception) or failed on it */
    TD_RECORD_NO_TEMPLATE,   /* a conversation, and no chat template to render it with */
} td_record_error;

/* A record as text and the byte ranges of it whose tokens count. */
typedef struct td_chat_record {
    td_record_kind kind;
    char *text;
    size_t len;
    size_t *spans;     /* n_spans [begin, end) pairs, ascending */
    size_t n_spans;
    int framed;        /* text and prompt records: the tokenizer's begin-of-text goes before and end-of-text
                          after (counted with the last span when it reaches the end); a conversation's text
                          is the template's, whole */
} td_chat_record;

/* Parses one JSONL line.  t may be NULL when no record is a conversation
 * (one that is fails naming the missing template).  On failure *why says
 * which kind of problem it is and the message (TD_ERR_INVALID) says what. */
td_status td_chat_record_parse(const char *line, size_t len, const td_chat_template *t, td_loss_on loss_on,
                               td_chat_record *out, td_record_error *why);
void td_chat_record_free(td_chat_record *r);

/* Tokenizes a record: ids and counted (1: the token is a target the loss
 * counts), n of each, td_malloc'd.  A conversation's tokens equal
 * transformers' apply_chat_template(..., tokenize=True); text and prompt
 * records are framed by the tokenizer's begin- and end-of-text tokens.  A
 * token counts when its first byte lies in a span. */
td_status td_chat_record_encode(td_tokenizer *tok, const td_chat_record *r, uint32_t **ids, uint8_t **counted,
                                size_t *n);

#ifdef __cplusplus
}
#endif
#endif
