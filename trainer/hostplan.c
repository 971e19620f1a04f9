/* The host side of a run: where each byte lives, planned exactly, and the
 * footprint measured.
 *
 * Pinned: what the copy engine moves.  The trainer pins, in this order, the
 * host copy of every chunk that is not pageable (params, grads, and
 * optimizer state homed on the device), then its four staging buffers; the
 * pinned pool places them in slabs.  The plan replays that sequence on a
 * planning pool (hostpool.h: same placement code, nothing mapped), so
 * host.pinned_bytes is the slab total the run will pin, to the byte.
 * Pageable: the optimizer state homed on the host (td_hostmem, page-rounded
 * mappings), and the heap: metadata, the loader, the CPU AdamW team, the
 * libraries (an allowance, checked against jemalloc's measurement by the
 * tests), and on the cpu backend the "device" region, which is host memory.
 * One set of rules for the trainer (train.c) and `tidal plan` (plan.c). */
#include "train_impl.h"

#include <cjson/cJSON.h>
#include "tidal/hostmem.h"
#include "tidal/hostpool.h"
#include "tidal/util.h"

#include <omp.h>
#include <stdio.h>
#include <string.h>

/* The heap the process takes beside the model state: the libraries (hwloc's
 * topology, OpenMP, jemalloc's own metadata, the CUDA runtime's host side),
 * the loader and the CLI, plus per tensor and chunk the manager's
 * bookkeeping and the warm-up trace (a few hundred bytes each). */
#define HEAP_BASE_BYTES (48 * TD_MiB)
/* On CUDA also the runtime's and the libraries' host side (cuBLAS(Lt)
 * handles, module images, the driver's bookkeeping).  It grows with the
 * kernels a run loads: at W6's shape (GPT-2 1.5B, B16, 8 GiB, H100, CUDA
 * 13) jemalloc measured a heap of 744.7 MiB at its peak, 183 MiB over a
 * 512 MiB allowance, so the allowance is that peak rounded up. */
#define HEAP_CUDA_BYTES (768 * TD_MiB)
/* On CUDA with several ranks, each rank's NCCL beside it (its communicator
 * and proxy state, its kernels' module images): tidal's own heap is the
 * same at 1 and 2 ranks (td_malloc by role, the step log's
 * host.heap_roles), while jemalloc measured each rank's heap 384.8 MiB
 * above one rank's alone (4.1B GPT, 2 x H200, NCCL over NVLink:
 * bench/results/host-peak-fp32.json), rounded up here. */
#define HEAP_NCCL_BYTES (416 * TD_MiB)
/* Where the libraries' heap was measured (td_train_config's
 * library_heap_bytes, once the backend and the topology exist), the
 * allowance is at least that plus what a run adds after it (on CUDA the
 * module images of the kernels it loads on their first launch, cuBLAS's
 * heuristics), rounded up to 256 MiB so that `tidal plan` and the trainer,
 * measuring in different processes, plan alike; a measured heap under
 * 256 MiB leaves the constants as they are.  The constants are peaks
 * measured while hwloc's OpenCL and NVML components started those runtimes
 * in every process, whose heap grew with the host's CPUs (a 1-rank CUDA
 * run's peak: 453 MiB on a 16-CPU H200 host, 760 MiB on 32, 1360 MiB on
 * 64).  The topology is read with the PCI component alone (offload/topo.c),
 * and `tidal plan --backend cuda` measures the libraries' heap at 31.1 MiB
 * on a 32-CPU 2 x H200 host (628.5 MiB with those components), so the
 * constants now hold a margin over what the libraries take: the whole
 * process's heap, tidal's own included, stayed at or under 160417648 bytes
 * (153 MiB) after the warm-up of 2000 steps at W6's shape on a 16-CPU H200
 * host (bench/results/soak-W6.json). */
#define HEAP_GROWTH_CUDA_BYTES (256 * TD_MiB)
#define HEAP_GROWTH_CPU_BYTES (64 * TD_MiB)
#define HEAP_MEASURED_ROUND (256 * TD_MiB)
#define HEAP_PER_TENSOR_BYTES 512
#define HEAP_PER_CHUNK_BYTES 1024

/* The trainer's pinned allocations, in its order (the layout's chunk copies,
 * then alloc_activations' staging buffers), replayed on a planning pool with
 * slabs of slab_bytes: its stats are what the run will pin. */
static td_status replay(td_memmgr *mm, const td_train_config *cfg, size_t slab_bytes, td_hostpool_stats *out)
{
    td_status st = TD_OK;
    td_hostpool *pool = NULL;
    td_hostpool_params hp = td_hostpool_default_params();
    hp.slab_bytes = slab_bytes;
    hp.pin_limit_bytes = SIZE_MAX;
    TD_TRY(td_hostpool_create(NULL, NULL, &hp, &pool));
    void *ignored;
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) {
        if (td_memmgr_chunk_pageable(mm, c) || td_memmgr_chunk_transient(mm, c) || td_memmgr_chunk_on_disk(mm, c)) continue;
        td_tensor_role r = td_memmgr_chunk_role(mm, c);
        int optim = r == TD_TENSOR_MASTER || r == TD_TENSOR_ADAM_M || r == TD_TENSOR_ADAM_V;
        size_t b = td_memmgr_chunk_bytes(mm, c); /* a rank past a small chunk's end: a byte, as the layout takes */
        TD_TRY(td_hostpool_alloc(pool, b ? b : 1, optim ? TD_ROLE_OPTIM : TD_ROLE_CHUNK, &ignored));
    }
    size_t slot_bytes;
    int slots = td_memmgr_grad_slots(mm, &slot_bytes); /* the transient grads' staging, after the chunks */
    for (int i = 0; i < slots; i++) TD_TRY(td_hostpool_alloc(pool, slot_bytes, TD_ROLE_STAGING, &ignored));
    size_t disk_slot[TD_TENSOR_ROLE_COUNT];
    int dslots = td_memmgr_disk_plan(mm, disk_slot, NULL); /* the disk tier's slot pools, after them */
    for (int p = 0; p < TD_TRAIN_DISK_POOLS; p++)
        for (int i = 0; disk_slot[td_train_disk_pool_roles[p]] && i < dslots; i++)
            TD_TRY(td_hostpool_alloc(pool, disk_slot[td_train_disk_pool_roles[p]], TD_ROLE_STAGING, &ignored));
    size_t staging[TD_TRAIN_STAGING];
    td_train_staging_sizes(cfg, staging);
    for (int i = 0; i < TD_TRAIN_STAGING; i++) TD_TRY(td_hostpool_alloc(pool, staging[i], TD_ROLE_STAGING, &ignored));
    td_hostpool_get_stats(pool, out);
cleanup:
    td_hostpool_destroy(pool);
    return st;
}

/* Replays the trainer's pinned allocations on slabs of `slab` bytes and keeps
 * it in *best where it pins fewer bytes than *best_pinned (the larger slab
 * of two that pin as much: fewer registrations). */
static void try_slab(td_memmgr *mm, const td_train_config *cfg, size_t slab, size_t *best, size_t *best_pinned)
{
    td_hostpool_stats hs;
    if (replay(mm, cfg, slab, &hs) != TD_OK) {
        td_error_clear();
        return;
    }
    if (hs.pinned_bytes < *best_pinned || (hs.pinned_bytes == *best_pinned && slab > *best)) {
        *best_pinned = hs.pinned_bytes;
        *best = slab;
    }
}

/* The slab size that pins the fewest bytes.  Candidates: for each distinct
 * pinned chunk size b (up to 16 of them) and each slab count k from the
 * fewest that keep slabs at most 1 GiB (few registrations for a big model)
 * to 16 more, slabs of ceil(bytes / b / k) chunks of b plus room for the
 * staging buffers; and slabs of whole multiples of b from 64 MiB to 2 GiB,
 * with and without that room, into which chunks of the other sizes may pack
 * (ZeRO-3's shards of a block beside the embedding's larger shard and the
 * optimizer's chunks).  Each is rounded to the pool's grain and replayed
 * exactly. */
size_t td_train_host_slab_bytes(td_memmgr *mm, const td_train_config *cfg)
{
    enum { SIZES = 16 };
    size_t total = 0, sizes[SIZES] = {0};
    int n = td_memmgr_chunk_count(mm), n_sizes = 0;
    size_t slot_bytes, disk_slot[TD_TENSOR_ROLE_COUNT];
    int slots = td_memmgr_grad_slots(mm, &slot_bytes), dslots = td_memmgr_disk_plan(mm, disk_slot, NULL);
    /* Every pinned chunk copy, the transient grads' slots, the disk tier's slots. */
    for (int c = 0; c < n + slots + TD_TRAIN_DISK_POOLS * dslots; c++) {
        size_t b;
        if (c < n) {
            if (td_memmgr_chunk_pageable(mm, c) || td_memmgr_chunk_transient(mm, c) || td_memmgr_chunk_on_disk(mm, c))
                continue;
            b = td_memmgr_chunk_bytes(mm, c);
        } else {
            b = c < n + slots ? slot_bytes : disk_slot[td_train_disk_pool_roles[(c - n - slots) / dslots]];
        }
        if (!b) continue;
        b = td_align_up(b, TD_HOSTPOOL_ALIGN);
        total += b;
        int seen = 0;
        for (int i = 0; i < n_sizes; i++) seen |= sizes[i] == b;
        if (!seen && n_sizes < SIZES) sizes[n_sizes++] = b;
    }
    size_t staging[TD_TRAIN_STAGING], extra = 0;
    td_train_staging_sizes(cfg, staging);
    for (int i = 0; i < TD_TRAIN_STAGING; i++) extra += td_align_up(staging[i], TD_HOSTPOOL_ALIGN);
    size_t best = td_align_up(total + extra, TD_HOSTPOOL_SLAB_GRAIN), best_pinned = SIZE_MAX;
    if (best <= TD_GiB) return best; /* one slab holds it all */
    size_t kmin = (total + TD_GiB - 1) / TD_GiB;
    for (int i = 0; i < n_sizes; i++) {
        size_t count = (total + sizes[i] - 1) / sizes[i];
        for (size_t k = kmin; k <= kmin + 16 && k <= count; k++)
            try_slab(mm, cfg, td_align_up((count + k - 1) / k * sizes[i] + extra, TD_HOSTPOOL_SLAB_GRAIN), &best,
                     &best_pinned);
        /* and slabs of whole multiples of it from 64 MiB to 2 GiB (at most 64 of them), which the
         * other sizes may pack into */
        size_t m0 = (64 * TD_MiB + sizes[i] - 1) / sizes[i];
        for (size_t m = m0 ? m0 : 1; m * sizes[i] <= 2 * TD_GiB && m < m0 + 64; m++) {
            try_slab(mm, cfg, td_align_up(m * sizes[i], TD_HOSTPOOL_SLAB_GRAIN), &best, &best_pinned);
            if (extra) try_slab(mm, cfg, td_align_up(m * sizes[i] + extra, TD_HOSTPOOL_SLAB_GRAIN), &best, &best_pinned);
        }
    }
    return best;
}

void td_train_staging_sizes(const td_train_config *cfg, size_t sizes[TD_TRAIN_STAGING])
{
    size_t N = (size_t)cfg->micro_batch * (size_t)cfg->seq_len;
    sizes[0] = N * sizeof(int32_t);                                  /* h_tokens */
    sizes[1] = N * sizeof(int32_t);                                  /* h_targets */
    sizes[2] = N * sizeof(float);                                    /* h_losses */
    sizes[3] = (size_t)cfg->model.padded_vocab_size * sizeof(float); /* h_row */
    sizes[4] = N * sizeof(int32_t);                                  /* h_positions */
}

td_status td_train_host_homes(td_memmgr *mm, const int *order, int gpu_chunks, const uint8_t *marks)
{
    /* As td_train_place_optimizer gives them to the trainer's layout: the
     * GPU AdamW's chunks (master, m, v) on the device, pinned; the CPU
     * AdamW's on the host, pageable (memmgr.h). */
    td_status st = TD_OK;
    static const td_tensor_role roles[3] = {TD_TENSOR_MASTER, TD_TENSOR_ADAM_M, TD_TENSOR_ADAM_V};
    for (int r = 0; r < 3; r++) {
        int n = td_memmgr_role_chunk_count(mm, roles[r]);
        for (int k = 0; k < n; k++)
            TD_TRY(td_memmgr_set_chunk_home(mm, td_memmgr_role_chunk(mm, roles[r], k), TD_HOME_HOST));
        for (int j = 0; j < gpu_chunks; j++) { /* the first gpu_chunks of the slack order */
            if (order[j] >= n) continue;  /* a role of no chunks: fp32 params are their own master */
            TD_TRY(td_memmgr_set_chunk_home(mm, td_memmgr_role_chunk(mm, roles[r], order[j]), TD_HOME_DEVICE));
        }
        for (int k = 0; marks && k < n; k++) /* the disk tier's (diskplan.c) */
            if (marks[k] & TD_TRAIN_DISK_OPTIM)
                TD_TRY(td_memmgr_set_chunk_home(mm, td_memmgr_role_chunk(mm, roles[r], k), TD_HOME_DISK));
    }
    /* Params and grads the disk tier takes; those a previous set of marks
     * took come back to the host. */
    static const struct { td_tensor_role role; uint8_t mark; } pg[2] = {{TD_TENSOR_GRAD, TD_TRAIN_DISK_GRAD},
                                                                       {TD_TENSOR_PARAM, TD_TRAIN_DISK_PARAM}};
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < td_memmgr_role_chunk_count(mm, pg[i].role); k++) {
            int c = td_memmgr_role_chunk(mm, pg[i].role, k);
            int want = marks && (marks[k] & pg[i].mark);
            if (want) TD_TRY(td_memmgr_set_chunk_home(mm, c, TD_HOME_DISK));
            else if (td_memmgr_chunk_home(mm, c) == TD_HOME_DISK) TD_TRY(td_memmgr_set_chunk_home(mm, c, TD_HOME_HOST));
        }
cleanup:
    return st;
}

size_t td_train_library_heap(void)
{
    td_heap_stats hs;
    if (strcmp(td_host_heap_source(), "jemalloc") || td_host_heap_stats(&hs) != TD_OK) {
        td_error_clear();
        return 0;
    }
    size_t own = td_host_used_total();
    return hs.allocated_bytes > own ? hs.allocated_bytes - own : 0;
}

td_status td_train_first_touch(td_memmgr *mm, const td_train_config *cfg, td_topo *topo)
{
    td_status st = TD_OK;
    int chunks = td_memmgr_role_chunk_count(mm, TD_TENSOR_ADAM_M), any = 0;
    for (int k = 0; k < chunks; k++) any |= td_memmgr_chunk_pageable(mm, td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k));
    if (!any) return TD_OK;
    /* A team like the trainer's (same threads, same binding, so the same
     * ranges): each thread zeroes the pages it will update. */
    td_adam_cpu_params ap = td_adam_cpu_default_params();
    ap.threads = td_train_adam_threads(cfg, topo);
    ap.topo = topo;
    td_adam_cpu *cpu = NULL;
    TD_TRY(td_adam_cpu_create(&ap, &cpu));
    for (int k = 0; k < chunks; k++) {
        int mc = td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_M, k), vc = td_memmgr_role_chunk(mm, TD_TENSOR_ADAM_V, k);
        int sc = td_memmgr_role_chunk(mm, TD_TENSOR_MASTER, k), pc = td_memmgr_role_chunk(mm, TD_TENSOR_PARAM, k);
        if (!td_memmgr_chunk_pageable(mm, mc)) continue;
        void *master, *m, *v; /* zeros over zeros: reads suffice, no version changes */
        size_t b, e, numel = td_memmgr_chunk_host_range(mm, mc, &b, &e); /* a rank's shard under ZeRO-3 */
        if (!numel) continue;
        TD_TRY(td_memmgr_chunk_host_access(mm, sc >= 0 ? sc : pc, TD_ACCESS_READ, &master)); /* fp32 params: the master */
        TD_TRY(td_memmgr_chunk_host_access(mm, mc, TD_ACCESS_READ, &m));
        TD_TRY(td_memmgr_chunk_host_access(mm, vc, TD_ACCESS_READ, &v));
        td_adam_chunk ch = { .master = master, .m = m, .v = v, .state = cfg->optim.state, .numel = numel };
        TD_TRY(td_adam_cpu_init(cpu, &ch, NULL, TD_DTYPE_F32));
    }
cleanup:
    td_adam_cpu_destroy(cpu);
    return st;
}

td_status td_train_host_plan(td_memmgr *mm, const td_train_config *cfg, size_t budget, td_train_plan *p)
{
    td_status st = TD_OK;
    size_t pageable = 0;
    int n_chunks = td_memmgr_chunk_count(mm);
    for (int c = 0; c < n_chunks; c++) {
        if (td_memmgr_chunk_pageable(mm, c)) { size_t b = td_memmgr_chunk_bytes(mm, c); pageable += td_hostmem_round(b ? b : 1); }
    }
    size_t slab = td_train_host_slab_bytes(mm, cfg);
    td_hostpool_stats hs;
    TD_TRY(replay(mm, cfg, slab, &hs));
    p->host_pinned_bytes = hs.pinned_bytes;
    p->host_pinned_chunk_bytes = hs.used[TD_ROLE_CHUNK] + hs.used[TD_ROLE_OPTIM];
    p->host_pinned_optimizer_bytes = hs.used[TD_ROLE_OPTIM];
    p->host_staging_bytes = hs.used[TD_ROLE_STAGING];
    p->host_slab_bytes = slab;
    p->host_slabs = hs.slabs;
    p->host_pageable_state_bytes = pageable;
    int cuda = cfg->backend == TD_BACKEND_CUDA;
    size_t library = cuda ? HEAP_CUDA_BYTES : 0;
    if (cfg->library_heap_bytes >= HEAP_MEASURED_ROUND) { /* below, the constants cover what the libraries hold */
        size_t measured = td_align_up(cfg->library_heap_bytes + (cuda ? HEAP_GROWTH_CUDA_BYTES : HEAP_GROWTH_CPU_BYTES),
                                      HEAP_MEASURED_ROUND);
        if (measured > library) library = measured;
    }
    p->host_library_heap_measured = library > (cuda ? HEAP_CUDA_BYTES : 0);
    p->host_library_heap_bytes = library;
    p->host_heap_bytes = HEAP_BASE_BYTES + (size_t)td_memmgr_tensor_count(mm) * HEAP_PER_TENSOR_BYTES +
                         (size_t)n_chunks * HEAP_PER_CHUNK_BYTES + library + (cuda && cfg->ranks > 1 ? HEAP_NCCL_BYTES : 0);
    /* The cpu backend's device region is host memory: the arena's one
     * reservation, mapped in whole pages behind a header page (what
     * td_backend_host_mapped_bytes measures). */
    p->host_device_region_bytes = cfg->backend == TD_BACKEND_CPU ? td_align_up(budget, 4096) + 4096 : 0;
    p->host_pageable_bytes = pageable + p->host_heap_bytes + p->host_device_region_bytes;
    p->host_bytes = p->host_pinned_bytes + p->host_pageable_bytes;
cleanup:
    return st;
}

/* The model state one rank of the shard group holds on the host: for each
 * chunk its shard (`shard`), as a pinned block or page-rounded pageable
 * mapping, as the layout allocates it; transient grads hold none. */
static size_t state_bytes_of(td_memmgr *mm, const td_train_config *cfg, int shard)
{
    size_t total = 0, E = td_dtype_bytes(cfg->precision);
    for (int c = 0; c < td_memmgr_chunk_count(mm); c++) {
        td_shard_layout l;
        size_t b, e, n;
        if (td_memmgr_chunk_transient(mm, c) || td_memmgr_chunk_shard(mm, c, &l)) continue;
        n = l.ranks > 1 ? td_shard_range(&l, shard, &b, &e) : l.numel;
        td_tensor_role r = td_memmgr_chunk_role(mm, c);
        size_t bytes = r == TD_TENSOR_MASTER ? 4 * n
                     : r == TD_TENSOR_ADAM_M || r == TD_TENSOR_ADAM_V ? td_adam_moment_bytes(cfg->optim.state, n)
                     : E * n;
        if (!bytes) bytes = 1; /* a rank past a small chunk's end: a byte stands in */
        total += td_memmgr_chunk_pageable(mm, c) ? td_hostmem_round(bytes) : td_align_up(bytes, TD_HOSTPOOL_ALIGN);
    }
    return total;
}

td_status td_train_node_plan(td_memmgr *mm, const td_train_config *cfg, td_train_plan *p)
{
    int L = p->local_ranks > 0 ? p->local_ranks : 1, N = td_train_shard_ranks(cfg);
    int first = N > 1 ? td_train_shard_rank(cfg) / L * L : 0; /* this host's first shard */
    size_t mine = state_bytes_of(mm, cfg, td_train_shard_rank(cfg)), rest = p->host_bytes > mine ? p->host_bytes - mine : 0;
    p->node_state_bytes = 0;
    for (int i = 0; i < L; i++) p->node_state_bytes += N > 1 ? state_bytes_of(mm, cfg, (first + i) % N) : mine;
    p->node_bytes = p->node_state_bytes + (size_t)L * rest;
    return TD_OK;
}

size_t td_train_host_reserve(const td_train_config *cfg, size_t ram)
{
    size_t system = ram / 100 * TD_HOST_RESERVE_PERCENT;
    if (system < TD_HOST_RESERVE_MIN) system = TD_HOST_RESERVE_MIN;
    size_t procs = cfg->ranks > 1 && cfg->local_ranks > 1 ? (size_t)cfg->local_ranks : 1;
    size_t each = cfg->backend == TD_BACKEND_CPU ? TD_HOST_RESERVE_PROCESS_CPU : TD_HOST_RESERVE_PROCESS_CUDA;
    size_t r = system + procs * each;
    return r < ram / 2 ? r : ram / 2; /* a small machine keeps half for the run */
}

td_status td_train_host_limits(const td_train_config *cfg, size_t *ram, size_t *pin_limit, char *source,
                               size_t source_bytes)
{
    if (cfg->host_ram) {
        char a[32];
        *ram = cfg->host_ram;
        snprintf(source, source_bytes, "--host-ram %s", td_format_bytes(cfg->host_ram, a, sizeof a));
    } else {
        td_status st = td_host_ram(ram, source, source_bytes);
        if (st) return st;
        size_t keep = td_train_host_reserve(cfg, *ram), len = strlen(source);
        char a[32];
        *ram -= keep;
        snprintf(source + len, source_bytes > len ? source_bytes - len : 0, " less %s kept for the system",
                 td_format_bytes(keep, a, sizeof a));
    }
    *pin_limit = cfg->host_pin_limit ? cfg->host_pin_limit : *ram / 10 * 8;
    if (cfg->ranks > 1 && cfg->local_ranks > 1) { /* the host's figures, shared by its ranks */
        size_t k = (size_t)cfg->local_ranks, len = strlen(source);
        *ram /= k;
        *pin_limit /= k;
        snprintf(source + len, source_bytes > len ? source_bytes - len : 0, "; this rank's 1/%zu, %d ranks on the host",
                 k, cfg->local_ranks);
    }
    return TD_OK;
}

/* ---- measured ------------------------------------------------------------------- */

td_status td_trainer_host_usage(td_trainer *t, td_host_usage *out)
{
    memset(out, 0, sizeof *out);
    td_heap_stats hs;
    td_status st = td_host_heap_stats(&hs);
    if (st) return st;
    if (t->pool) {
        td_hostpool_stats ps;
        td_hostpool_get_stats(t->pool, &ps);
        out->pinned_bytes = ps.pinned_bytes;
    }
    if (t->hostmem) {
        td_hostmem_stats ms;
        td_hostmem_get_stats(t->hostmem, &ms);
        out->pageable_bytes = ms.used_bytes;
    }
    if ((st = td_host_rss(&out->rss_bytes, &out->rss_peak_bytes))) return st;
    out->heap_allocated_bytes = hs.allocated_bytes;
    out->heap_resident_bytes = hs.resident_bytes;
    out->heap_source = hs.source;
    for (int r = 0; r < TD_ROLE_COUNT; r++) {
        out->heap_role_bytes[r] = td_host_used((td_role)r);
        out->heap_role_peak_bytes[r] = td_host_used_peak((td_role)r);
    }
    out->n_heap_sites = td_host_sites(out->heap_sites, TD_HOST_USAGE_SITES);
    out->device_region_bytes = t->backend ? td_backend_host_mapped_bytes(t->backend) : 0;
    out->total_bytes = out->pinned_bytes + out->pageable_bytes + out->heap_allocated_bytes + out->device_region_bytes;
    if (out->total_bytes > t->host_peak_bytes) t->host_peak_bytes = out->total_bytes;
    out->peak_bytes = t->host_peak_bytes;
    return TD_OK;
}

size_t td_host_usage_json(const td_host_usage *u, char *buf, size_t buf_bytes)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "pinned_bytes", (double)u->pinned_bytes);
    cJSON_AddNumberToObject(j, "pageable_bytes", (double)u->pageable_bytes);
    cJSON_AddNumberToObject(j, "heap_allocated_bytes", (double)u->heap_allocated_bytes);
    cJSON_AddNumberToObject(j, "heap_resident_bytes", (double)u->heap_resident_bytes);
    cJSON_AddNumberToObject(j, "device_region_bytes", (double)u->device_region_bytes);
    cJSON_AddNumberToObject(j, "total_bytes", (double)u->total_bytes);
    cJSON_AddNumberToObject(j, "peak_bytes", (double)u->peak_bytes);
    cJSON_AddNumberToObject(j, "rss_bytes", (double)u->rss_bytes);
    cJSON_AddNumberToObject(j, "rss_peak_bytes", (double)u->rss_peak_bytes);
    cJSON_AddStringToObject(j, "heap_source", u->heap_source ? u->heap_source : "");
    cJSON *roles = cJSON_AddObjectToObject(j, "heap_roles"), *sites = cJSON_AddArrayToObject(j, "heap_sites");
    for (int r = 0; r < TD_ROLE_COUNT; r++) {
        cJSON *o = cJSON_AddObjectToObject(roles, td_role_name((td_role)r));
        cJSON_AddNumberToObject(o, "bytes", (double)u->heap_role_bytes[r]);
        cJSON_AddNumberToObject(o, "peak_bytes", (double)u->heap_role_peak_bytes[r]);
    }
    for (int i = 0; i < u->n_heap_sites; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "site", u->heap_sites[i].site);
        cJSON_AddStringToObject(o, "role", td_role_name(u->heap_sites[i].role));
        cJSON_AddNumberToObject(o, "bytes", (double)u->heap_sites[i].live_bytes);
        cJSON_AddNumberToObject(o, "peak_bytes", (double)u->heap_sites[i].peak_bytes);
        cJSON_AddItemToArray(sites, o);
    }
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    int n = snprintf(buf, buf_bytes, "%s", text ? text : "{}");
    cJSON_free(text);
    if (n < 0) n = 0;
    return (size_t)n < buf_bytes ? (size_t)n : buf_bytes - 1;
}

int td_train_adam_overlap(const td_train_config *cfg)
{
    if (cfg->adam_thread) return cfg->adam_thread > 0;
    return cfg->backend == TD_BACKEND_CUDA;
}

int td_train_grads_transient(const td_train_config *cfg)
{
    return td_train_adam_overlap(cfg) && cfg->optim.max_grad_norm <= 0 &&
           cfg->optim.scaler.kind == TD_LOSS_SCALE_NONE && cfg->grad_accum == 1;
}

int td_train_adam_threads(const td_train_config *cfg, td_topo *topo)
{
    if (cfg->threads > 0) return cfg->threads;
    int cores = cfg->ranks > 1 && topo ? td_topo_local_cores(topo) : td_train_default_threads(topo, NULL, 0);
    if (cores < 1) cores = 1;
    return td_train_adam_overlap(cfg) && cores > 1 ? cores - 1 : cores;
}
