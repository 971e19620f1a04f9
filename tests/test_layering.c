/* The layout's rules, checked on the source tree (docs/architecture.md):
 *
 * - a file may include only headers of its own folder and of the folders its
 *   folder may use (the table below, closed under "uses"): memmgr/ including a
 *   model/ or trainer/ header fails, so does offload/ including memmgr/;
 * - every public header (include/tidal/) has an owner folder in the table, so
 *   a new header cannot slip past the rule;
 * - CUDA and NCCL headers only in *_cuda.c, *_nccl.c, .cu and .cuh files,
 *   never in core/ or memmgr/; kernels (.cu) only in model/cuda/ and optim/;
 * - no folder holds more than 30% of the C/CUDA lines of the layered folders;
 * - nothing outside model/ branches on the model's family: the sources of
 *   every other layered folder name no family (no
 *   TD_MODEL_<FAMILY> value, no string compare with a family's name, no
 *   family looked up or set by a literal name): they work through the
 *   family's table (include/tidal/family.h).  The families are the
 *   registry's (td_model_family_at), so a new one is covered by being there;
 * - a public header is named after the files that define what it declares:
 *   every function of include/tidal/X.h is defined in X.c, X_*.c, X.cu or
 *   X_*.cu, or in a folder named X (X_cuda.h: also where X.h's functions may
 *   be, and the cuda/ folder of its owner folder), so a reader finds a
 *   declaration's code from the header's name;
 * - a command's main function (main, td_cli_*_main, td_bench_*_main in cli/
 *   and bench/) is at most MAIN_MAX_LINES long: it reads its options, calls
 *   the library and reports, with the steps in functions of their own.
 *
 * The checker also runs on small trees made here, with a violation of each
 * kind, to show it reports them.  Runs from the repository root (as `make
 * test` does) or from TD_SOURCE_DIR. */
#include "td_test.h"
#include "tidal/model.h"
#include "tidal/tokenizer.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Each folder and the folders it may use directly (the rest follows). */
typedef struct layer { const char *dir, *uses; } layer;
static const layer layers[] = {
    {"core", ""},
    {"offload", "core"},
    {"parallel", "offload core"},
    {"memmgr", "offload core"},
    {"optim", "offload core"},
    {"model", "offload core"},
    {"data", "core"},
    {"checkpoint", "model core"},
    {"trainer", "core offload parallel memmgr optim model data checkpoint"},
    {"cli", "trainer"},
    {"bench", "cli"},
};
#define N_LAYERS (int)(sizeof layers / sizeof layers[0])

/* The owner folder of each public header. */
typedef struct owner { const char *header, *dir; } owner;
static const owner owners[] = {
    {"status.h", "core"}, {"util.h", "core"}, {"alloc.h", "core"}, {"dtype.h", "core"},
    {"convert.h", "core"}, {"range.h", "core"},
    {"backend.h", "offload"}, {"arena.h", "offload"}, {"copy.h", "offload"}, {"hostpool.h", "offload"},
    {"hostmem.h", "offload"}, {"diskio.h", "offload"},
    {"topo.h", "offload"},
    {"parallel.h", "parallel"},
    {"memmgr.h", "memmgr"}, {"memsim.h", "memmgr"}, {"policy.h", "memmgr"}, {"tensor_state.h", "memmgr"},
    {"trace.h", "memmgr"}, {"shard.h", "memmgr"},
    {"optim.h", "optim"}, {"optim_cuda.h", "optim"},
    {"model.h", "model"}, {"model_ref.h", "model"}, {"decode.h", "model"}, {"family.h", "model"},
    {"hf_config.h", "model"}, {"ops.h", "model"}, {"ops_cuda.h", "model"},
    {"data.h", "data"}, {"tokenizer.h", "data"}, {"chat.h", "data"},
    {"checkpoint.h", "checkpoint"}, {"safetensors.h", "checkpoint"},
    {"trainer.h", "trainer"}, {"block_probe.h", "trainer"}, {"tune.h", "trainer"},
};

static int layer_index(const char *dir)
{
    for (int i = 0; i < N_LAYERS; i++)
        if (!strcmp(layers[i].dir, dir)) return i;
    return -1;
}

/* may[a][b]: folder a may include folder b (reflexive, transitive). */
static int may[N_LAYERS][N_LAYERS];

static void closure(void)
{
    memset(may, 0, sizeof may);
    for (int a = 0; a < N_LAYERS; a++) {
        may[a][a] = 1;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", layers[a].uses);
        for (char *save = NULL, *w = strtok_r(buf, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
            int b = layer_index(w);
            assert_true(b >= 0); /* the table names only its own folders */
            may[a][b] = 1;
        }
    }
    for (int k = 0; k < N_LAYERS; k++)
        for (int a = 0; a < N_LAYERS; a++)
            for (int b = 0; b < N_LAYERS; b++)
                if (may[a][k] && may[k][b]) may[a][b] = 1;
}

typedef struct report {
    char text[16384];
    int violations;
    long lines[N_LAYERS];
} report;

static void note(report *r, const char *fmt, ...)
{
    size_t n = strlen(r->text);
    va_list ap;
    va_start(ap, fmt);
    if (n + 1 < sizeof r->text) vsnprintf(r->text + n, sizeof r->text - n, fmt, ap);
    va_end(ap);
    r->violations++;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static int is_source(const char *name)
{
    return ends_with(name, ".c") || ends_with(name, ".h") || ends_with(name, ".cu") || ends_with(name, ".cuh");
}

/* The folder that owns an include written in `from_dir` (relative to the
 * root): a public header's owner, or the top folder of a relative path.
 * NULL when the header is unknown: a public header without an owner. */
static const char *include_owner(const char *from_dir, const char *inc, char *buf, size_t n)
{
    if (!strncmp(inc, "tidal/", 6)) {
        for (size_t i = 0; i < sizeof owners / sizeof owners[0]; i++)
            if (!strcmp(owners[i].header, inc + 6)) return owners[i].dir;
        return NULL;
    }
    /* Relative: resolve "../" against from_dir and keep the top folder. */
    char path[512];
    snprintf(path, sizeof path, "%s/%s", from_dir, inc);
    char *parts[64];
    int np = 0;
    for (char *save = NULL, *w = strtok_r(path, "/", &save); w && np < 64; w = strtok_r(NULL, "/", &save)) {
        if (!strcmp(w, "..")) { if (np) np--; }
        else if (strcmp(w, ".")) parts[np++] = w;
    }
    if (np >= 3 && !strcmp(parts[0], "include") && !strcmp(parts[1], "tidal")) {
        char pub[256];
        snprintf(pub, sizeof pub, "tidal/%s", parts[2]);
        return include_owner(from_dir, pub, buf, n);
    }
    snprintf(buf, n, "%s", np ? parts[0] : "");
    return buf;
}

static int is_gpu_header(const char *inc)
{
    return !strncmp(inc, "cuda", 4) || !strncmp(inc, "cublas", 6) || !strncmp(inc, "nccl", 4) ||
           !strncmp(inc, "cuda_", 5) || !strncmp(inc, "cuda/", 5);
}

static void check_file(const char *root, const char *rel_dir, const char *name, const char *folder, report *r)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", root, rel_dir, name);
    FILE *f = fopen(path, "r");
    if (!f) return;
    int me = layer_index(folder);
    int gpu_file = ends_with(name, "_cuda.c") || ends_with(name, "_nccl.c") || ends_with(name, ".cu") ||
                   ends_with(name, ".cuh");
    if (ends_with(name, ".cu") && strcmp(rel_dir, "model/cuda") && strcmp(folder, "optim"))
        note(r, "%s/%s: kernels live in model/cuda/ or optim/\n", rel_dir, name);
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        if (me >= 0) r->lines[me]++;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '#') continue;
        p++;
        while (*p == ' ' || *p == '\t') p++;
        if (strncmp(p, "include", 7)) continue;
        p += 7;
        while (*p == ' ' || *p == '\t') p++;
        char open = *p, close = open == '"' ? '"' : '>';
        if (open != '"' && open != '<') continue;
        const char *e = strchr(p + 1, close);
        if (!e) continue;
        char inc[512];
        snprintf(inc, sizeof inc, "%.*s", (int)(e - p - 1), p + 1);
        if (open == '<') {
            if (is_gpu_header(inc) && (!gpu_file || !strcmp(folder, "core") || !strcmp(folder, "memmgr")))
                note(r, "%s/%s includes <%s>: CUDA and NCCL headers belong in *_cuda.c, *_nccl.c or .cu files "
                        "(never in core/ or memmgr/)\n", rel_dir, name, inc);
            if (!strncmp(inc, "liburing", 8) && !ends_with(name, "_uring.c")) /* built only with URING=1 */
                note(r, "%s/%s includes <%s>: liburing belongs in *_uring.c files\n", rel_dir, name, inc);
            continue;
        }
        char buf[256];
        const char *own = include_owner(rel_dir, inc, buf, sizeof buf);
        if (!own) {
            note(r, "%s/%s includes \"%s\", a public header with no owner folder in test_layering.c's table\n",
                 rel_dir, name, inc);
            continue;
        }
        int them = layer_index(own);
        if (me < 0 || them < 0) continue; /* tests/, tools/: not layered */
        if (!may[me][them])
            note(r, "%s/%s includes \"%s\" of %s/, which %s/ may not use (it may use: %s)\n", rel_dir, name, inc,
                 own, folder, layers[me].uses[0] ? layers[me].uses : "nothing");
    }
    fclose(f);
}

/* Folders that must not branch on the family: all but model/, which owns
 * the families. */
static int is_blind(const char *folder) { return strcmp(folder, "model") != 0; }

/* The first family named on a line as a branch would name it, or NULL:
 * TD_MODEL_<NAME> (a family enum value), "<name>" on a line that compares
 * strings, or a literal name given to td_model_family_find /
 * td_model_desc_set_family. */
static const char *family_named(const char *line)
{
    int compares = strstr(line, "strcmp(") || strstr(line, "strncmp(") || strstr(line, "strcasecmp(");
    int looks_up = strstr(line, "td_model_family_find(\"") || strstr(line, "td_model_desc_set_family(") ;
    for (int i = 0; i < td_model_family_count(); i++) {
        const char *name = td_model_family_name(td_model_family_at(i));
        char upper[64] = "TD_MODEL_", quoted[64];
        size_t k = strlen(upper);
        for (const char *c = name; *c && k + 1 < sizeof upper; c++)
            upper[k++] = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
        upper[k] = '\0';
        snprintf(quoted, sizeof quoted, "\"%s\"", name);
        const char *u = strstr(line, upper);
        if (u && !((u[k] >= 'A' && u[k] <= 'Z') || (u[k] >= '0' && u[k] <= '9') || u[k] == '_')) return name;
        int tokenizer = 0; /* the tokenizer kinds' names are compared as such */
        for (int k = TD_TOKENIZER_BYTE; k <= TD_TOKENIZER_JSON; k++)
            tokenizer |= !strcmp(name, td_tokenizer_kind_name((td_tokenizer_kind)k));
        if (((compares && !tokenizer) || looks_up) && strstr(line, quoted)) return name;
    }
    return NULL;
}

static void check_family_blind(const char *root, const char *rel_dir, const char *name, report *r)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", root, rel_dir, name);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[2048];
    for (int no = 1; fgets(line, sizeof line, f); no++) {
        const char *fam = family_named(line);
        if (fam)
            note(r, "%s/%s:%d branches on the %s family; ask its table (tidal/family.h) instead\n", rel_dir, name, no,
                 fam);
    }
    fclose(f);
}

/* ---- headers named after their files ----------------------------------------- */

/* A function's name and the file that defines it (or the header that
 * declares it). */
typedef struct fn_site { char name[64], path[192]; } fn_site;
#define MAX_SITES 8192
static fn_site defs[MAX_SITES], decls[MAX_SITES];
static int n_defs, n_decls, n_matched; /* n_matched: declarations whose definition was found */

/* The function a line starts to define or declare: a line at column 0 that
 * is not static, a comment, a preprocessor line or a typedef, whose first
 * td_ identifier is followed by '(' (a call or a function pointer is
 * indented or behind a '(').  Writes the name to out; 0 when none. */
static int function_at(const char *line, char *out, size_t n)
{
    if (strchr(" \t#/*{}\n", line[0]) || !strncmp(line, "static", 6) || !strncmp(line, "typedef", 7) ||
        !strncmp(line, "extern const", 12) || !strncmp(line, "return", 6))
        return 0;
    for (const char *p = line; *p && *p != '(' && *p != '=' && *p != ';'; p++) {
        if (strncmp(p, "td_", 3) || (p > line && ((p[-1] >= 'a' && p[-1] <= 'z') || p[-1] == '_'))) continue;
        size_t k = 0;
        while ((p[k] >= 'a' && p[k] <= 'z') || (p[k] >= 'A' && p[k] <= 'Z') || (p[k] >= '0' && p[k] <= '9') ||
               p[k] == '_')
            k++;
        const char *q = p + k;
        while (*q == ' ') q++;
        if (*q != '(') { p += k - 1; continue; }
        snprintf(out, n, "%.*s", (int)k, p);
        return 1;
    }
    return 0;
}

static void collect_functions(const char *root, const char *rel_path, fn_site *sites, int *count)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root, rel_path);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[2048];
    int in_comment = 0;
    while (fgets(line, sizeof line, f)) {
        int starts_in_comment = in_comment;
        for (const char *c = line; *c; c++) {
            if (!in_comment && c[0] == '/' && c[1] == '*') in_comment = 1, c++;
            else if (in_comment && c[0] == '*' && c[1] == '/') in_comment = 0, c++;
        }
        char name[64];
        if (starts_in_comment || *count >= MAX_SITES || !function_at(line, name, sizeof name)) continue;
        snprintf(sites[*count].name, sizeof sites[*count].name, "%s", name);
        snprintf(sites[*count].path, sizeof sites[*count].path, "%s", rel_path);
        ++*count;
    }
    fclose(f);
}

static int starts_with(const char *s, const char *prefix) { return !strncmp(s, prefix, strlen(prefix)); }

/* Whether `path` (a source file) is a home of header stem `stem` owned by
 * folder `owner`. */
static int is_home(const char *stem, const char *owner, const char *path)
{
    char stems[2][64];
    snprintf(stems[0], sizeof stems[0], "%s", stem);
    snprintf(stems[1], sizeof stems[1], "%s", stem);
    int cuda = ends_with(stem, "_cuda");
    if (cuda) stems[1][strlen(stem) - 5] = '\0';
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char file[128];
    snprintf(file, sizeof file, "%s", base);
    char *dot = strchr(file, '.');
    if (dot) *dot = '\0';
    for (int i = 0; i < 2; i++) {
        char under[160], folder[160];
        snprintf(under, sizeof under, "%s_", stems[i]);
        snprintf(folder, sizeof folder, "/%s/", stems[i]);
        char slashed[256];
        snprintf(slashed, sizeof slashed, "/%s", path);
        if (!strcmp(file, stems[i]) || starts_with(file, under) || strstr(slashed, folder)) return 1;
    }
    char cuda_dir[96];
    snprintf(cuda_dir, sizeof cuda_dir, "%s/cuda/", owner);
    return cuda && starts_with(path, cuda_dir);
}

static void check_header_names(report *r)
{
    for (int i = 0; i < n_decls; i++) {
        const char *h = strrchr(decls[i].path, '/') + 1;
        char stem[64];
        snprintf(stem, sizeof stem, "%.*s", (int)(strlen(h) - 2), h);
        char inc[80], buf[64];
        snprintf(inc, sizeof inc, "tidal/%s", h);
        const char *own = include_owner("include", inc, buf, sizeof buf);
        for (int j = 0; own && j < n_defs; j++) {
            if (strcmp(defs[j].name, decls[i].name)) continue;
            n_matched++;
            if (!is_home(stem, own, defs[j].path))
                note(r, "%s declares %s, defined in %s: define it in %s.c or %s_*.c (or name the header after "
                        "its file)\n", decls[i].path, decls[i].name, defs[j].path, stem, stem);
        }
    }
}

/* ---- commands' main functions --------------------------------------------------- */

#define MAIN_MAX_LINES 80

/* Whether a line at column 0 starts a command's main function. */
static int is_main_line(const char *line)
{
    if (line[0] == ' ' || line[0] == '\t' || line[0] == '/' || line[0] == '#' || !strncmp(line, "static", 6)) return 0;
    if (!strncmp(line, "int main(", 9)) return 1;
    const char *p = strstr(line, "_main(");
    if (!p || strchr(line, ';')) return 0;
    return (strstr(line, "td_cli_") && strstr(line, "td_cli_") < p) || (strstr(line, "td_bench_") &&
                                                                          strstr(line, "td_bench_") < p);
}

static void check_main_lengths(const char *root, const char *rel_path, report *r)
{
    char path[2400];
    snprintf(path, sizeof path, "%s/%s", root, rel_path);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[2048], name[128] = "";
    int start = 0;
    for (int no = 1; fgets(line, sizeof line, f); no++) {
        if (!start && is_main_line(line)) {
            start = no;
            const char *open = strchr(line, '(');
            const char *b = open;
            while (b > line && b[-1] != ' ' && b[-1] != '*') b--;
            size_t n = (size_t)(open - b) < sizeof name - 1 ? (size_t)(open - b) : sizeof name - 1;
            memcpy(name, b, n);
            name[n] = '\0';
        } else if (start && !strncmp(line, "}", 1)) {
            if (no - start + 1 > MAIN_MAX_LINES)
                note(r, "%s:%d: %s is %d lines; a command's main function is at most %d (move its steps into "
                        "functions)\n", rel_path, start, name, no - start + 1, MAIN_MAX_LINES);
            start = 0;
        }
    }
    fclose(f);
}

static void walk(const char *root, const char *rel_dir, const char *folder, report *r)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root, rel_dir);
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char child[1024], full[2048];
        snprintf(child, sizeof child, "%s/%s", rel_dir, e->d_name);
        snprintf(full, sizeof full, "%s/%s", root, child);
        struct stat sb;
        if (stat(full, &sb)) continue;
        if (S_ISDIR(sb.st_mode)) walk(root, child, folder, r);
        else if (is_source(e->d_name)) {
            check_file(root, rel_dir, e->d_name, folder, r);
            if (is_blind(folder)) check_family_blind(root, rel_dir, e->d_name, r);
            if (ends_with(e->d_name, ".c") || ends_with(e->d_name, ".cu")) collect_functions(root, child, defs, &n_defs);
            if ((!strcmp(folder, "cli") || !strcmp(folder, "bench")) && ends_with(e->d_name, ".c"))
                check_main_lengths(root, child, r);
        }
    }
    closedir(d);
}

/* Public headers are checked as files of their owner folder. */
static void check_public_headers(const char *root, report *r)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/include/tidal", root);
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!ends_with(e->d_name, ".h")) continue;
        char inc[300], buf[64];
        snprintf(inc, sizeof inc, "tidal/%s", e->d_name);
        const char *own = include_owner("include", inc, buf, sizeof buf);
        if (!own) {
            note(r, "include/tidal/%s has no owner folder in test_layering.c's table\n", e->d_name);
            continue;
        }
        long saved = layer_index(own) >= 0 ? r->lines[layer_index(own)] : 0;
        check_file(root, "include/tidal", e->d_name, own, r);
        char rel[300];
        snprintf(rel, sizeof rel, "include/tidal/%s", e->d_name);
        collect_functions(root, rel, decls, &n_decls);
        if (layer_index(own) >= 0) r->lines[layer_index(own)] = saved; /* sizes count the folders' own files */
    }
    closedir(d);
}

static void check_tree(const char *root, report *r)
{
    memset(r, 0, sizeof *r);
    n_defs = n_decls = n_matched = 0;
    closure();
    for (int i = 0; i < N_LAYERS; i++) walk(root, layers[i].dir, layers[i].dir, r);
    check_public_headers(root, r);
    check_header_names(r);
}

/* ---- the real tree ---------------------------------------------------------- */

static const char *source_root(void)
{
    const char *env = getenv("TD_SOURCE_DIR");
    if (env && *env) return env;
    return ".";
}

static void test_tree_obeys_layers(void **state)
{
    (void)state;
    char probe[1024];
    snprintf(probe, sizeof probe, "%s/tests/test_layering.c", source_root());
    if (access(probe, R_OK)) fail_msg("run from the repository root or set TD_SOURCE_DIR (no %s)", probe);
    report r;
    check_tree(source_root(), &r);
    if (r.violations) fail_msg("%d layering violation(s):\n%s", r.violations, r.text);
    print_message("%d public functions found defined (of %d declarations)\n", n_matched, n_decls);
    assert_true(n_matched > 500); /* the header check saw the library's functions */
}

static void test_no_folder_over_30_percent(void **state)
{
    (void)state;
    report r;
    check_tree(source_root(), &r);
    long total = 0;
    for (int i = 0; i < N_LAYERS; i++) total += r.lines[i];
    assert_true(total > 10000); /* the tree was found */
    for (int i = 0; i < N_LAYERS; i++) {
        print_message("%-11s %6ld lines (%4.1f%%)\n", layers[i].dir, r.lines[i], 100.0 * (double)r.lines[i] / (double)total);
        if (r.lines[i] * 10 > total * 3)
            fail_msg("%s/ holds %ld of %ld C/CUDA lines (over 30%%): split it by concept", layers[i].dir, r.lines[i],
                     total);
    }
}

/* ---- the checker on trees made here ------------------------------------------ */

static char tmp_root[256];

static void put(const char *rel, const char *text)
{
    char path[512], dir[512];
    snprintf(path, sizeof path, "%s/%s", tmp_root, rel);
    snprintf(dir, sizeof dir, "%s", path);
    for (char *s = dir + strlen(tmp_root) + 1; *s; s++)
        if (*s == '/') { *s = '\0'; mkdir(dir, 0755); *s = '/'; }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void make_tree(void)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_layering_%d", (int)getpid());
    mkdir(tmp_root, 0755);
    put("include/tidal/status.h", "#include <stddef.h>\n");
    put("include/tidal/memmgr.h", "#include \"tidal/status.h\"\n");
    put("include/tidal/trainer.h", "#include \"tidal/memmgr.h\"\n");
    put("core/status.c", "#include \"tidal/status.h\"\n");
    put("memmgr/memmgr.c", "#include \"tidal/memmgr.h\"\n#include \"tidal/status.h\"\n");
    put("trainer/train.c", "#include \"tidal/trainer.h\"\n#include \"../memmgr/memmgr_impl.h\"\n");
}

static void remove_tree(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    assert_int_equal(system(cmd), 0);
}

static void test_checker_accepts_a_clean_tree(void **state)
{
    (void)state;
    make_tree();
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    if (r.violations) fail_msg("%s", r.text);
}

static void test_checker_reports_an_upward_include(void **state)
{
    (void)state;
    make_tree();
    put("memmgr/policy.c", "#include \"tidal/trainer.h\"\n");
    put("offload/arena.c", "#include \"../memmgr/memmgr_impl.h\"\n");
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 2);
    assert_non_null(strstr(r.text, "memmgr/policy.c includes \"tidal/trainer.h\" of trainer/"));
    assert_non_null(strstr(r.text, "offload/arena.c includes \"../memmgr/memmgr_impl.h\" of memmgr/"));
}

static void test_checker_reports_a_header_without_owner(void **state)
{
    (void)state;
    make_tree();
    put("include/tidal/newthing.h", "\n");
    put("core/util.c", "#include \"tidal/newthing.h\"\n");
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 2); /* the header itself and its use */
    assert_non_null(strstr(r.text, "include/tidal/newthing.h has no owner"));
}

static void test_checker_reports_cuda_outside_its_files(void **state)
{
    (void)state;
    make_tree();
    put("memmgr/prefetch.c", "#include <cuda_runtime.h>\n");
    put("memmgr/prefetch_cuda.c", "#include <cuda_runtime.h>\n");
    put("offload/backend_cuda.c", "#include <cuda_runtime.h>\n");
    put("trainer/step.cu", "\n");
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 3);
    assert_non_null(strstr(r.text, "memmgr/prefetch.c includes <cuda_runtime.h>"));
    assert_non_null(strstr(r.text, "memmgr/prefetch_cuda.c includes <cuda_runtime.h>"));
    assert_non_null(strstr(r.text, "trainer/step.cu: kernels live in model/cuda/ or optim/"));
}

static void test_checker_reports_family_branches(void **state)
{
    (void)state;
    make_tree();
    put("trainer/step.c", "if (d->family == TD_MODEL_LLAMA) run_llama();\n"
                          "if (!strcmp(type, \"llama\")) x = 1;\n"
                          "const td_model_family *f = td_model_family_find(\"qwen2\");\n"
                          "int n = TD_MODEL_GPT2_LIKE; /* another token */\n"
                          "printf(\"gpt2\\n\"); /* a name in a message is no branch */\n"
                          "if (!strcmp(tok_kind, \"gpt2\")) load_bpe(); /* nor the tokenizer's kind */\n");
    put("model/family_x.c", "if (d->family == TD_MODEL_LLAMA) return;\n"); /* model/ owns the families */
    put("checkpoint/ck.c", "td_model_desc_set_family(&d, \"gemma\");\n");
    put("optim/adam.c", "if (strcmp(model_type, \"qwen2\") == 0) decay = 0;\n"); /* below model/ too */
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 5);
    assert_non_null(strstr(r.text, "trainer/step.c:1 branches on the llama family"));
    assert_non_null(strstr(r.text, "optim/adam.c:1 branches on the qwen2 family"));
    assert_non_null(strstr(r.text, "trainer/step.c:2 branches on the llama family"));
    assert_non_null(strstr(r.text, "trainer/step.c:3 branches on the qwen2 family"));
    assert_non_null(strstr(r.text, "checkpoint/ck.c:1 branches on the gemma family"));
}

static void test_checker_reports_a_header_named_after_no_file(void **state)
{
    (void)state;
    make_tree();
    put("include/tidal/dtype.h", "/* td_dtype_name(x) in a comment */\n"
                                 "const char *td_dtype_name(int dt);\n"
                                 "int td_dtype_bytes(int dt);\n"
                                 "static inline int td_dtype_bits(int dt) { return 8 * td_dtype_bytes(dt); }\n");
    put("include/tidal/ops_cuda.h", "void td_ops_cuda_gelu(void);\nvoid td_ops_cuda_rope(void);\n"
                                    "void td_ops_cuda_norm(void);\n");
    put("core/util.c", "#include \"tidal/dtype.h\"\nconst char *td_dtype_name(int dt)\n{\n"
                       "    return td_dtype_bytes(dt) ? \"x\" : \"y\";\n}\n");
    put("core/dtype_table.c", "#include \"tidal/dtype.h\"\nint td_dtype_bytes(int dt) { return dt; }\n");
    put("model/cuda/gelu.cu", "extern \"C\" void td_ops_cuda_gelu(void) {}\n");
    put("model/ops_cuda_rope.c", "void td_ops_cuda_rope(void)\n{\n}\n");
    put("model/rotary_cuda.c", "void td_ops_cuda_norm(void)\n{\n}\n");
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 2);
    assert_non_null(strstr(r.text, "include/tidal/dtype.h declares td_dtype_name, defined in core/util.c"));
    assert_non_null(strstr(r.text, "include/tidal/ops_cuda.h declares td_ops_cuda_norm, defined in model/rotary_cuda.c"));
}

static void test_checker_reports_a_long_main(void **state)
{
    (void)state;
    make_tree();
    char text[8192] = "int td_cli_long_main(int argc, char **argv)\n{\n";
    for (int i = 0; i < MAIN_MAX_LINES - 2; i++) strcat(text, "    step();\n");
    strcat(text, "}\n\nint td_bench_short_main(int argc, char **argv)\n{\n    return 0;\n}\n"
                 "static int helper(void)\n{\n");
    for (int i = 0; i < 2 * MAIN_MAX_LINES; i++) strcat(text, "    step();\n");
    strcat(text, "}\n");
    put("cli/cli_long.c", text);   /* MAIN_MAX_LINES + 1 lines: one too many */
    put("bench/bench_x.c", text);
    put("trainer/train.c", text);  /* not a command */
    report r;
    check_tree(tmp_root, &r);
    remove_tree();
    assert_int_equal(r.violations, 2);
    assert_non_null(strstr(r.text, "cli/cli_long.c:1: td_cli_long_main is 81 lines"));
    assert_non_null(strstr(r.text, "bench/bench_x.c:1: td_cli_long_main is 81 lines"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tree_obeys_layers),
        cmocka_unit_test(test_no_folder_over_30_percent),
        cmocka_unit_test(test_checker_accepts_a_clean_tree),
        cmocka_unit_test(test_checker_reports_an_upward_include),
        cmocka_unit_test(test_checker_reports_a_header_without_owner),
        cmocka_unit_test(test_checker_reports_cuda_outside_its_files),
        cmocka_unit_test(test_checker_reports_family_branches),
        cmocka_unit_test(test_checker_reports_a_header_named_after_no_file),
        cmocka_unit_test(test_checker_reports_a_long_main),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
