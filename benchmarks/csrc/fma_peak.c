/*
 * The core's float32 FMA peak: UNROLL independent vector accumulators, each updated by one
 * fused multiply-add per iteration (named variables: an array would live in memory), in the widest vectors the compiler was told to use
 * (-march=native, 512-bit preferred on x86). Built by benchmarks/profile_prefill.py with
 * kvduplex/model/cpu_build.py, the flags the attention kernels get.
 */
#include <stdint.h>
#include <time.h>

#define UNROLL 12

typedef float vf __attribute__((vector_size(64)));

#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define INIT(i) vf a##i = (vf){} + (float)(i);
#define STEP(i) a##i = a##i * b + c;
#define SUM(i) + a##i[0]

/* GFLOP/s of `iters` iterations (2 FLOP per lane per FMA), in this thread's CPU time. */
double kvd_fma_gflops(int64_t iters) {
    const vf b = (vf){} + 0.999f, c = (vf){} + 1e-3f;
    EACH(INIT)
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (int64_t k = 0; k < iters; k++) {
        EACH(STEP)
        __asm__ volatile("" : "+v"(a0));
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    volatile float sink = 0.0f EACH(SUM);
    (void)sink;
    return (double)iters * UNROLL * (sizeof(vf) / sizeof(float)) * 2.0 / s / 1e9;
}
