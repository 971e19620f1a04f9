/* A stand-in OpenCL vendor library for test_hostpool: the ICD loader opens
 * it when something asks for the platforms, and loading it creates the file
 * that TD_FAKE_ICD_MARK names.  It offers no platform. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((constructor)) static void td_fake_icd_loaded(void)
{
    const char *mark = getenv("TD_FAKE_ICD_MARK");
    FILE *f = mark ? fopen(mark, "w") : NULL;
    if (f) fclose(f);
}
