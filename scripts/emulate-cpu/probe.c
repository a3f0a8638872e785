/* AVX-512 / VNNI probe for scripts/emulate-cpu.sh.
 *
 * Build: gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
 *            -o probe scripts/emulate-cpu/probe.c
 * Run:   scripts/emulate-cpu.sh -- ./probe [EXIT_CODE]
 *
 * Reads CPUID leaf 7 for AVX512F/BW/VL/VNNI (and leaf 7.1 for AVX-VNNI),
 * checks XCR0 has the opmask/ZMM state enabled by the OS, then executes a
 * real VPDPBUSD on zmm registers and checks the result against a scalar
 * reference. Exits 0 if all is well, 2 if a feature is missing, 3 if the
 * result is wrong; an optional argument overrides a passing exit code (to
 * test that exit statuses pass through the emulator). It also tries the VEX
 * (AVX-VNNI) form under a SIGILL guard and says whether it executes. */
#include <cpuid.h>
#include <immintrin.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static sigjmp_buf on_sigill;
static void sigill(int sig) { (void)sig; siglongjmp(on_sigill, 1); }

/* AVX-VNNI is the VEX form of VPDPBUSD (ymm). Bochs 2.7 decodes it but no
 * 2.7 CPU model sets its CPUID bit; report whether it executes anyway
 * (information only, it does not change the exit status). */
__attribute__((target("avx2")))
static void try_vex_vpdpbusd(void) {
    struct sigaction sa = {0}, old;
    sa.sa_handler = sigill;
    sigaction(SIGILL, &sa, &old);
    if (sigsetjmp(on_sigill, 1) == 0) {
        __m256i c = _mm256_set1_epi32(10);
        __m256i a = _mm256_set1_epi8(3);      /* unsigned */
        __m256i b = _mm256_set1_epi8(-2);     /* signed */
        __asm__ volatile("%{vex%} vpdpbusd %[b], %[a], %[c]"
                         : [c] "+x"(c) : [a] "x"(a), [b] "x"(b));
        int32_t out[8];
        _mm256_storeu_si256((__m256i *)out, c);
        printf("VEX vpdpbusd ymm (AVX-VNNI): executes, lane0=%d (expected %d)\n",
               out[0], 10 + 4 * 3 * -2);
    } else {
        printf("VEX vpdpbusd ymm (AVX-VNNI): #UD (SIGILL)\n");
    }
    sigaction(SIGILL, &old, NULL);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static int run_vpdpbusd(void) {
    uint8_t a[64];
    int8_t b[64];
    int32_t acc[16], out[16], want[16];
    for (int i = 0; i < 64; i++) {
        a[i] = (uint8_t)(200 + i);       /* unsigned bytes, up to 255 */
        b[i] = (int8_t)(i % 2 ? -(i + 1) : i + 1); /* signed bytes */
    }
    for (int j = 0; j < 16; j++) {
        acc[j] = 1000 * j;
        want[j] = acc[j];
        for (int k = 0; k < 4; k++)
            want[j] += (int32_t)a[4 * j + k] * (int32_t)b[4 * j + k];
    }
    __m512i va = _mm512_loadu_si512(a);
    __m512i vb = _mm512_loadu_si512(b);
    __m512i vc = _mm512_loadu_si512(acc);
    /* Inline asm so the instruction is certainly VPDPBUSD zmm (EVEX). */
    __asm__ volatile("vpdpbusd %[b], %[a], %[c]"
                     : [c] "+v"(vc)
                     : [a] "v"(va), [b] "v"(vb));
    _mm512_storeu_si512(out, vc);
    int bad = 0;
    printf("vpdpbusd zmm:");
    for (int j = 0; j < 16; j++) {
        printf(" %d", out[j]);
        if (out[j] != want[j]) bad++;
    }
    printf("\nexpected    :");
    for (int j = 0; j < 16; j++) printf(" %d", want[j]);
    printf("\nvpdpbusd result %s\n", bad ? "WRONG" : "OK");
    return bad;
}

int main(int argc, char **argv) {
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1,
        vnni = (c >> 11) & 1;
    unsigned max7 = a;
    int avxvnni = 0;
    if (max7 >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        avxvnni = (a >> 4) & 1;
    }
    __cpuid(1, a, b, c, d);
    int osxsave = (c >> 27) & 1;
    unsigned xcr0 = 0;
    if (osxsave) {
        unsigned hi;
        __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(hi) : "c"(0));
    }
    int zmm_os = (xcr0 & 0xe6) == 0xe6;
    printf("cpuid: avx512f=%d avx512bw=%d avx512vl=%d avx512_vnni=%d avx_vnni=%d\n",
           f, bw, vl, vnni, avxvnni);
    printf("xcr0=0x%x (opmask/zmm state enabled by OS: %d)\n", xcr0, zmm_os);
    fflush(stdout);
    if (!(f && bw && vl && vnni && zmm_os)) {
        printf("probe: AVX-512 VNNI not usable here\n");
        return 2;
    }
    if (run_vpdpbusd()) return 3;
    try_vex_vpdpbusd();
    fflush(stdout);
    return argc > 1 ? atoi(argv[1]) : 0;
}
