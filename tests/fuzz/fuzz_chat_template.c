/* libFuzzer target: the Jinja interpreter of chat templates (data/jinja_*.c)
 * and the JSONL records on top of it (data/chat.c).
 *
 * The input is a template, optionally followed by a line "\n#---\n" and a
 * JSONL record.  The template is loaded (most mutations are refused with a
 * message naming a line and column) and, when it loads, rendered over a
 * fixed conversation with and without the generation prompt, then over the
 * record's messages when there is one; every render ends in text or a
 * message, never a crash or a hang (the interpreter bounds ranges, output,
 * memory and nesting).  The record is also parsed as `tidal prepare` would,
 * its spans inside its text.  No accounted allocation outlives an input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/chat.h"

static const char CONVERSATION[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"S \\u00e9\"}, {\"role\": \"user\", \"content\": \"Q\"},"
    " {\"role\": \"assistant\", \"content\": \"A\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\":"
    " {\"x\": 1.5}}}]}, {\"role\": \"tool\", \"content\": \"r\"}, {\"role\": \"user\", \"content\": \"\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], \"n\": [1, 2, 3]}";

static const char CONFIG[] = "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const size_t live = td_host_live_allocs();
    const char *text = (const char *)data;
    size_t tlen = size;
    const char *record = NULL;
    size_t rlen = 0;
    for (size_t i = 0; i + 6 <= size; i++)
        if (!memcmp(text + i, "\n#---\n", 6)) {
            tlen = i;
            record = text + i + 6;
            rlen = size - i - 6;
            break;
        }
    td_chat_template *t = NULL;
    if (td_chat_template_create(text, tlen, CONFIG, sizeof CONFIG - 1, "fuzz.jinja", &t) == TD_OK) {
        td_chat_template_set_clock(t, 1736942400);
        for (int gen = 0; gen < 2; gen++) {
            char *out = NULL;
            size_t len = 0;
            if (td_chat_template_render(t, CONVERSATION, sizeof CONVERSATION - 1, gen, &out, &len) == TD_OK) {
                FUZZ_CHECK(out != NULL && out[len] == '\0');
                td_free(out);
            } else {
                FUZZ_CHECK(out == NULL && td_error_msg()[0]);
            }
        }
    } else {
        FUZZ_CHECK(t == NULL && td_error_msg()[0]);
    }
    if (record) {
        static const td_loss_on modes[] = {TD_LOSS_ALL, TD_LOSS_COMPLETION, TD_LOSS_ASSISTANT};
        for (int m = 0; m < 3; m++) {
            td_chat_record r;
            td_record_error why;
            if (td_chat_record_parse(record, rlen, t, modes[m], &r, &why) == TD_OK) {
                FUZZ_CHECK(why == TD_RECORD_OK && r.text != NULL);
                for (size_t k = 0; k < r.n_spans; k++)
                    FUZZ_CHECK(r.spans[2 * k] < r.spans[2 * k + 1] && r.spans[2 * k + 1] <= r.len &&
                               (k == 0 || r.spans[2 * k - 1] < r.spans[2 * k]));
                td_chat_record_free(&r);
            } else {
                FUZZ_CHECK(why != TD_RECORD_OK && td_error_msg()[0]);
            }
        }
    }
    td_chat_template_free(t);
    FUZZ_CHECK(td_host_live_allocs() == live);
    return 0;
}
