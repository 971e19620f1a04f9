/* The help the documentation quotes is the help the command prints: every
 * fenced block of README.md and the docs/ pages whose first line is
 * "$ tidal ... --help" must hold, line for line, what that command prints
 * on stdout, so a changed option cannot leave a stale copy behind.  Runs
 * the command of the same build (env TIDAL, else ./build/tidal). */
#include "td_test.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *run(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    for (size_t got; (got = fread(out + n, 1, cap - n - 1, p)) > 0;) {
        n += got;
        if (n + 1 == cap) out = realloc(out, cap *= 2);
        assert_non_null(out);
    }
    out[n] = '\0';
    pclose(p);
    return out;
}

/* The first line where a and b differ (1-based), 0 when equal. */
static int first_difference(const char *a, const char *b, char *what, size_t n)
{
    for (int line = 1;; line++) {
        const char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
        size_t la = ea ? (size_t)(ea - a) : strlen(a), lb = eb ? (size_t)(eb - b) : strlen(b);
        if (la != lb || memcmp(a, b, la)) {
            snprintf(what, n, "the doc has \"%.*s\", --help prints \"%.*s\"", (int)(la > 200 ? 200 : la), a,
                     (int)(lb > 200 ? 200 : lb), b);
            return line;
        }
        if (!ea || !eb) return ea || eb ? line + 1 : 0;
        a = ea + 1;
        b = eb + 1;
    }
}

/* Checks every quoted help block of one file; returns how many. */
static int check_file(const char *path, const char *tidal, int *bad)
{
    size_t len = 0;
    char *text = td_test_slurp(path, &len);
    int blocks = 0, line = 1;
    for (char *p = text; *p;) {
        char *eol = strchr(p, '\n');
        if (!eol) break;
        if (!strncmp(p, "```", 3) && !strncmp(eol + 1, "$ tidal ", 8)) {
            char *cmd_end = strchr(eol + 1, '\n');
            if (!cmd_end) break;
            char cmd[512];
            snprintf(cmd, sizeof cmd, "%.*s", (int)(cmd_end - (eol + 3)), eol + 3); /* after "$ " */
            char *body = cmd_end + 1, *close = strstr(body, "\n```");
            if (!close) break;
            size_t cl = strlen(cmd);
            if (cl < 7 || strcmp(cmd + cl - 7, " --help")) { /* a block of another command's output: not run */
                p = eol + 1;
                line++;
                continue;
            }
            char *want = strndup(body, (size_t)(close - body) + 1); /* with the last newline */
            char full[1200];
            snprintf(full, sizeof full, "%s%s 2>/dev/null", tidal, cmd + strlen("tidal"));
            char *got = run(full), what[600];
            int at = first_difference(want, got, what, sizeof what);
            if (at) {
                print_error("%s:%d: `%s` differs at its line %d: %s\n", path, line + 1, cmd, at, what);
                ++*bad;
            }
            blocks++;
            free(got);
            free(want);
            for (char *q = p; q < close + 4; q++) line += *q == '\n';
            p = close + 4;
            p = strchr(p, '\n') ? strchr(p, '\n') + 1 : p + strlen(p);
            line++;
            continue;
        }
        p = eol + 1;
        line++;
    }
    free(text);
    return blocks;
}

static void test_quoted_help_is_current(void **state)
{
    const char *tidal = td_test_tidal();
    int bad = 0, blocks = check_file("README.md", tidal, &bad);
    DIR *d = opendir("docs");
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 4 || strcmp(e->d_name + n - 3, ".md")) continue;
        char path[512];
        snprintf(path, sizeof path, "docs/%s", e->d_name);
        blocks += check_file(path, tidal, &bad);
    }
    closedir(d);
    print_message("%d quoted help blocks, %d stale\n", blocks, bad);
    assert_int_equal(bad, 0);
    assert_true(blocks >= 6); /* train, plan, tune, eval, generate, prepare at least */
}

/* The checker itself: a block that differs by one character is caught. */
static void test_checker_catches_a_difference(void **state)
{
    char what[600];
    assert_int_equal(first_difference("a\nb\nc\n", "a\nb\nc\n", what, sizeof what), 0);
    assert_int_equal(first_difference("a\nb\nc\n", "a\nB\nc\n", what, sizeof what), 2);
    assert_non_null(strstr(what, "\"b\""));
    assert_int_equal(first_difference("a\nb\n", "a\nb\nc\n", what, sizeof what), 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checker_catches_a_difference),
        cmocka_unit_test(test_quoted_help_is_current),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
