/*
 * The CPU's ISA level, read by CPUID at run time (kernels/cpu_build.py loads the kernels built
 * for it): 2 when it runs x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), 1 when it runs x86-64-v3
 * (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE), 0 on any other CPU. Built with no -march flag, so it
 * runs on every CPU the compiler targets.
 */
int kvgate_cpu_isa_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 2;
    if (__builtin_cpu_supports("x86-64-v3")) return 1;
#endif
    return 0;
}
