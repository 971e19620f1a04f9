/* The replay behind `tidal bench adam --check-dir DIR`: runs tidal's whole
 * CPU optimizer path (loss scaling, global clipping over chunks, schedule,
 * fused AdamW) on inputs written by tests/gpu/adam_torch_check.py, and writes
 * the results back for the script to compare with torch.optim.AdamW. */
#ifndef TIDAL_BENCH_ADAM_CHECK_H
#define TIDAL_BENCH_ADAM_CHECK_H

#include "tidal/optim.h"

td_status td_adam_check_run(td_adam_cpu *cpu, const char *dir);

#endif
