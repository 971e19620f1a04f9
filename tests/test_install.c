/* `make install PREFIX=DIR` gives a library others can build against: it
 * installs libtidal.so with its soname, libtidal.a, the public headers,
 * tidal.pc and the tidal command into a scratch folder; the program of
 * docs/api.md (taken from the doc itself, so the two cannot drift) builds
 * with `pkg-config --cflags --libs tidal` alone, links the shared library,
 * and trains on the cpu backend with its loss falling; every installed
 * header compiles in a C translation unit of its own; the installed command
 * runs.  The build is the tree's own configuration (CUDA, sanitizers). */
#include "td_proc.h"
#include "td_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmp[128];

#ifdef TD_HAVE_CUDA
#define MAKE_CONFIG "CUDA=1"
#else
#define MAKE_CONFIG "CUDA=0"
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SAN_FLAGS "-fsanitize=address,undefined"
#define MAKE_SAN " SANITIZE=address,undefined"
#else
#define SAN_FLAGS ""
#define MAKE_SAN ""
#endif

static int setup(void **state)
{
    (void)state;
    return td_proc_tmpdir(tmp, sizeof tmp, "tidal-install");
}

static int teardown(void **state)
{
    (void)state;
    return td_proc_rmdir(tmp);
}

/* Runs a shell command with its output into tmp/NAME.out; its exit status. */
static int sh(const char *name, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sh(const char *name, const char *fmt, ...)
{
    char cmd[4096], full[4400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(full, sizeof full, "( %s ) > %s/%s.out 2>&1", cmd, tmp, name);
    int rc = system(full);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static const char *output(const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s.out", tmp, name);
    return td_proc_slurp(path);
}

static void test_install_and_build_the_api_example(void **state)
{
    (void)state;
    /* the make of the test run may have left its jobserver in the environment */
    int rc = sh("install", "unset MAKEFLAGS MFLAGS MAKELEVEL; make --no-print-directory " MAKE_CONFIG MAKE_SAN
                " install PREFIX=%s/prefix", tmp);
    if (rc) fail_msg("make install: exit %d: %s", rc, output("install"));
    static const char *const files[] = {"lib/libtidal.so.0", "lib/libtidal.so", "lib/libtidal.a", "bin/tidal",
                                        "lib/pkgconfig/tidal.pc", "include/tidal/trainer.h", "include/tidal/status.h"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/prefix/%s", tmp, files[i]);
        if (access(path, R_OK)) fail_msg("make install left no %s", files[i]);
    }
    /* the soname, and the link to it */
    rc = sh("soname", "readelf -d %s/prefix/lib/libtidal.so.0 | grep SONAME && readlink %s/prefix/lib/libtidal.so", tmp,
            tmp);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(output("soname"), "[libtidal.so.0]"));
    assert_non_null(strstr(output("soname"), "libtidal.so.0\n"));

    /* docs/api.md's program, extracted: its first ```c block */
    rc = sh("extract", "awk '/^```c$/ { on = 1; next } on && /^```$/ { exit } on' docs/api.md > %s/train_small.c && "
            "grep -q td_trainer_create %s/train_small.c", tmp, tmp);
    if (rc) fail_msg("no C program in docs/api.md: %s", output("extract"));
    rc = sh("cc", "export PKG_CONFIG_PATH=%s/prefix/lib/pkgconfig; "
            "cc -std=c11 -Wall -Wextra -Werror " SAN_FLAGS " -o %s/train_small %s/train_small.c "
            "$(pkg-config --cflags --libs tidal)", tmp, tmp, tmp);
    if (rc) fail_msg("docs/api.md's program does not build against the installed library: %s", output("cc"));
    rc = sh("needed", "readelf -d %s/train_small | grep NEEDED", tmp);
    assert_int_equal(rc, 0);
    if (!strstr(output("needed"), "[libtidal.so.0]"))
        fail_msg("the program is not linked against the shared library: %s", output("needed"));
    rc = sh("run", "cd %s && LD_LIBRARY_PATH=%s/prefix/lib ASAN_OPTIONS=detect_leaks=1 ./train_small %s/saved", tmp,
            tmp, tmp);
    printf("%s", output("run"));
    if (rc) fail_msg("docs/api.md's program: exit %d: %s", rc, output("run"));
    const char *o = output("run");
    double first = 0, last = 0;
    const char *l = strstr(o, "loss ");
    while (l && strstr(l + 1, "\nloss ")) l = strstr(l + 1, "\nloss ") + 1;
    assert_non_null(l);
    assert_int_equal(sscanf(l, "loss %lf -> %lf", &first, &last), 2);
    assert_true(last < 0.9 * first); /* it learns */
    char path[512];
    snprintf(path, sizeof path, "%s/saved/model.safetensors", tmp);
    if (access(path, R_OK)) fail_msg("the program saved no model.safetensors");

    /* the installed command is the tree's */
    rc = sh("version", "%s/prefix/bin/tidal version", tmp);
    if (rc) fail_msg("installed tidal: exit %d: %s", rc, output("version"));
}

/* Each public header compiles alone as C11 from the installed folder: no
 * header leans on another being included first, none needs the source tree. */
static void test_installed_headers_stand_alone(void **state)
{
    (void)state;
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s/prefix", tmp);
    int rc = sh("headers", "cd %s/include/tidal && for h in *.h; do "
                "printf '#include <tidal/%%s>\\nint td_header_test_%%s;\\n' $h $(echo ${h%%.h} | tr -c 'a-z0-9\\n' _) "
                "> %s/h.c && cc -std=c11 -Wall -Wextra -Werror -I%s/include -fsyntax-only %s/h.c || "
                "{ echo \"FAILED $h\"; exit 1; }; done", prefix, tmp, prefix, tmp);
    if (rc) fail_msg("an installed header does not compile alone: %s", output("headers"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_install_and_build_the_api_example),
        cmocka_unit_test(test_installed_headers_stand_alone),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
