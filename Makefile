# tidal — build, test, demo, install.  `make help` lists the targets.
#
# Switches (few, named for what they change):
#   CUDA=1        build the CUDA backend and kernels (default: on when a GPU answers `nvidia-smi -L`
#                 and nvcc is found; nvcc alone does not turn it on)
#   NCCL=0        build without the NCCL communicator (default: on with CUDA when nccl.h is found)
#   JEMALLOC=0    build without jemalloc (default: on when jemalloc.h is found, off with SANITIZE)
#   URING=0       disk I/O without io_uring, with pread/pwrite threads only (default: on when liburing is found)
#   CUDA_ARCH=... nvcc -gencode flags (default: sm_90a code, whose flash attention runs on wgmma,
#                 plus compute_80 PTX, portable to sm_80+)
#   SANITIZE=address,undefined   build into build-san/ with ASan/UBSan (CPU tests)
#   OPT=-O2       optimisation flags
#   WERROR=1      warnings are errors (CI sets it)
#   PREFIX=/usr/local  where `make install` puts the library, headers, tidal.pc and the command
#   FUZZ_SECONDS=60  how long `make fuzz` runs each libFuzzer target
#
# Builds use every core unless -j is given.  Objects of a CUDA and a CPU
# build live apart (build/obj-cuda/, build/obj-cpu/), and a change of flags
# rebuilds them, so switching CUDA=0 / CUDA=1 never mixes the two.

CC       ?= gcc
NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# CUDA kernels take most of a build's time: compile them when a GPU is there
# to run them (the driver answers), or when CUDA=1 asks.
ifeq ($(origin CUDA),undefined)
CUDA := $(if $(strip $(NVCC)),$(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU '),1,0),0)
endif
ifeq ($(CUDA),1)
ifeq ($(strip $(NVCC)),)
$(error CUDA=1 but nvcc was not found on PATH or in /usr/local/cuda/bin: install the CUDA Toolkit or set NVCC=/path/to/nvcc)
endif
endif
NPROC    := $(shell nproc 2>/dev/null || echo 2)
ifeq ($(filter -j%,$(MAKEFLAGS)),)
ifeq ($(filter-out 0 1,$(words $(MAKECMDGOALS))),)
# One goal (or none) and no -j: build on every core.  Several goals (`make
# clean all`) keep their order.
MAKEFLAGS += -j$(NPROC)
endif
endif
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80

OPT      ?= -O2
BUILD    := build
ifneq ($(strip $(SANITIZE)),)
BUILD    := build-san
OPT      := -O2 -g -fno-omit-frame-pointer -fsanitize=$(SANITIZE) -fno-sanitize-recover=all
endif
# Objects of each configuration in a folder of their own.
OBJ      := $(BUILD)/obj-$(if $(filter 1,$(CUDA)),cuda,cpu)

PKGS     := hwloc libcjson zlib
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
TEST_CFLAGS := $(shell pkg-config --cflags cmocka 2>/dev/null)
TEST_LIBS   := $(shell pkg-config --libs cmocka 2>/dev/null)

# -fPIC: the same objects make libtidal.a and libtidal.so.
CFLAGS   := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter $(OPT) -fPIC -fopenmp -pthread \
            -Iinclude -MMD -MP $(PKG_CFLAGS)
LDLIBS   := $(PKG_LIBS) -fopenmp -pthread -lm
NVFLAGS  := -std=c++17 -O3 $(CUDA_ARCH) -Iinclude -Xcompiler -fPIC,-Wall -MMD -MP
ifeq ($(WERROR),1)
CFLAGS   += -Werror
NVFLAGS  += -Werror all-warnings -Xcompiler -Werror
endif

ifeq ($(CUDA),1)
CFLAGS   += -DTD_HAVE_CUDA -I$(CUDA_HOME)/include
NVFLAGS  += -DTD_HAVE_CUDA
# .cu objects need the C++ runtime (static-init guards, exception personality) at link time.
LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lstdc++
endif

# NCCL: the communicator's *_nccl.c files, with CUDA, when nccl.h is found in
# NCCL_HOME (default: the CUDA toolkit) or the system include directory.
NCCL_HOME ?= $(CUDA_HOME)
ifeq ($(CUDA),1)
NCCL ?= $(if $(wildcard $(NCCL_HOME)/include/nccl.h /usr/include/nccl.h),1,0)
else
override NCCL := 0
endif
ifeq ($(NCCL),1)
CFLAGS   += -DTD_HAVE_NCCL -I$(NCCL_HOME)/include
LDLIBS   := -L$(NCCL_HOME)/lib64 -L$(NCCL_HOME)/lib -Wl,-rpath,$(NCCL_HOME)/lib64 -lnccl $(LDLIBS)
endif

# jemalloc: the process's allocator, whose statistics measure the host heap
# (offload/hostmem.c), when jemalloc.h is found; not in sanitizer or fuzz
# builds (ASan brings its own allocator).  Without it the heap is measured with
# glibc's mallinfo2, and `tidal train` says so.
ifeq ($(strip $(SANITIZE))$(findstring fsanitize,$(OPT)),)
JEMALLOC ?= $(if $(wildcard $(addsuffix /jemalloc/jemalloc.h,/usr/include /usr/local/include $(subst :, ,$(CPATH)))),1,0)
else
override JEMALLOC := 0
endif
ifeq ($(JEMALLOC),1)
CFLAGS   += -DTD_HAVE_JEMALLOC
LDLIBS   := $(LDLIBS) -ljemalloc
endif

# io_uring for the disk tier's I/O (offload/diskio_uring.c), when liburing
# is found; without it the engine runs pread/pwrite threads (the same results).
URING ?= $(if $(shell pkg-config --exists liburing 2>/dev/null && echo 1),1,$(if $(wildcard /usr/include/liburing.h),1,0))
ifeq ($(URING),1)
CFLAGS   += -DTD_HAVE_URING
LDLIBS   := $(LDLIBS) $(or $(shell pkg-config --libs liburing 2>/dev/null),-luring)
endif

# Library sources: every .c in the module folders (docs/architecture.md draws
# them and their direction); *_cuda.c and *.cu only with CUDA, *_nccl.c only with NCCL.
MODULES  := core offload parallel memmgr optim model model/cuda data checkpoint trainer cli
ALL_C    := $(filter-out cli/main.c $(if $(filter 1,$(NCCL)),,%_nccl.c) $(if $(filter 1,$(URING)),,%_uring.c),$(wildcard $(addsuffix /*.c,$(MODULES))))
ifeq ($(CUDA),1)
LIB_C    := $(ALL_C)
LIB_CU   := $(wildcard $(addsuffix /*.cu,$(MODULES)))
else
LIB_C    := $(filter-out %_cuda.c,$(ALL_C))
LIB_CU   :=
endif
LIB_OBJ  := $(LIB_C:%.c=$(OBJ)/%.o) $(LIB_CU:%.cu=$(OBJ)/%.cu.o)
# ar keeps members by file name: two sources of one name in two folders would
# silently replace each other in libtidal.a.
DUP_OBJ  := $(shell printf '%s\n' $(notdir $(LIB_OBJ)) | sort | uniq -d)
ifneq ($(strip $(DUP_OBJ)),)
$(error two library sources share an object name ($(DUP_OBJ)); rename one)
endif
# The model families: every model/family_<name>.c defines td_family_<name>,
# and the registry (model/family.c) lists them all (include/tidal/family.h).
FAMILIES := $(patsubst model/family_%.c,%,$(wildcard model/family_*.c))
$(OBJ)/model/family.o: CFLAGS += "-DTD_FAMILY_LIST=$(foreach f,$(FAMILIES),TD_FAMILY($(f)))"
$(OBJ)/model/family.o: $(wildcard model/family_*.c)
BENCH_C  := $(if $(filter 1,$(CUDA)),$(wildcard bench/*.c),$(filter-out %_cuda.c,$(wildcard bench/*.c)))
CLI_OBJ  := $(OBJ)/cli/main.o $(BENCH_C:%.c=$(OBJ)/%.o)

TESTS      := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
GPU_TESTS  := $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
TEST_OBJ   := $(patsubst %.c,$(OBJ)/%.o,$(wildcard tests/test_*.c tests/gpu/test_*.c tests/fuzz/fuzz_*.c))
TEST_SUPPORT := $(wildcard tests/support/*.c)
TEST_SUPPORT_OBJ := $(TEST_SUPPORT:%.c=$(OBJ)/%.o)

# Per-ISA flags: one definition, compiled once per instruction set.
$(OBJ)/%_avx512.o: CFLAGS += -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mavx2
$(OBJ)/%_avx2.o:   CFLAGS += -mavx2 -mfma -mf16c

# What the objects were compiled with, and what the programs were linked
# from: each file is rewritten only when it changes, so a change of flags
# recompiles and a switch of configuration relinks.
FLAGS_FILE := $(OBJ)/flags
LINK_FILE  := $(BUILD)/linked-from
ifeq ($(filter clean help,$(MAKECMDGOALS)),)
$(shell mkdir -p $(OBJ) && f='$(CC) $(CFLAGS) $(TEST_CFLAGS) $(NVCC) $(NVFLAGS)' && \
        [ "$$(cat $(FLAGS_FILE) 2>/dev/null)" = "$$f" ] || printf '%s\n' "$$f" > $(FLAGS_FILE))
$(shell l='$(OBJ) $(CC) $(LDLIBS) $(TEST_LIBS)' && \
        [ "$$(cat $(LINK_FILE) 2>/dev/null)" = "$$l" ] || printf '%s\n' "$$l" > $(LINK_FILE))
endif

.PHONY: all test gpu-test gpu-test-build gpu-memcheck bench-gpu demo deps clean help check-deps fuzz fuzz-build \
        install shared
all: $(BUILD)/tidal

help:
	@echo "make            build libtidal.a and the tidal command into $(BUILD)/"
	@echo "make demo       train a small GPT on the fortunes corpus (GPU if present, else CPU)"
	@echo "make test       all CPU tests (SANITIZE=address,undefined for ASan/UBSan)"
	@echo "make gpu-test   GPU tests (needs a CUDA device); fails when a test skips for hardware the machine has"
	@echo "make gpu-test-build  compile and link every GPU test without running it (CUDA=1 where no GPU is)"
	@echo "make gpu-memcheck  the GPU tests under compute-sanitizer memcheck"
	@echo "make bench-gpu  GPU benchmarks"
	@echo "make fuzz       each libFuzzer target in tests/fuzz/ for FUZZ_SECONDS (60) under ASan/UBSan"
	@echo "make install PREFIX=DIR  libtidal.so and .a, include/tidal, lib/pkgconfig/tidal.pc, bin/tidal"
	@echo "make deps       install missing system packages with apt-get"
	@echo "switches: CUDA=1  NCCL=0  JEMALLOC=0  URING=0  CUDA_ARCH=...  SANITIZE=...  OPT=...  WERROR=1  PREFIX=..."
	@echo "this machine: CUDA=$(CUDA) (objects in $(OBJ)/), -j$(NPROC)"

# --- dependencies -----------------------------------------------------------
deps:
	@./tools/deps.sh install
# Runs `make deps` by itself when a package is missing.
check-deps:
	@./tools/deps.sh check || ./tools/deps.sh install

# --- build -------------------------------------------------------------------
$(LIB_OBJ) $(CLI_OBJ) $(TEST_SUPPORT_OBJ) $(TEST_OBJ): $(FLAGS_FILE)

$(BUILD)/libtidal.a: $(LIB_OBJ) $(LINK_FILE)
	@mkdir -p $(@D)
	@rm -f $@
	ar rcs $@ $(LIB_OBJ)

$(BUILD)/tidal: $(CLI_OBJ) $(BUILD)/libtidal.a
	$(CC) $(CFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libtidal.a $(LDLIBS)

$(OBJ)/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) $(if $(filter tests/%,$<),$(TEST_CFLAGS) -Itests/support) -c $< -o $@

$(OBJ)/%.cu.o: %.cu
	@mkdir -p $(@D)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(BUILD)/tests/%: $(OBJ)/tests/%.o $(TEST_SUPPORT_OBJ) $(BUILD)/libtidal.a
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(TEST_SUPPORT_OBJ) $(BUILD)/libtidal.a $(TEST_LIBS) $(LDLIBS)

# test_hostpool's stand-in OpenCL vendor library (loaded only if something
# asks the ICD loader for platforms).
$(BUILD)/tests/test_hostpool: $(BUILD)/tests/libtd_fake_icd.so
$(BUILD)/tests/libtd_fake_icd.so: tests/support/icd/fake_icd.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -shared -fPIC -o $@ $<

# --- the shared library and `make install` -----------------------------------
# libtidal.so.$(SOVERSION): SOVERSION changes when the public API breaks.
SOVERSION := 0
VERSION   := 0.1.0
SONAME    := libtidal.so.$(SOVERSION)
PREFIX    ?= /usr/local
shared: $(BUILD)/$(SONAME)
$(BUILD)/$(SONAME): $(LIB_OBJ) $(LINK_FILE)
	$(CC) $(CFLAGS) -shared -Wl,-soname,$(SONAME) -Wl,--no-undefined -o $@ $(LIB_OBJ) $(LDLIBS)

# The pkg-config file: Libs for the shared library (jemalloc beside it when
# it is the process's allocator, so that it replaces malloc and its
# statistics measure the heap), Libs.private for a static link.
install: $(BUILD)/tidal $(BUILD)/libtidal.a $(BUILD)/$(SONAME)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include/tidal
	install -m 755 $(BUILD)/tidal $(DESTDIR)$(PREFIX)/bin/tidal
	install -m 644 $(BUILD)/libtidal.a $(DESTDIR)$(PREFIX)/lib/libtidal.a
	install -m 755 $(BUILD)/$(SONAME) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libtidal.so
	install -m 644 include/tidal/*.h $(DESTDIR)$(PREFIX)/include/tidal/
	printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$${prefix}/lib' 'includedir=$${prefix}/include' '' \
	  'Name: tidal' 'Description: trains transformer models larger than GPU memory' 'Version: $(VERSION)' \
	  'Cflags: -I$${includedir}' \
	  'Libs: -L$${libdir} -ltidal$(if $(filter 1,$(JEMALLOC)), -ljemalloc)' \
	  'Libs.private: $(LDLIBS)' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/tidal.pc

# --- test --------------------------------------------------------------------
# ASan needs the shadow gap unprotected for the CUDA runtime to initialise.
# OpenMP's idle threads sleep instead of spinning: the runner runs binaries
# side by side (TD_TEST_JOBS), whose spinning threads took each other's cores.
test: check-deps
	@$(MAKE) --no-print-directory CUDA=$(CUDA) $(BUILD)/tidal $(TESTS)
	@ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-passive} TD_BACKEND=cpu ./tests/run.sh $(TESTS)

# The backend-generic CPU tests run again on the cuda backend, beside tests/gpu/.
GENERIC_TESTS := $(filter $(addprefix $(BUILD)/tests/,test_arena test_copy test_fault test_hostpool test_memmgr),$(TESTS))
# tests/run.sh fails a test that skips for want of GPUs the machine has.
gpu-test: gpu-test-build
	@TD_BACKEND=cuda ./tests/run.sh $(GENERIC_TESTS) $(GPU_TESTS)

# Every GPU test compiled and linked, none run (CI does this without a GPU).
gpu-test-build:
	@[ "$(CUDA)" = 1 ] || { echo "make $@: needs the CUDA build: no GPU answered nvidia-smi -L; give CUDA=1 to compile for one anyway" >&2; exit 2; }
	@./tools/deps.sh check libs || ./tools/deps.sh install libs
	@$(MAKE) --no-print-directory CUDA=1 $(BUILD)/tidal $(GPU_TESTS) $(GENERIC_TESTS)

# The GPU tests under compute-sanitizer's memcheck: an error fails the binary.
# The tests provoke CUDA API errors on purpose (out of memory, bad handles),
# so only memory errors count; timing assertions are skipped.
gpu-memcheck: gpu-test-build
	@TD_BACKEND=cuda TD_TEST_NO_TIMING=1 \
	    TD_TEST_WRAP="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 97 --print-limit 20" \
	    ./tests/run.sh $(GENERIC_TESTS) $(GPU_TESTS)

bench-gpu:
	@./tools/deps.sh check libs || ./tools/deps.sh install libs
	@$(MAKE) --no-print-directory $(BUILD)/tidal
	./bench/bench-gpu.sh $(BUILD)/tidal

demo:
	@./tools/deps.sh check || ./tools/deps.sh install
	@$(MAKE) --no-print-directory $(BUILD)/tidal
	./tools/demo.sh $(BUILD)/tidal

# --- fuzz --------------------------------------------------------------------
# Every tests/fuzz/fuzz_*.c is a libFuzzer target.  The library is rebuilt
# with clang into its own folder (build-fuzz/, without CUDA: the parsers do
# not need it), instrumented for coverage and ASan/UBSan, so its objects never
# mix with build/ or build-san/.  tests/fuzz/run.sh runs each target on its
# seed corpus for FUZZ_SECONDS and fails on the first crash, leak or timeout.
FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang
FUZZ_BUILD   := build-fuzz
FUZZ_OPT     := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
                -fsanitize=fuzzer-no-link
FUZZ_SRC     := $(wildcard tests/fuzz/fuzz_*.c)
fuzz:
	@./tools/deps.sh check fuzz || ./tools/deps.sh install fuzz
	@$(MAKE) --no-print-directory CUDA=0 CC=$(FUZZ_CC) BUILD=$(FUZZ_BUILD) OPT="$(FUZZ_OPT)" fuzz-build
	@./tests/fuzz/run.sh $(FUZZ_SECONDS) $(patsubst tests/fuzz/%.c,$(FUZZ_BUILD)/tests/fuzz/%,$(FUZZ_SRC))

# Only meaningful inside `make fuzz` (which sets CC, BUILD and OPT).
fuzz-build: $(patsubst tests/fuzz/%.c,$(BUILD)/tests/fuzz/%,$(FUZZ_SRC))
.SECONDARY: $(patsubst tests/fuzz/%.c,$(OBJ)/tests/fuzz/%.o,$(FUZZ_SRC))

$(BUILD)/tests/fuzz/%: $(OBJ)/tests/fuzz/%.o $(BUILD)/libtidal.a
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -fsanitize=fuzzer -o $@ $< $(BUILD)/libtidal.a $(LDLIBS)

clean:
	rm -rf build build-san build-fuzz

-include $(shell find $(OBJ) -name '*.d' 2>/dev/null)
