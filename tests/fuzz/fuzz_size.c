/* libFuzzer target: byte sizes as users write them ("24GiB", "512MiB",
 * "4096", "1.5 GB"): td_parse_bytes (core/util.c), behind --gpu-budget,
 * --host-pin-limit, `tidal memsim --budget` and the SIZE options of a
 * --config file.
 *
 * The input is the text (cut at its first NUL, as a C string is).  An
 * accepted size must be a whole number of bytes that reads back the same
 * when printed in plain decimal, and td_format_bytes must describe it
 * without overrunning a small buffer. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tidal/util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    size_t bytes = 0;
    if (td_parse_bytes(text, &bytes) == TD_OK) {
        char plain[32], again_text[64];
        snprintf(plain, sizeof plain, "%zu", bytes);
        size_t again = 0;
        FUZZ_CHECK(td_parse_bytes(plain, &again) == TD_OK && again == bytes);
        snprintf(again_text, sizeof again_text, " %s B", plain); /* leading spaces and a unit are allowed */
        FUZZ_CHECK(td_parse_bytes(again_text, &again) == TD_OK && again == bytes);
        char small[12];
        td_format_bytes(bytes, small, sizeof small);
        FUZZ_CHECK(strlen(small) < sizeof small);
    } else {
        FUZZ_CHECK(td_error_msg()[0]);
    }
    free(text);
    return 0;
}
