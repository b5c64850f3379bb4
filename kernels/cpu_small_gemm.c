/* A CPU step's bf16 linears straight from oneDNN's packed weight (cpu_small_gemm.py): a decode
   batch's few rows, and a prompt's many rows in a batch-invariant step (cpu_native.py).

   y[m][n] = bf16(sum_k x[m][k] * W[n][k]) for rows m < M, x and y bf16, fp32 accumulation.

   The weight is the tensor torch.ops.mkldnn._reorder_linear_weight made for this CPU's bf16
   GEMM (AVX512-BF16 without AMX): blocks of 64 output columns, one after the other, each holding
   every K pair of its columns as [K/2][64][2] bf16, the operand order of vdpbf16ps. A few rows
   against such a block is memory-bound: oneDNN's call on 1-8 rows reads it at about half the
   rate a plain loop can, and the few rows' loads, broadcasts and dot products fit in registers.

   Per 64-column block and up to four (or six) rows at a time, each K pair is one 256-byte load of the
   block (four zmm) and one dot product per row and zmm, summed in K order into an fp32
   accumulator per row and 16 columns, rounded once to bf16 (round to nearest even). oneDNN's
   brgemm sums the same products, mostly in the same order: where it splits K otherwise an output
   differs in its last fp32 bit, and at times by one bf16 step (cpu_small_gemm.py checks each
   weight's layout against oneDNN at load and leaves a weight it reads otherwise to oneDNN).
   Eight rows as two 32-column halves (one pass over the weight, 8 broadcasts a K pair) measured
   slower than two passes of four rows here: the second pass reads the block from L2.

   No torch headers: built by `cc -march=native` at start (kernels/cpu_native.py). Without
   AVX512-BF16 the entry point reports it cannot run and oneDNN serves every call. */

#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* Up to ROWS_MAX rows against one 64-column block: per K pair, four zmm of the block and one dot
   product per row and zmm. Each output's sum is its own accumulator's, over K in order, whatever
   the number of rows sharing the pass: a row's result does not depend on its neighbours. */
#define ROWS_MAX 6

static inline __attribute__((always_inline)) void block_rows(const uint16_t *x, int64_t x_stride, int rows, int64_t k_pairs,
                              const uint16_t *w, uint16_t *y, int64_t y_stride) {
    __m512 acc[ROWS_MAX][4];
    for (int r = 0; r < ROWS_MAX; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_ps();
    const uint32_t *xr[ROWS_MAX];
    for (int r = 0; r < ROWS_MAX; r++)
        xr[r] = (const uint32_t *)(x + (r < rows ? r : 0) * x_stride);
    for (int64_t p = 0; p < k_pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 128);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 128 + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + p * 128 + 64);
        const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + p * 128 + 96);
#pragma GCC unroll 6
        for (int r = 0; r < ROWS_MAX; r++) {
            if (r >= rows)
                break;
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + j * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

/* Column blocks [block_lo, block_hi) of y = x @ W^T, `group` (1-6) rows a pass over each block:
   four for a decode batch (two passes of four read the block from L2 faster than one of eight),
   six for a prompt's rows (the most accumulators the registers hold beside the block's four).
   Returns 0, or -1 where this build cannot run. */
int small_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *w,
                    uint16_t *y, int64_t y_stride, int64_t block_lo, int64_t block_hi, int64_t group) {
    const int64_t k_pairs = k / 2;
    if (group < 1 || group > ROWS_MAX)
        group = 4;
    for (int64_t b = block_lo; b < block_hi; b++) {
        const uint16_t *wb = w + b * 64 * k;
        for (int64_t r = 0; r < m; r += group) {
            const int rows = m - r < group ? (int)(m - r) : (int)group;
            const uint16_t *xb = x + r * x_stride;
            uint16_t *yb = y + r * y_stride + b * 64;
            switch (rows) {  /* each a copy with its row count fixed: the accumulators stay in registers */
            case 6: block_rows(xb, x_stride, 6, k_pairs, wb, yb, y_stride); break;
            case 5: block_rows(xb, x_stride, 5, k_pairs, wb, yb, y_stride); break;
            case 4: block_rows(xb, x_stride, 4, k_pairs, wb, yb, y_stride); break;
            case 3: block_rows(xb, x_stride, 3, k_pairs, wb, yb, y_stride); break;
            case 2: block_rows(xb, x_stride, 2, k_pairs, wb, yb, y_stride); break;
            default: block_rows(xb, x_stride, 1, k_pairs, wb, yb, y_stride); break;
            }
        }
    }
    return 0;
}

#else

int small_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *w,
                    uint16_t *y, int64_t y_stride, int64_t block_lo, int64_t block_hi, int64_t group) {
    (void)group; (void)x; (void)x_stride; (void)m; (void)k; (void)w; (void)y; (void)y_stride; (void)block_lo; (void)block_hi;
    return -1;
}

#endif
