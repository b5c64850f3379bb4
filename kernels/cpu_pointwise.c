/* The CPU engine's bf16 element-wise stages, one pass each: rms_norm_ref, rotary_ref and
 * silu_and_mul_ref of kernels/reference.py.
 *
 * As torch ops each stage is 5-15 operators (a decode step of SmolLM2's 30 layers: ~900), each an
 * allocation, a dispatch and a parallel region over a few thousand values. Here each is one call
 * over the rows. The values are the references': computed in fp32 and rounded to bf16 wherever a
 * torch bf16 operator would round its result (round to nearest even), so an output differs from
 * the torch ops' only where their fp32 reductions or exp differ in the last fp32 bit and that
 * flips a bf16 rounding (rare; tests/kernels/test_cpu_pointwise.py bounds it to one bf16 step).
 *
 * Plain C (no torch headers: built in about a second by cpu_native.py); loops written so that the
 * compiler vectorizes them (-O3 -march=native). Strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x), branch-free so that a loop of it vectorizes: 2^n * p(r), r = x - n ln2, p of degree 6
 * (relative error ~1e-7, about fp32's rounding); clamped to exp(-87) .. exp(88). */
static inline float exp_f32(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f;
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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
    return p * two_n;
}

/* rms_norm_ref on rows of H: with `res` (may be NULL), x + res is rounded to bf16, written to
 * res_out (the next residual) and normalized; out = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))).
 * `h`: H floats of scratch. */
void rms_norm_bf16(const uint16_t *x, int64_t sx, const uint16_t *res, int64_t sr, const uint16_t *w, int64_t T,
                   int64_t H, float eps, uint16_t *out, int64_t so, uint16_t *res_out, int64_t sro, float *h) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * sx;
        if (res) {
            const uint16_t *rr = res + t * sr;
            uint16_t *ro = res_out + t * sro;
            for (int64_t d = 0; d < H; d++) {
                uint16_t s = f32_to_bf16(bf16_to_f32(xr[d]) + bf16_to_f32(rr[d]));
                ro[d] = s;
                h[d] = bf16_to_f32(s);
            }
        } else {
            for (int64_t d = 0; d < H; d++) h[d] = bf16_to_f32(xr[d]);
        }
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= H; d += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += h[d + j] * h[d + j];
        float ss = 0.0f;
        for (int j = 0; j < LANES; j++) ss += acc[j];
        for (; d < H; d++) ss += h[d] * h[d];
        float scale = 1.0f / sqrtf(ss / (float)H + eps);
        uint16_t *o = out + t * so;
        for (int64_t e = 0; e < H; e++) o[e] = f32_to_bf16(bf16_to_f32(w[e]) * round_bf16(h[e] * scale));
    }
}

/* rotary_ref (rotate-half) on [T, heads, D] rows: cos and sin (fp32 cache rows [cos | sin] of D/2
 * each, at the token's position) rounded to bf16 as the reference's .to(x.dtype); each output
 * bf16(bf16(x * cos) + bf16(rotated * sin)). x and out may not overlap. */
void rotary_bf16(const uint16_t *x, int64_t sxt, int64_t sxh, int64_t T, int64_t heads, int64_t D,
                 const int64_t *positions, const float *cos_sin, int64_t scs, uint16_t *out, int64_t sot,
                 int64_t soh) {
    const int64_t half = D / 2;
    float c[512], s[512];  /* D <= 1024 (the wrapper checks) */
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * scs;
        for (int64_t i = 0; i < half; i++) {
            c[i] = round_bf16(cs[i]);
            s[i] = round_bf16(cs[half + i]);
        }
        for (int64_t hd = 0; hd < heads; hd++) {
            const uint16_t *xr = x + t * sxt + hd * sxh;
            uint16_t *o = out + t * sot + hd * soh;
            for (int64_t i = 0; i < half; i++) {
                float x1 = bf16_to_f32(xr[i]), x2 = bf16_to_f32(xr[half + i]);
                o[i] = f32_to_bf16(round_bf16(x1 * c[i]) + round_bf16(-x2 * s[i]));
                o[half + i] = f32_to_bf16(round_bf16(x2 * c[i]) + round_bf16(x1 * s[i]));
            }
        }
    }
}

/* silu_and_mul_ref on rows [gate | up] of 2I: bf16(bf16(silu(gate)) * up). */
void silu_and_mul_bf16(const uint16_t *x, int64_t sx, int64_t T, int64_t I, uint16_t *out, int64_t so) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * sx, *u = g + I;
        uint16_t *o = out + t * so;
        for (int64_t i = 0; i < I; i++) {
            float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gv / (1.0f + exp_f32(-gv))) * bf16_to_f32(u[i]));
        }
    }
}
