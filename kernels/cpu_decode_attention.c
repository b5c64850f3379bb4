/* Paged decode attention over a bf16 KV cache, one query token per sequence, for the CPU engine.
 *
 * The math of paged_decode_attention_ref (kernels/reference.py) in fp32: scores q.k then * scale,
 * a softmax, the weighted sum of V; K and V are read straight from their cache blocks (no gathered
 * copy) and widened to fp32 one token at a time, and the query heads of one KV head share each
 * token's K and V. Sums run in a fixed order (16 lanes, then the lanes pairwise), so a result does
 * not depend on the batch it was computed in.
 *
 * Plain C (no torch headers: it compiles in about a second, cpu_native.py); loops written so that
 * the compiler vectorizes them for the build machine (-O3 -march=native). Requires D % 16 == 0.
 *
 * With AVX-512 the scores are computed 16 tokens at a time (decode_one_avx512): a score is a dot
 * product, 16 lanes of partial sums that must be added across the lanes, and adding each one's
 * lanes alone is more instructions than the multiplications; folding 16 of them together
 * (fold16) takes one add per score. The additions are the same ones in the same order as
 * lanes_sum's, and the weighted sum of V is the same multiplies and adds in the same order, so
 * both paths give the same bits. (ISO C, -std=c11, keeps a * b + c as two roundings, never a fused
 * multiply-add: the intrinsics path spells out the same two.)
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float lanes_sum(const float *a) {
    float s8[8], s4[4];
    for (int j = 0; j < 8; j++) s8[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
 * p of degree 6 (relative error ~1e-7, about fp32's rounding); below -87 it is 0. Branch-free and
 * without library calls (n rounded by the 1.5 * 2^23 trick), so a loop of it vectorizes. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f;
    float xc = x < -87.0f ? -87.0f : x;
    float n = (xc * log2e + round_magic) - round_magic;
    float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* One cache row (a token's Hkv heads of D) widened to fp32: dst [Hkv, D] contiguous. */
static inline void widen_row(const uint16_t *src, int64_t c_sh, int64_t Hkv, int64_t D, float *restrict dst) {
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t d = 0; d < D; d++) dst[h * D + d] = bf16_to_f32(src[h * c_sh + d]);
}

/* Prefetch a token's row (Hkv heads of D bf16) of a block ahead: blocks of one layer lie far apart
 * in the cache (a block holds every layer), so each block starts on new pages that the hardware
 * prefetcher does not enter; fetched a block early, the row is in cache when its turn comes. */
static inline void prefetch_row(const uint16_t *src, int64_t c_sh, int64_t Hkv, int64_t D) {
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t d = 0; d < D; d += 32) __builtin_prefetch(src + h * c_sh + d, 0, 3);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    float acc[LANES] = {0};
    for (int64_t d0 = 0; d0 < D; d0 += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[d0 + j] * b[d0 + j];
    return lanes_sum(acc);
}

/* Each of the Hq rows of s [Hq, L] (scaled scores) becomes its softmax, in place; both decode
   paths share it, so they keep the same bits. */
static inline void softmax_rows(float *s, int64_t Hq, int64_t L) {
    for (int64_t i = 0; i < Hq; i++) {
        float *si = s + i * L;
        float m = si[0];
        for (int64_t t = 1; t < L; t++) m = si[t] > m ? si[t] : m;
        for (int64_t t = 0; t < L; t++) si[t] = exp_nonpos(si[t] - m);
        float acc[LANES] = {0};
        int64_t t = 0;
        for (; t + LANES <= L; t += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += si[t + j];
        for (; t < L; t++) acc[t % LANES] += si[t];
        const float total = lanes_sum(acc);
        for (t = 0; t < L; t++) si[t] = si[t] / total;
    }
}

/* One sequence: q [Hq, D] bf16 (head stride q_sh), its block table and length; out [Hq, D] fp32.
 * Inlined with D constant where the caller can (D = 64), so the per-head loops unroll. */
static inline __attribute__((always_inline)) void decode_one(
    const uint16_t *q, int64_t q_sh, const uint16_t *k, const uint16_t *v, int64_t c_sblk, int64_t c_stok,
    int64_t c_sh, const int32_t *table, const int32_t *next_table, int64_t L, int64_t Hq, int64_t Hkv,
    const int64_t D, int64_t bs, float scale, float *out, float *scratch) {
    const int64_t G = Hq / Hkv;
    float *s = scratch;        /* [Hq, L] scores, then probabilities */
    float *qf = s + Hq * L;    /* [Hq, D] the queries in fp32 */
    float *row = qf + Hq * D;  /* [Hkv, D] one token's K or V in fp32 */
    for (int64_t i = 0; i < Hq; i++)
        for (int64_t d = 0; d < D; d++) qf[i * D + d] = bf16_to_f32(q[i * q_sh + d]);
    /* Token-major: each token's K (then V) row is read once for all heads; block by block. */
    for (int64_t blk = 0, t0 = 0; t0 < L; blk++, t0 += bs) {
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        const uint16_t *kb = k + (int64_t)table[blk] * c_sblk;
        const uint16_t *kn = t0 + bs < L ? k + (int64_t)table[blk + 1] * c_sblk : 0;
        for (int64_t j = 0; j < n; j++) {
            if (kn) prefetch_row(kn + j * c_stok, c_sh, Hkv, D);
            if (blk == 0) prefetch_row(v + (int64_t)table[0] * c_sblk + j * c_stok, c_sh, Hkv, D); /* V's first block */
            widen_row(kb + j * c_stok, c_sh, Hkv, D, row);
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t g = 0; g < G; g++)
                    s[(h * G + g) * L + t0 + j] = dot(qf + (h * G + g) * D, row + h * D, D) * scale;
        }
    }
    softmax_rows(s, Hq, L);
    memset(out, 0, sizeof(float) * Hq * D);
    for (int64_t blk = 0, t0 = 0; t0 < L; blk++, t0 += bs) {
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        const uint16_t *vb = v + (int64_t)table[blk] * c_sblk;
        const uint16_t *vn = t0 + bs < L ? v + (int64_t)table[blk + 1] * c_sblk : 0;
        for (int64_t j = 0; j < n; j++) {
            if (vn) prefetch_row(vn + j * c_stok, c_sh, Hkv, D);
            if (blk == 0 && next_table) /* the next sequence's first K block */
                prefetch_row(k + (int64_t)next_table[0] * c_sblk + j * c_stok, c_sh, Hkv, D);
            widen_row(vb + j * c_stok, c_sh, Hkv, D, row);
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[(h * G + g) * L + t0 + j];
                    const float *vr = row + h * D;
                    float *oi = out + (h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) oi[d] += p * vr[d];
                }
        }
    }
}

#if defined(__AVX512F__)
/* 16 bf16 values widened to fp32 (exact: a bf16 is the top half of an fp32). */
static inline __m512 widen16(const uint16_t *p) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* a[0..15], each 16 lanes of partial sums -> their 16 totals, each added up as lanes_sum adds one
 * vector (lanes j + j+8, then j + j+4, then (0 + 2) + (1 + 3)), two vectors at a time through
 * shuffles. Total i ends in lane (i % 4) * 4 + i / 4, a transpose that is its own inverse: a
 * caller that puts token (s % 4) * 4 + s / 4 in a[s] gets token t's total in lane t. */
static inline __m512 fold16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* lanes j + j+8: [x's 8 | y's 8] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* j + j+4 within each 8: four vectors' 4 each */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* (0 + 2), (1 + 3) within each 4 */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* Query heads per KV head (G) and D / 16 (C) this path takes; more fall back to decode_one. */
#define MAX_G 16
#define MAX_GC 32

/* decode_one's math, block by block and KV head by KV head (a block's rows stay in L1 across its
 * heads): the scores 16 tokens at a time, each token's K row widened once for the G query heads
 * of its KV head (their queries held in registers), folded 16 at a time; the weighted sum of V in
 * registers across a block. Scratch: s [Hq, L], qf [Hq, D]. Needs G <= MAX_G, G * D / 16 <= MAX_GC. */
static inline __attribute__((always_inline)) void decode_one_avx512(
    const uint16_t *q, int64_t q_sh, const uint16_t *k, const uint16_t *v, int64_t c_sblk, int64_t c_stok,
    int64_t c_sh, const int32_t *table, const int32_t *next_table, int64_t L, int64_t Hkv, const int64_t G,
    const int64_t D, int64_t bs, float scale, float *out, float *scratch) {
    const int64_t Hq = G * Hkv, C = D / LANES;
    float *s = scratch, *qf = s + Hq * L;
    for (int64_t i = 0; i < Hq; i++)
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(qf + i * D + c * LANES, widen16(q + i * q_sh + c * LANES));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t blk = 0, t0 = 0; t0 < L; blk++, t0 += bs) {
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        const uint16_t *kb = k + (int64_t)table[blk] * c_sblk;
        const uint16_t *kn = t0 + bs < L ? k + (int64_t)table[blk + 1] * c_sblk : 0;
        for (int64_t h = 0; h < Hkv; h++) {
            __m512 qr[MAX_GC];
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < C; c++) qr[g * C + c] = _mm512_loadu_ps(qf + (h * G + g) * D + c * LANES);
            for (int64_t j0 = 0; j0 < n; j0 += LANES) {
                const int64_t m = n - j0 < LANES ? n - j0 : LANES;
                __m512 a[MAX_G][LANES];
                for (int sl = 0; sl < LANES; sl++) {
                    const int64_t tok = (sl % 4) * 4 + sl / 4; /* fold16's lane order */
                    if (tok >= m) {
                        for (int64_t g = 0; g < G; g++) a[g][sl] = _mm512_setzero_ps();
                        continue;
                    }
                    const uint16_t *row = kb + (j0 + tok) * c_stok + h * c_sh;
                    if (kn && h == 0) prefetch_row(kn + (j0 + tok) * c_stok, c_sh, Hkv, D);
                    if (blk == 0 && h == 0) prefetch_row(v + (int64_t)table[0] * c_sblk + (j0 + tok) * c_stok, c_sh, Hkv, D);
                    __m512 kr[MAX_GC];
                    for (int64_t c = 0; c < C; c++) kr[c] = widen16(row + c * LANES);
                    for (int64_t g = 0; g < G; g++) {
                        __m512 acc = _mm512_setzero_ps();
                        for (int64_t c = 0; c < C; c++) acc = _mm512_add_ps(acc, _mm512_mul_ps(qr[g * C + c], kr[c]));
                        a[g][sl] = acc;
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    _mm512_mask_storeu_ps(s + (h * G + g) * L + t0 + j0, (__mmask16)((1u << m) - 1),
                                          _mm512_mul_ps(fold16(a[g]), vscale));
            }
        }
    }
    softmax_rows(s, Hq, L);
    for (int64_t h = 0; h < Hkv; h++) {
        __m512 acc[MAX_GC];
        for (int64_t i = 0; i < G * C; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t blk = 0, t0 = 0; t0 < L; blk++, t0 += bs) {
            const int64_t n = L - t0 < bs ? L - t0 : bs;
            const uint16_t *vb = v + (int64_t)table[blk] * c_sblk + h * c_sh;
            const uint16_t *vn = t0 + bs < L ? v + (int64_t)table[blk + 1] * c_sblk + h * c_sh : 0;
            for (int64_t j = 0; j < n; j++) {
                if (vn) prefetch_row(vn + j * c_stok, 0, 1, D);
                if (blk == 0 && h == Hkv - 1 && next_table) /* the next sequence's first K block */
                    prefetch_row(k + (int64_t)next_table[0] * c_sblk + j * c_stok, c_sh, Hkv, D);
                __m512 vr[MAX_GC];
                for (int64_t c = 0; c < C; c++) vr[c] = widen16(vb + j * c_stok + c * LANES);
                for (int64_t g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(s[(h * G + g) * L + t0 + j]);
                    for (int64_t c = 0; c < C; c++) acc[g * C + c] = _mm512_add_ps(acc[g * C + c], _mm512_mul_ps(p, vr[c]));
                }
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(out + (h * G + g) * D + c * LANES, acc[g * C + c]);
    }
}
#endif

/* q [B, Hq, D] bf16 (strides q_sb, q_sh; D contiguous); k, v: caches [blocks, block_size, Hkv, D]
 * bf16 with strides (c_sblk, c_stok, c_sh, 1), the same for both; tables [B, *] int32 (row stride
 * t_sb); lens [B] int32, tokens in cache incl. the current one; out [B, Hq, D] fp32 contiguous;
 * scratch: at least Hq * (max(lens) + D) + Hkv * D floats. Query head i reads KV head i / (Hq / Hkv). */
void paged_decode_bf16(const uint16_t *q, int64_t q_sb, int64_t q_sh, const uint16_t *k, const uint16_t *v,
                       int64_t c_sblk, int64_t c_stok, int64_t c_sh, const int32_t *tables, int64_t t_sb,
                       const int32_t *lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                       float *out, float *scratch) {
    for (int64_t b = 0; b < B; b++) {
        const int32_t *next = b + 1 < B ? tables + (b + 1) * t_sb : 0;
#if defined(__AVX512F__)
        const int64_t G = Hq / Hkv;
        if (G == 3 && D == 64) { /* SmolLM2's heads: constants, so the registers are allocated */
            decode_one_avx512(q + b * q_sb, q_sh, k, v, c_sblk, c_stok, c_sh, tables + b * t_sb, next, lens[b], Hkv,
                              3, 64, bs, scale, out + b * Hq * D, scratch);
            continue;
        }
        if (G <= MAX_G && G * (D / LANES) <= MAX_GC) {
            decode_one_avx512(q + b * q_sb, q_sh, k, v, c_sblk, c_stok, c_sh, tables + b * t_sb, next, lens[b], Hkv,
                              G, D, bs, scale, out + b * Hq * D, scratch);
            continue;
        }
#endif
        if (D == 64)
            decode_one(q + b * q_sb, q_sh, k, v, c_sblk, c_stok, c_sh, tables + b * t_sb, next, lens[b], Hq, Hkv, 64,
                       bs, scale, out + b * Hq * D, scratch);
        else
            decode_one(q + b * q_sb, q_sh, k, v, c_sblk, c_stok, c_sh, tables + b * t_sb, next, lens[b], Hq, Hkv, D,
                       bs, scale, out + b * Hq * D, scratch);
    }
}

/* kv_cache_write_ref for a bf16 cache: token t's K and V rows ([Hkv, D], strides (k_sh, 1) and
 * (v_sh, 1) from row strides k_st, v_st) copied to slot slots[t] of caches laid out as above;
 * slot -1 is skipped. The K and V inputs are views of the projection's output. */
void kv_write_bf16(const uint16_t *key, int64_t k_st, int64_t k_sh, const uint16_t *value, int64_t v_st,
                   int64_t v_sh, const int64_t *slots, int64_t T, uint16_t *k_cache, uint16_t *v_cache,
                   int64_t c_sblk, int64_t c_stok, int64_t c_sh, int64_t Hkv, int64_t D, int64_t bs) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t at = (slot / bs) * c_sblk + (slot % bs) * c_stok;
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(k_cache + at + h * c_sh, key + t * k_st + h * k_sh, (size_t)D * sizeof(uint16_t));
            memcpy(v_cache + at + h * c_sh, value + t * v_st + h * v_sh, (size_t)D * sizeof(uint16_t));
        }
    }
}
