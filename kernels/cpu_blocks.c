/* Linear layers over block-quantized weights on the CPU, float32 throughout (kernels/cpu_blocks.py).

   The weight [N, K] is stored in groups of 16 output rows (N is a multiple of 16), its values
   in blocks of 32 inputs sharing a scale (and an offset):
     Q4: q uint8 [N/16, K, 8]: for group g and input k, byte i holds row 16g + i in its low
         nibble and row 16g + i + 8 in its high one; d and m float32 [N/16, K/32, 16];
         value = (float)q * d + m;
     Q8: q int8 [N/16, K, 16], d float32 [N/16, K/32, 16]; value = (float)q * d.
   The values are rebuilt exactly as torch's float32 ops compute them (a multiply, then an add,
   each rounded: this file is compiled with -ffp-contract=off), so a layer multiplies by the
   very weights it was packed from.

   A group is unpacked into a float32 buffer [K, 16] of the calling thread (16 outputs side by
   side for each input), then every row of x runs through it as a small GEMM does: for each k,
   x[r, k] broadcast times the 16 weights into the row's accumulator of those 16 outputs. Each
   output y[r, n] is one chain over k in order (acc + x * w, the product and the sum each
   rounded: nothing here fuses), whatever the tile it falls
   in: a row's result depends neither on the batch size nor on its place in the batch. Threads
   split the groups (OpenMP, static). */

#include <stdint.h>
#include <stdlib.h>

#define QB 32 /* inputs sharing a scale */
#define G 16  /* outputs side by side in a group */
/* The kernel is written for AVX-512 (a 16-lane register holds a group's outputs) and for AVX2
   (two 8-lane registers hold them): each defines f32x16 and its few operations, and its own
   tile (their registers differ); the rest is shared. Built for a CPU with neither, the library
   says so (tq_block_isa) and its layers stay float32. Both builds round each product and each sum in the same order, so they give
   the same bits (tests/kernels/test_cpu_blocks.py compares them on an AVX-512 machine). */
#if defined(__AVX512F__) || defined(__AVX2__)
#define TQ_KERNEL 1
#include <immintrin.h>
#endif

#ifdef __AVX512F__
/* a tile: up to ROWS rows of x against up to UNIT groups (64 outputs), 24 accumulators of
   AVX-512's 32 registers; the threads split the weight in units of UNIT groups */
#define ROWS 6
#define UNIT 4

int tq_block_isa(void) { return 512; }

typedef float f32x16 __attribute__((vector_size(64))); /* a group's 16 outputs */

static inline f32x16 i8_f32(__m128i v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
static inline f32x16 u8_f32(__m128i v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

static inline f32x16 load16(const float* p) {
    f32x16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float* p, f32x16 v) { __builtin_memcpy(p, &v, sizeof v); }

static inline f32x16 mul16(f32x16 a, f32x16 b) { return a * b; }
static inline f32x16 add16(f32x16 a, f32x16 b) { return a + b; }

/* R rows of x (R <= ROWS) against NG (<= UNIT) unpacked groups, both compile-time constants
   where inlined (the accumulators then stay in registers: at most 24 of the 32):
   y[r, 16j + i] = sum over c in order of x[r, c] * wt[j][c, i] */
static inline __attribute__((always_inline)) void tile(const float* x, int64_t ldx,
                                                       const float* wt, int64_t k, float* y,
                                                       int64_t ldy, const int R, const int NG) {
    f32x16 acc[ROWS][UNIT];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++) acc[r][j] = (f32x16){0};
    for (int64_t c = 0; c < k; c++) {
        f32x16 w[UNIT];
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++) w[j] = load16(wt + (j * k + c) * G);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float xv = x[r * ldx + c];
#pragma GCC unroll 4
            for (int j = 0; j < NG; j++) acc[r][j] += xv * w[j];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++) store16(y + r * ldy + j * G, acc[r][j]);
}

#elif defined(TQ_KERNEL) /* AVX2 */
/* a tile: up to ROWS rows of x against up to UNIT groups (32 outputs): 12 accumulators of
   AVX2's 16 registers, the weights read from L1 by the multiplies */
#define ROWS 3
#define UNIT 2

int tq_block_isa(void) { return 256; }

/* a group's 16 outputs: rows 0-7, then 8-15 */
typedef struct {
    __m256 lo, hi;
} f32x16;

static inline f32x16 pair(__m256 lo, __m256 hi) { return (f32x16){lo, hi}; }
static inline f32x16 i8_f32(__m128i v) {
    return pair(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}
static inline f32x16 u8_f32(__m128i v) {
    return pair(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
static inline f32x16 load16(const float* p) { return pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void store16(float* p, f32x16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline f32x16 mul16(f32x16 a, f32x16 b) { return pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline f32x16 add16(f32x16 a, f32x16 b) { return pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }

/* as the AVX-512 build's tile, each group's 16 outputs in two registers: y[r, 16j + i] = sum
   over c in order of x[r, c] * wt[j][c, i], a multiply and an add per c, each rounded (as the
   AVX-512 build's: a fused multiply-add would round once and give other bits). The arrays
   are sized for tile_rows' largest cases (never called here: R <= ROWS, NG <= UNIT) */
static inline __attribute__((always_inline)) void tile(const float* x, int64_t ldx,
                                                       const float* wt, int64_t k, float* y,
                                                       int64_t ldy, const int R, const int NG) {
    __m256 acc[6][4][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c++) {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + c);
#pragma GCC unroll 4
            for (int j = 0; j < NG; j++) {
                const float* w = wt + (j * k + c) * G;
                acc[r][j][0] = _mm256_add_ps(acc[r][j][0], _mm256_mul_ps(xv, _mm256_loadu_ps(w)));
                acc[r][j][1] = _mm256_add_ps(acc[r][j][1], _mm256_mul_ps(xv, _mm256_loadu_ps(w + 8)));
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++) {
            _mm256_storeu_ps(y + r * ldy + j * G, acc[r][j][0]);
            _mm256_storeu_ps(y + r * ldy + j * G + 8, acc[r][j][1]);
        }
}
#endif

#ifdef TQ_KERNEL
/* group g's weights as wt [k, 16], each value a multiply, then an add, each rounded (as
   torch's ops) */
static void unpack_group(int fmt, const void* q, const float* d, const float* m, int64_t k,
                         int64_t g, float* wt) {
    const int64_t blocks = k / QB;
    const float* dg = d + g * blocks * G;
    if (fmt == 4) {
        const uint8_t* qg = (const uint8_t*)q + g * k * (G / 2);
        const float* mg = m + g * blocks * G;
        const __m128i nibble = _mm_set1_epi8(15);
        for (int64_t b = 0; b < blocks; b++) {
            const f32x16 db = load16(dg + b * G), mb = load16(mg + b * G);
            for (int64_t c = b * QB; c < (b + 1) * QB; c++) {
                /* 8 bytes: low nibbles are rows 0-7, high nibbles rows 8-15 */
                const __m128i raw = _mm_loadl_epi64((const __m128i*)(qg + c * (G / 2)));
                const __m128i lo = _mm_and_si128(raw, nibble);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
                const __m128i codes = _mm_unpacklo_epi64(lo, hi);
                store16(wt + c * G, add16(mul16(u8_f32(codes), db), mb));
            }
        }
    } else {
        const int8_t* qg = (const int8_t*)q + g * k * G;
        for (int64_t b = 0; b < blocks; b++) {
            const f32x16 db = load16(dg + b * G);
            for (int64_t c = b * QB; c < (b + 1) * QB; c++) {
                const __m128i codes = _mm_loadu_si128((const __m128i*)(qg + c * G));
                store16(wt + c * G, mul16(i8_f32(codes), db));
            }
        }
    }
}

/* R rows against ng groups, with R and ng as constants */
static void tile_rows(const float* x, int64_t ldx, const float* wt, int ng, int64_t k, float* y,
                      int64_t ldy, int R) {
#define NGS(R)                                                                              \
    switch (ng) {                                                                           \
    case 4: tile(x, ldx, wt, k, y, ldy, R, 4); break;                                      \
    case 3: tile(x, ldx, wt, k, y, ldy, R, 3); break;                                      \
    case 2: tile(x, ldx, wt, k, y, ldy, R, 2); break;                                      \
    default: tile(x, ldx, wt, k, y, ldy, R, 1); break;                                     \
    }
    switch (R) {
    case 6: NGS(6); break;
    case 5: NGS(5); break;
    case 4: NGS(4); break;
    case 3: NGS(3); break;
    case 2: NGS(2); break;
    default: NGS(1); break;
    }
#undef NGS
}

/* every row of x against the ng groups unpacked in wt */
static void rows_against(const float* x, int64_t rows, int64_t ldx, const float* wt, int ng,
                         int64_t k, float* y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        const int R = (int)(rows - r < ROWS ? rows - r : ROWS);
        tile_rows(x + r * ldx, ldx, wt, ng, k, y + r * ldy, ldy, R);
    }
}

/* y [rows, n] (row stride ldy) = x [rows, k] (row stride ldx) times the block weight [n, k]^T.
   n is a multiple of 16, k of 32. Returns 0, -1 when a thread's buffer cannot be had, -2 when
   built without AVX-512 or AVX2. */
int tq_block_linear(int fmt, const float* x, int64_t rows, int64_t k, int64_t ldx, const void* q,
                    const float* d, const float* m, int64_t n, float* y, int64_t ldy,
                    int threads) {
    const int64_t groups = n / G, units = (groups + UNIT - 1) / UNIT;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float* wt = aligned_alloc(64, (size_t)(UNIT * k * G * sizeof(float)));
        if (wt == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (wt == NULL) continue;
            const int64_t g0 = u * UNIT;
            const int ng = (int)(groups - g0 < UNIT ? groups - g0 : UNIT);
            for (int j = 0; j < ng; j++) unpack_group(fmt, q, d, m, k, g0 + j, wt + j * k * G);
            rows_against(x, rows, ldx, wt, ng, k, y + g0 * G, ldy);
        }
        free(wt);
    }
    return failed ? -1 : 0;
}

#else /* neither AVX-512 nor AVX2 */

int tq_block_isa(void) { return 0; }
int tq_block_linear(int fmt, const float* x, int64_t rows, int64_t k, int64_t ldx, const void* q,
                    const float* d, const float* m, int64_t n, float* y, int64_t ldy,
                    int threads) {
    return -2;
}

#endif
