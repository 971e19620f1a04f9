/* The chunk manager's timeline: Chrome trace JSON of loads, write-backs,
 * evictions, arena use and compute ranges (see td_memmgr_timeline_open).
 *
 * Every record holds indices into a fixed pool of backend events recorded in
 * the stream order of what they mark; at a step's end the pool is
 * synchronised, converted to microseconds from the step's base event, written
 * and reset.  A step that needs more events than the pool holds drops the
 * rest and says how many in the file.  Each record is one JSON object made
 * with cJSON (names are escaped), written as soon as it is known. */
#include "memmgr_impl.h"
#include "tidal/util.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define TL_EVENTS 4096

/* A trace event: name, phase, thread and time (microseconds; NAN for none,
 * as metadata has; a host span that began before the timeline opened has a
 * negative time); cat, dur (ph "X") and args are added by the caller. */
static cJSON *event(const char *name, const char *ph, int tid, double ts_us)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "name", name);
    cJSON_AddStringToObject(e, "ph", ph);
    cJSON_AddNumberToObject(e, "pid", 0);
    if (tid >= 0) cJSON_AddNumberToObject(e, "tid", tid);
    if (!isnan(ts_us)) cJSON_AddNumberToObject(e, "ts", ts_us);
    return e;
}

/* A track's name (metadata event). */
static cJSON *thread_name(int tid, const char *name)
{
    cJSON *e = event("thread_name", "M", tid, NAN);
    cJSON_AddItemToObject(e, "args", cJSON_CreateObject());
    cJSON_AddStringToObject(cJSON_GetObjectItem(e, "args"), "name", name);
    return e;
}

/* Writes an event after the ones before it (`first`: no comma) and frees it. */
static void put_event(FILE *f, cJSON *e, int first)
{
    char *text = cJSON_PrintUnformatted(e);
    cJSON_Delete(e);
    if (text) fprintf(f, "%s%s", first ? "" : ",\n", text);
    cJSON_free(text);
}

td_status td_memmgr_timeline_open(td_memmgr *m, const char *path)
{
    td_status st = TD_OK;
    if (m->tl) return td_error_set(TD_ERR_STATE, "memmgr: a timeline is already open");
    mm_timeline *tl = td_calloc(1, sizeof *tl, TD_ROLE_META);
    if (!tl) return TD_ERR_NOMEM;
    tl->events = td_calloc(TL_EVENTS, sizeof *tl->events, TD_ROLE_META);
    tl->cap_recs = TL_EVENTS;
    tl->recs = td_malloc((size_t)tl->cap_recs * sizeof *tl->recs, TD_ROLE_META);
    if (!tl->events || !tl->recs) { st = TD_ERR_NOMEM; goto cleanup; }
    for (; tl->n_events < TL_EVENTS; tl->n_events++) TD_TRY(td_event_create(m->backend, &tl->events[tl->n_events]));
    tl->f = fopen(path, "w");
    if (!tl->f) TD_FAIL(TD_ERR_IO, "cannot write the timeline '%s': %s", path, strerror(errno));
    fprintf(tl->f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    char process[160];
    snprintf(process, sizeof process, "tidal %s", td_backend_describe(m->backend));
    cJSON *p = event("process_name", "M", -1, NAN);
    cJSON_AddItemToObject(p, "args", cJSON_CreateObject());
    cJSON_AddStringToObject(cJSON_GetObjectItem(p, "args"), "name", process);
    put_event(tl->f, p, 1);
    static const char *const tracks[] = {"compute", "H2D", "D2H"};
    for (int t = 0; t < 3; t++) put_event(tl->f, thread_name(t, tracks[t]), 0);
    tl->base = -1;
    tl->t0_ms = td_now_ms();
    m->tl = tl;
    return TD_OK;
cleanup:
    for (int i = 0; i < tl->n_events; i++) td_event_free(m->backend, tl->events[i]);
    td_free(tl->events);
    td_free(tl->recs);
    td_free(tl);
    return st;
}

static int take_event(mm_timeline *tl)
{
    if (tl->used >= tl->n_events) {
        tl->dropped++;
        return -1;
    }
    return tl->used++;
}

static mm_tl_rec *add_rec(mm_timeline *tl)
{
    if (tl->n_recs >= tl->cap_recs) {
        tl->dropped++;
        return NULL;
    }
    return &tl->recs[tl->n_recs++];
}

void mm_tl_copy_events(td_memmgr *m, td_event **start, td_event **end, int *index)
{
    *start = *end = NULL;
    *index = -1;
    mm_timeline *tl = m->tl;
    if (!tl || tl->base < 0 || tl->used + 2 > tl->n_events) return;
    *index = tl->used;
    *start = tl->events[tl->used++];
    *end = tl->events[tl->used++];
}

void mm_tl_copy(td_memmgr *m, mm_tl_kind kind, int chunk, int index)
{
    if (!m->tl || index < 0) return;
    mm_tl_rec *r = add_rec(m->tl);
    if (r) *r = (mm_tl_rec){ .kind = kind, .chunk = chunk, .ev0 = index, .ev1 = index + 1 };
}

/* An instant on the compute queue (an eviction, the arena's use). */
void mm_tl_instant(td_memmgr *m, mm_tl_kind kind, int chunk, double value)
{
    mm_timeline *tl = m->tl;
    if (!tl || tl->base < 0) return;
    int e = take_event(tl);
    if (e < 0) return;
    mm_tl_rec *r = add_rec(tl);
    if (!r || td_event_record(m->backend, tl->events[e], TD_QUEUE_COMPUTE) != TD_OK) return;
    *r = (mm_tl_rec){ .kind = kind, .chunk = chunk, .ev0 = e, .ev1 = -1, .value = value };
}

td_status td_memmgr_timeline_range(td_memmgr *m, const char *name, int begin)
{
    mm_timeline *tl = m->tl;
    if (!tl || tl->base < 0) return TD_OK;
    if (!begin) {
        if (tl->n_open == 0) return td_error_set(TD_ERR_STATE, "timeline: range end without a begin");
        int ri = tl->open_ranges[--tl->n_open];
        int e = take_event(tl);
        if (ri < 0 || e < 0) return TD_OK;
        tl->recs[ri].ev1 = e;
        return td_event_record(m->backend, tl->events[e], TD_QUEUE_COMPUTE);
    }
    if (tl->n_open == (int)(sizeof tl->open_ranges / sizeof tl->open_ranges[0]))
        return td_error_set(TD_ERR_STATE, "timeline: ranges nested deeper than %d", tl->n_open);
    int e = take_event(tl);
    mm_tl_rec *r = e >= 0 ? add_rec(tl) : NULL;
    tl->open_ranges[tl->n_open++] = r ? (int)(r - tl->recs) : -1;
    if (!r) return TD_OK;
    *r = (mm_tl_rec){ .kind = MM_TL_RANGE, .chunk = -1, .ev0 = e, .ev1 = -1 };
    snprintf(r->name, sizeof r->name, "%s", name ? name : "compute");
    return td_event_record(m->backend, tl->events[e], TD_QUEUE_COMPUTE);
}

td_status td_memmgr_timeline_host(td_memmgr *m, const char *track, double t0_ms, double t1_ms, const char *name, ...)
{
    mm_timeline *tl = m->tl;
    if (!tl) return TD_OK;
    char text[64];
    va_list ap;
    va_start(ap, name);
    vsnprintf(text, sizeof text, name, ap);
    va_end(ap);
    int tid = 0;
    while (tid < tl->n_host_tracks && strcmp(tl->host_tracks[tid], track)) tid++;
    if (tid == tl->n_host_tracks) {
        if (tid == TD_TIMELINE_HOST_TRACKS)
            return td_error_set(TD_ERR_INVALID, "timeline: more than %d host tracks ('%s')", TD_TIMELINE_HOST_TRACKS,
                                track);
        snprintf(tl->host_tracks[tid], sizeof tl->host_tracks[tid], "%s", track);
        tl->n_host_tracks++;
        put_event(tl->f, thread_name(3 + tid, tl->host_tracks[tid]), 0);
    }
    cJSON *e = event(text, "X", 3 + tid, (t0_ms - tl->t0_ms) * 1e3);
    cJSON_AddStringToObject(e, "cat", "host");
    cJSON_AddNumberToObject(e, "dur", t1_ms > t0_ms ? (t1_ms - t0_ms) * 1e3 : 0);
    put_event(tl->f, e, 0);
    return TD_OK;
}

td_status mm_tl_step_begin(td_memmgr *m)
{
    mm_timeline *tl = m->tl;
    if (!tl) return TD_OK;
    tl->used = 0;
    tl->n_recs = 0;
    tl->n_open = 0;
    tl->step_offset_ms = td_now_ms() - tl->t0_ms;
    tl->base = take_event(tl);
    return td_event_record(m->backend, tl->events[tl->base], TD_QUEUE_COMPUTE);
}

static td_status elapsed_us(td_memmgr *m, int base, int e, double *us)
{
    td_status st = td_event_sync(m->backend, m->tl->events[e]);
    if (st) return st;
    float ms = 0;
    st = td_event_elapsed_ms(m->backend, m->tl->events[base], m->tl->events[e], &ms);
    *us = (m->tl->step_offset_ms + ms) * 1e3;
    return st;
}

td_status mm_tl_step_end(td_memmgr *m)
{
    mm_timeline *tl = m->tl;
    if (!tl || tl->base < 0) return TD_OK;
    td_status st = td_event_sync(m->backend, tl->events[tl->base]);
    if (st) return st;
    for (int i = 0; i < tl->n_recs; i++) {
        mm_tl_rec *r = &tl->recs[i];
        double t0, t1 = 0;
        if ((st = elapsed_us(m, tl->base, r->ev0, &t0))) return st;
        if (r->ev1 >= 0 && (st = elapsed_us(m, tl->base, r->ev1, &t1))) return st;
        char name[96];
        cJSON *e = NULL, *args = cJSON_CreateObject();
        switch (r->kind) {
        case MM_TL_LOAD:
        case MM_TL_WRITEBACK: {
            const mm_chunk *ch = &m->chunks[r->chunk];
            snprintf(name, sizeof name, "%s chunk %d", r->kind == MM_TL_LOAD ? "load" : "writeback", r->chunk);
            e = event(name, "X", r->kind == MM_TL_LOAD ? 1 : 2, t0);
            cJSON_AddStringToObject(e, "cat", "copy");
            cJSON_AddNumberToObject(e, "dur", t1 > t0 ? t1 - t0 : 0);
            cJSON_AddNumberToObject(args, "chunk", r->chunk);
            cJSON_AddStringToObject(args, "role", td_tensor_role_name(ch->role));
            cJSON_AddNumberToObject(args, "bytes", (double)ch->bytes);
            cJSON_AddNumberToObject(args, "step", (double)m->step);
            break;
        }
        case MM_TL_RANGE:
            if (r->ev1 < 0) break; /* never closed */
            e = event(r->name, "X", 0, t0);
            cJSON_AddStringToObject(e, "cat", "compute");
            cJSON_AddNumberToObject(e, "dur", t1 > t0 ? t1 - t0 : 0);
            break;
        case MM_TL_EVICT:
            snprintf(name, sizeof name, "evict chunk %d", r->chunk);
            e = event(name, "i", 0, t0);
            cJSON_AddStringToObject(e, "cat", "chunk");
            cJSON_AddStringToObject(e, "s", "p");
            cJSON_AddNumberToObject(args, "chunk", r->chunk);
            break;
        case MM_TL_MEMORY:
            e = event("device arena", "C", -1, t0);
            cJSON_AddNumberToObject(args, "used_bytes", r->value);
            break;
        }
        if (e && cJSON_GetArraySize(args)) cJSON_AddItemToObject(e, "args", args);
        else cJSON_Delete(args);
        if (e) put_event(tl->f, e, 0);
    }
    if (tl->dropped) {
        char name[128];
        snprintf(name, sizeof name, "timeline: %llu records dropped this step (pool of %d events)",
                 (unsigned long long)tl->dropped, tl->n_events);
        cJSON *e = event(name, "i", 0, tl->step_offset_ms * 1e3);
        cJSON_AddStringToObject(e, "s", "g");
        put_event(tl->f, e, 0);
    }
    tl->dropped = 0;
    tl->base = -1;
    if (fflush(tl->f) != 0) return td_error_set(TD_ERR_IO, "writing the timeline: %s", strerror(errno));
    return TD_OK;
}

void mm_tl_close(td_memmgr *m)
{
    mm_timeline *tl = m->tl;
    if (!tl) return;
    if (tl->base >= 0) mm_tl_step_end(m);
    fprintf(tl->f, "\n]}\n");
    fclose(tl->f);
    for (int i = 0; i < tl->n_events; i++) td_event_free(m->backend, tl->events[i]);
    td_free(tl->events);
    td_free(tl->recs);
    td_free(tl);
    m->tl = NULL;
}
