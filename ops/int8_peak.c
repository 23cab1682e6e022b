/* The multiply-add peak of one core, to read kernel figures against (docs/speed.md).
 *
 *   gcc -O2 -mavx512f -mavx512vnni -mavx512vl -o /tmp/int8_peak ops/int8_peak.c && /tmp/int8_peak
 *
 * The clock comes from a chain of dependent integer adds (one a cycle); each peak from twelve
 * independent accumulators, enough to cover the instruction's latency. Run two at once to see
 * whether the machine's two CPUs are two cores (each keeps its rate) or one core's two threads. */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ONE(op, w, n) op " %%" w "14, %%" w "15, %%" w #n "\n\t"
#define TWELVE(op, w) ONE(op, w, 0) ONE(op, w, 1) ONE(op, w, 2) ONE(op, w, 3) ONE(op, w, 4) ONE(op, w, 5) \
  ONE(op, w, 6) ONE(op, w, 7) ONE(op, w, 8) ONE(op, w, 9) ONE(op, w, 10) ONE(op, w, 11)
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#define RATE(label, asm_text, per_op)                                               \
  do {                                                                               \
    const double start = now();                                                      \
    for (long i = 0; i < ROUNDS; ++i) __asm__ volatile(asm_text ::: CLOBBERS);       \
    const double cycles = (now() - start) * ghz * 1e9 / (12.0 * ROUNDS);            \
    printf("%-22s %.2f cycles each, %5.1f multiply-adds a cycle\n", label, cycles, per_op / cycles); \
  } while (0)

int main(void) {
  const long ADDS = 200000000, ROUNDS = 50000000;
  uint64_t x = 1;
  const double start = now();
  for (long i = 0; i < ADDS; ++i) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = 4.0 * ADDS / (now() - start) / 1e9;
  printf("clock ~%.2f GHz\n", ghz);
  RATE("vpdpbusd zmm (int8)", TWELVE("vpdpbusd", "zmm"), 64);
  RATE("vpdpbusd ymm (int8)", TWELVE("vpdpbusd", "ymm"), 32);
  RATE("vfmadd231ps zmm (fp32)", TWELVE("vfmadd231ps", "zmm"), 16);
  return 0;
}
