/* wgmma.mma_async (sm_90a) for the flash kernels (flash.cu): the shapes they
 * use, with every accumulator register named (PTX takes them as a list):
 * one pattern per form (the macros below).  The instructions assemble only
 * for sm_90a, so the bodies exist only in that compile (elsewhere the flash
 * kernels never call them: flash.cu picks the mma.sync engine).
 *   wgmma_ss    D (64 x 64, fp32) = or += A B^T, A and B (64 x 16 and 64 x
 *               16, K-major) from shared memory through descriptors; acc 0
 *               overwrites D.
 *   wgmma_rs_t  D (64 x N) += A B, A (64 x 16) in registers (the layout of
 *               mma.sync's m16n8k16 A fragment in each warp), B (16 x N)
 *               from shared memory, MN-major (the transpose bit). */
#ifndef TIDAL_WGMMA_CUH
#define TIDAL_WGMMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace tdc {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TD_WGMMA 1

template <typename T> __device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int acc);
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_t(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db);

/* the accumulator operands d[0 .. 31] or d[0 .. 63], and their names in the instruction */
#define TD_WG_D8(i)                                                                                                    \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]),            \
        "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define TD_WG_D32 TD_WG_D8(0), TD_WG_D8(8), TD_WG_D8(16), TD_WG_D8(24)
#define TD_WG_D64 TD_WG_D32, TD_WG_D8(32), TD_WG_D8(40), TD_WG_D8(48), TD_WG_D8(56)
#define TD_WG_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TD_WG_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/* D (64 x 64) = or += A B^T, both from descriptors; the operand after the
 * 32 accumulators and the two descriptors is acc (%34) */
#define TD_WGMMA_SS(TYPE, PTX)                                                                                         \
    template <>                                                                                                        \
    __device__ __forceinline__ void wgmma_ss<TYPE>(float (&d)[32], uint64_t da, uint64_t db, int acc)                  \
    {                                                                                                                  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                      \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " TD_WG_R32                           \
                     ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                                  \
                     : TD_WG_D32                                                                                       \
                     : "l"(da), "l"(db), "r"(acc));                                                                    \
    }

/* D (64 x N) += A B, A in registers, B transposed: A's four registers, the
 * descriptor and the predicate's source follow the N/2 accumulators */
#define TD_WGMMA_RS(TYPE, PTX, N, DLIST, RLIST, TAIL, PRED)                                                            \
    template <>                                                                                                        \
    __device__ __forceinline__ void wgmma_rs_t<TYPE, N>(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db)        \
    {                                                                                                                  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " RLIST ", " TAIL                 \
                     ", p, 1, 1, 1;\n}\n"                                                                              \
                     : DLIST                                                                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                                   \
    }

TD_WGMMA_SS(__nv_bfloat16, "bf16")
TD_WGMMA_RS(__nv_bfloat16, "bf16", 64, TD_WG_D32, TD_WG_R32, "{%32, %33, %34, %35}, %36", "%37")
TD_WGMMA_RS(__nv_bfloat16, "bf16", 128, TD_WG_D64, TD_WG_R64, "{%64, %65, %66, %67}, %68", "%69")
TD_WGMMA_SS(__half, "f16")
TD_WGMMA_RS(__half, "f16", 64, TD_WG_D32, TD_WG_R32, "{%32, %33, %34, %35}, %36", "%37")
TD_WGMMA_RS(__half, "f16", 128, TD_WG_D64, TD_WG_R64, "{%64, %65, %66, %67}, %68", "%69")

#undef TD_WGMMA_RS
#undef TD_WGMMA_SS
#undef TD_WG_R64
#undef TD_WG_R32
#undef TD_WG_D64
#undef TD_WG_D32
#undef TD_WG_D8
#endif

} // namespace tdc

#endif
