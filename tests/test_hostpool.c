/* Pinned host pool: sub-allocation inside pinned slabs, per-role counts,
 * the pin limit as a clear error, NUMA topology (and that reading it starts
 * no vendor's runtime). */
#include "td_proc.h"
#include "td_test.h"
#include "tidal/hostpool.h"
#include "tidal/range.h"
#include "tidal/topo.h"

#include <dlfcn.h>
#include <glob.h>
#include <hwloc.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_hostpool_suballocates_slabs(void **state)
{
    td_backend *b = td_test_backend(0);
    td_topo *topo;
    TD_ASSERT_OK(td_topo_create(b, &topo));
    td_hostpool_params prm = td_hostpool_default_params();
    prm.slab_bytes = 4 * TD_MiB;
    td_hostpool *p;
    TD_ASSERT_OK(td_hostpool_create(b, topo, &prm, &p));
    td_hostpool_stats s;
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 0); /* nothing pinned until asked */
    void *x[8];
    for (int i = 0; i < 8; i++) {
        TD_ASSERT_OK(td_hostpool_alloc(p, 1000 * (size_t)(i + 1), i % 2 ? TD_ROLE_CHUNK : TD_ROLE_STAGING, &x[i]));
        assert_int_equal((uintptr_t)x[i] % TD_HOSTPOOL_ALIGN, 0);
        memset(x[i], i, 1000 * (size_t)(i + 1));
    }
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.slabs, 1);           /* eight blocks, one slab: no pin per tensor */
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB);
    assert_int_equal(s.used[TD_ROLE_STAGING], 4096 + 4096 + 8192 + 8192); /* 1000, 3000, 5000, 7000 in 4 KiB pages */
    assert_int_equal(s.used[TD_ROLE_CHUNK], 4096 + 4096 + 8192 + 8192);
    for (int i = 0; i < 8; i++) {
        const unsigned char *c = x[i];
        for (size_t k = 0; k < 1000 * (size_t)(i + 1); k++) assert_int_equal(c[k], i);
    }
    /* A request larger than a slab gets its own slab. */
    void *big;
    TD_ASSERT_OK(td_hostpool_alloc(p, 9 * TD_MiB, TD_ROLE_OPTIM, &big));
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.slabs, 2);
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB + 10 * TD_MiB); /* 2 MiB grain */
    int foreign;
    assert_int_equal(td_hostpool_release(p, &foreign), TD_ERR_INVALID);
    for (int i = 0; i < 8; i++) TD_ASSERT_OK(td_hostpool_release(p, x[i]));
    TD_ASSERT_OK(td_hostpool_release(p, big));
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.used_bytes, 0);
    assert_int_equal(s.peak[TD_ROLE_OPTIM], 9 * TD_MiB);
    assert_int_equal(td_hostpool_trim(p), 14 * TD_MiB);
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 0);
    td_hostpool_destroy(p);
    td_topo_destroy(topo);
    td_backend_free(b);
}

/* A planning pool places every block where the plain first fit does (the
 * newest slab first, each slab's best fit, a new slab when none holds it),
 * whatever slabs it passes over without looking: a reference pool of
 * td_ranges walked whole, over random allocations and releases of a few
 * sizes (a planning pool's k-th slab starts at k << 44). */
static void test_hostpool_places_as_first_fit(void **state)
{
    enum { OPS = 3000, MAXS = 4096 };
    td_hostpool_params prm = td_hostpool_default_params();
    prm.slab_bytes = 2 * TD_MiB;
    prm.pin_limit_bytes = SIZE_MAX;
    td_hostpool *p;
    TD_ASSERT_OK(td_hostpool_create(NULL, NULL, &prm, &p));
    static td_range ref[MAXS];                  /* by creation order */
    int n_ref = 0;
    static void *live[OPS];
    static int live_slab[OPS];
    static size_t live_off[OPS];
    int n_live = 0;
    const size_t sizes[] = {700 * TD_KiB, 700 * TD_KiB, 700 * TD_KiB, 64 * TD_KiB, 4 * TD_KiB, 3 * TD_MiB};
    srand(7);
    for (int op = 0; op < OPS; op++) {
        if (n_live && rand() % 4 == 0) { /* release one */
            int i = rand() % n_live;
            TD_ASSERT_OK(td_hostpool_release(p, live[i]));
            size_t bytes;
            uint32_t tag;
            TD_ASSERT_OK(td_range_free(&ref[live_slab[i]], live_off[i], &bytes, &tag));
            live[i] = live[--n_live];
            live_slab[i] = live_slab[n_live];
            live_off[i] = live_off[n_live];
            continue;
        }
        size_t bytes = sizes[rand() % (int)(sizeof sizes / sizeof sizes[0])];
        void *x;
        TD_ASSERT_OK(td_hostpool_alloc(p, bytes, TD_ROLE_CHUNK, &x));
        int k = -1;
        size_t off = 0;
        for (int j = n_ref - 1; j >= 0 && k < 0; j--) /* newest first */
            if (td_range_alloc(&ref[j], bytes, 0, 0, &off) == TD_OK) k = j;
        if (k < 0) {
            size_t size = td_align_up(bytes > prm.slab_bytes ? bytes : prm.slab_bytes, TD_HOSTPOOL_SLAB_GRAIN);
            assert_true(n_ref < MAXS);
            TD_ASSERT_OK(td_range_init(&ref[n_ref], size, TD_HOSTPOOL_ALIGN));
            TD_ASSERT_OK(td_range_alloc(&ref[n_ref], bytes, 0, 0, &off));
            k = n_ref++;
        }
        uintptr_t a = (uintptr_t)x;
        if ((int)(a >> 44) != k + 1 || (a & (((uintptr_t)1 << 44) - 1)) != off)
            fail_msg("op %d: %zu bytes at slab %d offset %zu, first fit: slab %d offset %zu", op, bytes,
                     (int)(a >> 44) - 1, (size_t)(a & (((uintptr_t)1 << 44) - 1)), k, off);
        live[n_live] = x;
        live_slab[n_live] = k;
        live_off[n_live++] = off;
    }
    td_hostpool_stats s;
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.slabs, n_ref);
    assert_true(n_ref > 100); /* enough slabs that passing over them matters */
    for (int j = 0; j < n_ref; j++) td_range_destroy(&ref[j]);
    td_hostpool_destroy(p);
}

static void test_hostpool_pin_limit_error(void **state)
{
    td_backend *b = td_test_backend(0);
    td_hostpool_params prm = { .slab_bytes = 2 * TD_MiB, .pin_limit_bytes = 5 * TD_MiB };
    td_hostpool *p;
    TD_ASSERT_OK(td_hostpool_create(b, NULL, &prm, &p));
    void *a, *c, *d;
    TD_ASSERT_OK(td_hostpool_alloc(p, 2 * TD_MiB, TD_ROLE_CHUNK, &a));
    TD_ASSERT_OK(td_hostpool_alloc(p, 2 * TD_MiB, TD_ROLE_CHUNK, &c));
    assert_int_equal(td_hostpool_alloc(p, TD_MiB, TD_ROLE_CHUNK, &d), TD_ERR_PIN);
    assert_null(d);
    const char *m = td_error_msg();
    assert_non_null(strstr(m, "4.00 MiB already pinned in 2 slabs"));
    assert_non_null(strstr(m, "pin limit is 5.00 MiB"));
    td_hostpool_stats s;
    td_hostpool_get_stats(p, &s);
    assert_int_equal(s.pinned_bytes, 4 * TD_MiB); /* the refusal changed nothing */
    TD_ASSERT_OK(td_hostpool_release(p, a));
    TD_ASSERT_OK(td_hostpool_alloc(p, TD_MiB, TD_ROLE_CHUNK, &d)); /* fits the freed room */
    TD_ASSERT_OK(td_hostpool_release(p, c));
    TD_ASSERT_OK(td_hostpool_release(p, d));
    td_hostpool_destroy(p);
    td_backend_free(b);
}

/* In a child: OpenCL's ICD loader pointed at the stand-in vendor library
 * (build/tests/libtd_fake_icd.so, which creates `mark` when it is loaded),
 * then either the topology read (`topo`) or a direct question to the loader
 * for its platforms (the control: it must load the library).  The child's
 * exit status: 0 done, 2 no ICD loader, 1 a failure. */
static int icd_child(const char *vendors, const char *mark, int topo)
{
    pid_t pid = fork();
    if (pid == 0) {
        setenv("OCL_ICD_VENDORS", vendors, 1);
        setenv("TD_FAKE_ICD_MARK", mark, 1);
        if (topo) {
            td_topo *t = NULL;
            _exit(td_topo_create(NULL, &t) == TD_OK ? 0 : 1);
        }
        void *cl = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!cl) _exit(2);
        int (*platforms)(unsigned, void *, unsigned *) =
            (int (*)(unsigned, void *, unsigned *))dlsym(cl, "clGetPlatformIDs");
        unsigned n = 0;
        if (platforms) platforms(0, NULL, &n);
        _exit(platforms ? 0 : 2);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

/* The machine's own vendors' runtimes, by the names of their libraries (no
 * version): the drivers' CUDA, NVML and OpenCL, ROCm's, Level Zero's and
 * Intel's and PoCL's OpenCL, and every vendor that the OpenCL ICD files of
 * /etc/OpenCL/vendors name. */
enum { VENDOR_MAX = 48 };
typedef struct vendor_libs { int n; char name[VENDOR_MAX][64]; } vendor_libs;

static void vendor_add(vendor_libs *v, const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t len = strcspn(base, " \t\r\n");
    const char *so = strstr(base, ".so");
    if (so && (size_t)(so - base) < len) len = (size_t)(so - base) + 3; /* libfoo.so.1 -> libfoo.so */
    if (!len || len >= sizeof v->name[0] || v->n == VENDOR_MAX) return;
    for (int i = 0; i < v->n; i++)
        if (strlen(v->name[i]) == len && !strncmp(v->name[i], base, len)) return;
    memcpy(v->name[v->n], base, len);
    v->name[v->n++][len] = 0;
}

static void vendor_libs_of_machine(vendor_libs *v)
{
    static const char *const known[] = {"libcuda.so", "libnvidia-ml.so", "libnvidia-opencl.so", "libamdocl64.so",
                                        "librocm_smi64.so", "libamdhip64.so", "libze_loader.so", "libze_intel_gpu.so",
                                        "libigdrcl.so", "libintelocl.so", "libpocl.so"};
    v->n = 0;
    for (size_t i = 0; i < sizeof known / sizeof *known; i++) vendor_add(v, known[i]);
    glob_t g;
    if (glob("/etc/OpenCL/vendors/*.icd", 0, NULL, &g) != 0) return;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        char line[512];
        FILE *f = fopen(g.gl_pathv[i], "r");
        if (!f) continue;
        while (fgets(line, sizeof line, f)) vendor_add(v, line);
        fclose(f);
    }
    globfree(&g);
}

/* Which of those this process maps (bit i: v->name[i]), from /proc/self/maps. */
static uint64_t vendor_mapped(const vendor_libs *v)
{
    uint64_t mapped = 0;
    char line[1024];
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        const char *path = strchr(line, '/');
        if (!path) continue;
        const char *base = strrchr(path, '/') + 1;
        for (int i = 0; i < v->n; i++)
            if (!strncmp(base, v->name[i], strlen(v->name[i]))) mapped |= 1ull << i;
    }
    fclose(f);
    return mapped;
}

/* In a child, with the machine's ICD files: hwloc's own topology read with
 * every component it has (the control, `topo` 0), or tidal's (`topo` 1).
 * The child's exit status: 0 no vendor's runtime newly mapped, 3 one was
 * (its name on stderr), 1 a failure, 128 + N killed by signal N. */
static int machine_child(const vendor_libs *v, int topo)
{
    pid_t pid = fork();
    if (pid == 0) {
        unsetenv("OCL_ICD_VENDORS");
        uint64_t before = vendor_mapped(v);
        if (topo) {
            td_topo *t = NULL;
            if (td_topo_create(NULL, &t) != TD_OK) _exit(1);
        } else {
            hwloc_topology_t h;
            if (hwloc_topology_init(&h) != 0) _exit(1);
            hwloc_topology_set_io_types_filter(h, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
            if (hwloc_topology_load(h) != 0) _exit(1);
        }
        uint64_t added = vendor_mapped(v) & ~before;
        for (int i = 0; topo && i < v->n; i++)
            if (added >> i & 1) fprintf(stderr, "reading the topology loaded a vendor's runtime: %s\n", v->name[i]);
        _exit(added ? 3 : 0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Reading the machine's topology for the GPU's NUMA node starts none of the
 * vendors' runtimes (hwloc's OpenCL, GL, CUDA, NVML components): they would
 * load the drivers and leave their heap and threads in every process.  Two
 * checks, each where the machine can run it: with a stand-in OpenCL vendor
 * (an ICD loader that honours OCL_ICD_VENDORS), and with the machine's own
 * vendors' runtimes (where hwloc's topology read with all of its components
 * maps one of them).  Runs first, before anything in this process reads the
 * topology. */
static void test_topo_leaves_vendor_runtimes_alone(void **state)
{
    char exe[PATH_MAX] = {0}, lib[PATH_MAX + 32], dir[128], icd[192], mark[192];
    assert_true(readlink("/proc/self/exe", exe, sizeof exe - 1) > 0);
    *strrchr(exe, '/') = 0;
    snprintf(lib, sizeof lib, "%s/libtd_fake_icd.so", exe);
    assert_int_equal(access(lib, R_OK), 0); /* built beside this test by make */
    assert_int_equal(td_proc_tmpdir(dir, sizeof dir, "tidal-icd"), 0);
    snprintf(icd, sizeof icd, "%s/fake.icd", dir);
    snprintf(mark, sizeof mark, "%s/loaded", dir);
    FILE *f = fopen(icd, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", lib);
    fclose(f);

    int control = icd_child(dir, mark, 0), checked = 0;
    if (control != 2 && access(mark, F_OK) == 0) {
        assert_int_equal(control, 0);
        assert_int_equal(unlink(mark), 0);
        assert_int_equal(icd_child(dir, mark, 1), 0);
        assert_int_not_equal(access(mark, F_OK), 0); /* the topology read never asked for OpenCL's platforms */
        checked++;
    }
    td_proc_rmdir(dir);

    vendor_libs v;
    vendor_libs_of_machine(&v);
    control = machine_child(&v, 0); /* 3: hwloc's own read started a runtime; anything else: nothing to check */
    if (control == 3) {
        assert_int_equal(machine_child(&v, 1), 0);
        checked++;
    }
    if (!checked)
        td_test_skip("no OpenCL ICD loader here that honours OCL_ICD_VENDORS, and hwloc's topology read with all of "
                     "its components maps no vendor's runtime here: nothing could start one");
}

static void test_topo_describes_and_binds(void **state)
{
    td_backend *b = td_test_backend(0);
    td_topo *t;
    TD_ASSERT_OK(td_topo_create(b, &t));
    assert_true(td_topo_local_cores(t) >= 1);
    assert_true(td_topo_numa_nodes(t) >= 1);
    assert_non_null(strstr(td_topo_describe(t), "NUMA node"));
    td_status st = td_topo_bind_thread(t);
    assert_true(st == TD_OK || st == TD_ERR_UNSUPPORTED);
    char *m = td_topo_alloc(t, 3 * TD_MiB);
    assert_non_null(m);
    memset(m, 1, 3 * TD_MiB);
    td_topo_free(t, m, 3 * TD_MiB);
    td_topo_destroy(t);
    td_backend_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topo_leaves_vendor_runtimes_alone), /* first: before the topology is read here */
        cmocka_unit_test(test_hostpool_suballocates_slabs),
        cmocka_unit_test(test_hostpool_places_as_first_fit),
        cmocka_unit_test(test_hostpool_pin_limit_error),
        cmocka_unit_test(test_topo_describes_and_binds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
