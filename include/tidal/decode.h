/* Generation with a key/value cache: a model's forward one token at a time
 * on the CPU, each step attending over the keys and values the earlier
 * steps kept, so a token costs one position's work (the weights once, the
 * attention over the positions so far) where a forward over the whole
 * window costs the window's.  The same arithmetic as the reference model's
 * forward (model_ref.h) at each position, up to the order of float sums.
 *
 * The decoder reads the weights from a flat fp32 buffer in the layout of
 * td_model_tensor_get (the caller's, kept until destroy); it owns its cache
 * of n_layer x max_positions x 2 x (key/value heads x head size) floats.
 * Thread-safety: one thread drives a decoder (its ops use OpenMP inside). */
#ifndef TIDAL_DECODE_H
#define TIDAL_DECODE_H

#include <stddef.h>

#include "tidal/model_ref.h"
#include "tidal/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_decoder td_decoder;

/* max_positions: the longest sequence it will hold (at most the model's
 * n_positions).  TD_ERR_NOMEM names the bytes the cache needs. */
td_status td_decoder_create(const td_model_desc *cfg, const float *params, int max_positions, td_decoder **out);
void td_decoder_destroy(td_decoder *d); /* NULL is a no-op */

/* Bytes the cache and scratch of a decoder for cfg and max_positions take. */
size_t td_decoder_bytes(const td_model_desc *cfg, int max_positions);

/* Feeds `token` at the next position (0 first) and writes the logits of
 * what follows it into logits (vocab_size floats).  TD_ERR_INVALID for a
 * token outside the vocabulary or a full cache (td_decoder_position ==
 * max_positions: reset it, or feed a shorter context). */
td_status td_decoder_step(td_decoder *d, int token, float *logits);
/* Positions fed so far; reset forgets them all. */
int td_decoder_position(const td_decoder *d);
void td_decoder_reset(td_decoder *d);

#ifdef __cplusplus
}
#endif
#endif
