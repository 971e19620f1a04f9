/* The batch loader: sequences of a token file, shuffled per epoch, in
 * batches of (B, T) inputs and targets (see include/tidal/data.h).
 *
 * The epoch order is a keyed permutation computed on demand rather than a
 * shuffled table: a balanced Feistel network over the smallest even number
 * of bits that covers the split, with cycle walking (re-encrypt until the
 * value falls inside [0, n)).  Any Feistel network is a bijection, so cycle
 * walking yields a permutation of [0, n); with 2^bits < 4n the walk takes
 * under four rounds on average.  It needs no memory, so a resumed run, a
 * trillion-token file and a test all see the same order from (seed, epoch). */
#include <math.h>
#include <string.h>

#include "tidal/alloc.h"
#include "tidal/data.h"

#define FEISTEL_ROUNDS 6

struct td_loader {
    const td_tokfile *file;
    uint32_t rows;    /* the file's row length, 0 for a stream */
    td_tokfile *owned;
    td_loader_params p;
    uint64_t first;   /* index in the file of the split's first sequence */
    uint64_t n;       /* sequences in the split */
    unsigned half_bits;
    uint64_t epoch, index;
    uint64_t fingerprint;
    /* keys of the current epoch's permutation */
    uint64_t keys_epoch;
    uint64_t keys[FEISTEL_ROUNDS];
};

static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull; /* splitmix64's finaliser */
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

td_loader_params td_loader_default_params(void)
{
    return (td_loader_params){.batch = 8, .seq = 64, .seed = 0, .heldout_percent = 0, .split = TD_DATA_TRAIN,
                              .shuffle = 1, .rank = 0, .ranks = 1};
}

static void set_keys(td_loader *l, uint64_t epoch)
{
    uint64_t k = mix64(l->p.seed ^ mix64(epoch + 0x5EED));
    for (int r = 0; r < FEISTEL_ROUNDS; r++) l->keys[r] = k = mix64(k + (uint64_t)r);
    l->keys_epoch = epoch;
}

static uint64_t feistel(const td_loader *l, const uint64_t keys[FEISTEL_ROUNDS], uint64_t x)
{
    const unsigned h = l->half_bits;
    const uint64_t mask = (h >= 64) ? ~0ull : ((1ull << h) - 1);
    uint64_t left = x >> h, right = x & mask;
    for (int r = 0; r < FEISTEL_ROUNDS; r++) {
        uint64_t f = mix64(right ^ keys[r]) & mask;
        uint64_t next = left ^ f;
        left = right;
        right = next;
    }
    return (left << h) | right;
}

static uint64_t permute(const td_loader *l, const uint64_t keys[FEISTEL_ROUNDS], uint64_t i)
{
    if (!l->p.shuffle || l->n < 2) return i;
    uint64_t x = i;
    do x = feistel(l, keys, x);
    while (x >= l->n);
    return x;
}

uint64_t td_loader_sequence_at(const td_loader *l, uint64_t epoch, uint64_t index)
{
    if (epoch == l->keys_epoch) return l->first + permute(l, l->keys, index);
    td_loader tmp = *l; /* other epochs: keys on the side, the loader stays const */
    set_keys(&tmp, epoch);
    return l->first + permute(l, tmp.keys, index);
}

td_status td_loader_create(const td_tokfile *file, const td_loader_params *p, td_loader **out)
{
    *out = NULL;
    const char *name = td_tokfile_name(file);
    const uint64_t tokens = td_tokfile_count(file);
    if (p->batch < 1 || p->seq < 1)
        return td_error_set(TD_ERR_INVALID, "loader for '%s': batch %u and sequence length %u must be >= 1", name,
                            p->batch, p->seq);
    if (!(p->heldout_percent >= 0 && p->heldout_percent < 100))
        return td_error_set(TD_ERR_INVALID, "loader for '%s': held-out share %g%% is outside [0, 100)", name,
                            p->heldout_percent);
    if (p->rank >= (p->ranks ? p->ranks : 1))
        return td_error_set(TD_ERR_INVALID, "loader for '%s': rank %u is not below the %u ranks", name, p->rank,
                            p->ranks ? p->ranks : 1);
    if (p->split != TD_DATA_TRAIN && p->split != TD_DATA_HELDOUT)
        return td_error_set(TD_ERR_INVALID, "loader for '%s': unknown split %d", name, (int)p->split);
    const uint32_t rows = td_tokfile_get_info(file)->row_tokens;
    if (rows && p->seq != rows)
        return td_error_set(TD_ERR_INVALID, "token file '%s' holds packed rows of %u tokens (tidal prepare --seq %u): "
                            "read it with --seq %u, or prepare it again with --seq %u", name, rows, rows, rows, p->seq);
    if (!rows && tokens < (uint64_t)p->seq + 1)
        return td_error_set(TD_ERR_INVALID, "token file '%s' has %llu tokens, too few for one sequence of %u + 1; "
                            "lower the sequence length or use more text", name, (unsigned long long)tokens, p->seq);
    if (rows && tokens == 0) return td_error_set(TD_ERR_INVALID, "token file '%s' holds no rows", name);
    uint64_t total = rows ? tokens / rows : (tokens - 1) / p->seq;
    uint64_t held = 0;
    if (p->heldout_percent > 0) {
        held = (uint64_t)llround((double)total * p->heldout_percent / 100.0);
        if (held < 1) held = 1;
        if (held >= total)
            return td_error_set(TD_ERR_INVALID, "token file '%s' has %llu sequences of %u + 1 tokens: holding out "
                                "%g%% leaves none to train on; use more text or a smaller share", name,
                                (unsigned long long)total, p->seq, p->heldout_percent);
    }
    if (p->split == TD_DATA_HELDOUT && held == 0)
        return td_error_set(TD_ERR_INVALID, "loader for '%s': the held-out split is empty; give a held-out share "
                            "above 0", name);
    td_loader *l = td_calloc(1, sizeof *l, TD_ROLE_META);
    if (!l) return td_error_set(TD_ERR_NOMEM, "out of memory creating a loader for '%s'", name);
    l->file = file;
    l->rows = rows;
    l->p = *p;
    if (l->p.ranks == 0) l->p.ranks = 1;
    l->first = p->split == TD_DATA_TRAIN ? 0 : total - held;
    l->n = p->split == TD_DATA_TRAIN ? total - held : held;
    unsigned bits = 1;
    while (bits < 64 && (1ull << bits) < l->n) bits++;
    l->half_bits = (bits + 1) / 2;
    const td_tokfile_info *info = td_tokfile_get_info(file);
    uint64_t fp = mix64(info->payload_crc32 ^ mix64(info->token_count));
    fp = mix64(fp ^ p->seq);
    fp = mix64(fp ^ p->seed);
    fp = mix64(fp ^ ((uint64_t)p->split << 1 | (uint64_t)(p->shuffle != 0)));
    fp = mix64(fp ^ l->first ^ (l->n << 20));
    l->fingerprint = fp;
    set_keys(l, 0);
    *out = l;
    return TD_OK;
}

td_status td_loader_open(const char *path, const td_loader_params *p, td_loader **out)
{
    td_tokfile *f = NULL;
    *out = NULL;
    td_status st = td_tokfile_open(path, &f);
    if (st != TD_OK) return st;
    st = td_loader_create(f, p, out);
    if (st != TD_OK) {
        td_tokfile_close(f);
        return st;
    }
    (*out)->owned = f;
    return TD_OK;
}

void td_loader_destroy(td_loader *l)
{
    if (!l) return;
    td_tokfile_close(l->owned);
    td_free(l);
}

const td_tokfile *td_loader_file(const td_loader *l) { return l->file; }
uint64_t td_loader_sequences(const td_loader *l) { return l->n; }
uint64_t td_loader_first_sequence(const td_loader *l) { return l->first; }

/* Moves the position k sequences on (other ranks' slices). */
static void skip(td_loader *l, uint64_t k)
{
    l->epoch += k / l->n;
    l->index += k % l->n;
    if (l->index >= l->n) {
        l->index -= l->n;
        l->epoch++;
    }
}

/* Sequence s: its inputs, the targets that count (-1 elsewhere) and each
 * token's position in its document. */
static td_status read_sequence(const td_loader *l, uint64_t s, int32_t *in, int32_t *tg, int32_t *pos)
{
    const uint32_t T = l->p.seq;
    const uint64_t start = s * T;
    const td_tokfile *f = l->file;
    td_status st = td_tokfile_read(f, start, T, in);
    if (st != TD_OK) return st;
    if (!td_tokfile_get_info(f)->has_flags) { /* every target counts, one document */
        memcpy(tg, in + 1, (size_t)(T - 1) * sizeof *tg);
        if (l->rows) tg[T - 1] = -1;
        else if ((st = td_tokfile_read(f, start + T, 1, tg + T - 1)) != TD_OK) return st;
        for (uint32_t i = 0; pos && i < T; i++) pos[i] = (int32_t)i;
        return TD_OK;
    }
    for (uint32_t i = 0; i < T; i++) {
        const uint64_t j = start + i + 1; /* the token input i predicts */
        if (l->rows && i == T - 1) {
            tg[i] = -1;
        } else {
            const unsigned fl = td_tokfile_flags_at(f, j);
            tg[i] = (fl & TD_TOKFLAG_TARGET) && !(fl & TD_TOKFLAG_DOC_START) ? (int32_t)td_tokfile_at(f, j) : -1;
        }
        if (pos) pos[i] = i == 0 || (td_tokfile_flags_at(f, start + i) & TD_TOKFLAG_DOC_START) ? 0 : pos[i - 1] + 1;
    }
    return TD_OK;
}

td_status td_loader_next(td_loader *l, int32_t *inputs, int32_t *targets, int32_t *positions)
{
    const uint32_t T = l->p.seq;
    const uint64_t B = l->p.batch;
    skip(l, (uint64_t)l->p.rank * B);
    for (uint32_t b = 0; b < l->p.batch; b++) {
        if (l->keys_epoch != l->epoch) set_keys(l, l->epoch);
        uint64_t s = l->first + permute(l, l->keys, l->index);
        td_status st = read_sequence(l, s, inputs + (size_t)b * T, targets + (size_t)b * T,
                                     positions ? positions + (size_t)b * T : NULL);
        if (st != TD_OK) return st;
        if (++l->index == l->n) {
            l->index = 0;
            l->epoch++;
        }
    }
    skip(l, (uint64_t)(l->p.ranks - 1 - l->p.rank) * B);
    return TD_OK;
}

void td_loader_tell(const td_loader *l, td_loader_position *pos)
{
    *pos = (td_loader_position){l->epoch, l->index, l->fingerprint};
}

td_status td_loader_seek(td_loader *l, const td_loader_position *pos)
{
    if (pos->fingerprint != l->fingerprint)
        return td_error_set(TD_ERR_INVALID, "the saved data position does not belong to '%s' with sequence length "
                            "%u, seed %llu and this split (fingerprint %016llx, expected %016llx): resume with the "
                            "same --data, --seq and --seed", td_tokfile_name(l->file), l->p.seq,
                            (unsigned long long)l->p.seed, (unsigned long long)pos->fingerprint,
                            (unsigned long long)l->fingerprint);
    if (pos->index >= l->n)
        return td_error_set(TD_ERR_INVALID, "the saved data position (epoch %llu, sequence %llu) is past the %llu "
                            "sequences of '%s'", (unsigned long long)pos->epoch, (unsigned long long)pos->index,
                            (unsigned long long)l->n, td_tokfile_name(l->file));
    l->epoch = pos->epoch;
    l->index = pos->index;
    return TD_OK;
}
