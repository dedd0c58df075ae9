/* The aarch64 NEON kernels of kvedge_cpu.c (included there when KV_NEON): qdot_rows, qtile and the activations'
 * quantization over the layouts the file's head describes. Each computes the portable C path's integer sums
 * exactly and then the same float operations in the same order per row (vector lanes are IEEE operations
 * like scalar ones), so a build that contracts no multiply-add (-ffp-contract=off, as the emulated tests
 * build) returns the portable build's outputs bit for bit: tests/runtime/test_native_arm.py.
 *
 * Integer products by CPU: KV_DOTPROD (ARMv8.2 dot product: Cortex-A76, A78AE) sums 4 int8 products per int32
 * lane in one sdot; plain NEON (Cortex-A72) widens to int16 and adds pairs (a pair's sum stays within int16:
 * |w| <= 128, |x| <= 127). 8-bit weights are unsigned: KV_I8MM's usdot takes them as they are; otherwise they
 * are multiplied as the signed bytes u - 128 and 128 * sum(x) is added back. */

#include <arm_neon.h>

static inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if KV_DOTPROD
    return vdotq_s32(acc, w, x);
#else
    return vpadalq_s16(acc, vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)), vmull_high_s8(w, x)));
#endif
}

/* dot4 against x's int32 lane i (4 consecutive activations) broadcast to every lane */
#if KV_DOTPROD
#define DOT_LANE(acc, w, x, i) vdotq_laneq_s32((acc), (w), (x), (i))
#else
#define DOT_LANE(acc, w, x, i) dot4((acc), (w), vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), (i))))
#endif

/* the 16 unsigned weights u of w times the 16 activations x, summed */
static inline int dot_u8(uint8x16_t w, int8x16_t x) {
#if KV_I8MM
    return vaddvq_s32(vusdotq_s32(vdupq_n_s32(0), w, x));
#else
    int8x16_t s = vreinterpretq_s8_u8(veorq_u8(w, vdupq_n_u8(0x80))); /* u - 128 */
    return vaddvq_s32(dot4(vdupq_n_s32(0), s, x)) + 128 * vaddlvq_s8(x);
#endif
}

static inline float32x4_t u8x4_to_f32(const uint8_t *p) {
    uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(rd32(p)));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
}

static inline float32x4_t half4_to_f32(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

/* rows i .. i + 3 of a tile's scales (fig_scale) and mins or zero points (fig_min) of sub-block sb: a tile's
 * figures are [tile][sb][TILE], its rows side by side (a Q4_K tile's within its super-block's record) */
static inline void tile_figures(const kv_linear *l, int n0, int sb, int i, float32x4_t *w, float32x4_t *mz) {
    size_t f = fig_at(l, n0, sb) + i;
    if (l->ksc) {
        const uint8_t *r = k_rec(l, n0, sb);
        *w = vmulq_f32(half4_to_f32((const uint16_t *)(r + K_D) + i), u8x4_to_f32(r + K_SC + k_lane(n0, sb) + i));
        *mz = vnegq_f32(vmulq_f32(half4_to_f32((const uint16_t *)(r + K_DMIN) + i), u8x4_to_f32(r + K_MIN + k_lane(n0, sb) + i)));
        return;
    }
    *w = l->s32 ? vld1q_f32(l->s32 + f) : half4_to_f32(l->s + f);
    if (l->s32)
        *mz = vld1q_f32(l->mins32 + f);
    else if (l->mins)
        *mz = half4_to_f32(l->mins + f);
    else
        *mz = l->sym ? vdupq_n_f32(l->zsym) : u8x4_to_f32(l->z + f);
}

/* y += w * (sa * d) + mz * c (affine) or y += w * (sa * d - mz * c): the portable qdot_one's expression */
static inline float32x4_t fig_apply(int aff, float32x4_t y, int32x4_t d, float sa, float c, float32x4_t w,
                                    float32x4_t mz) {
    float32x4_t t = vmulq_n_f32(vcvtq_f32_s32(d), sa);
    return aff ? vaddq_f32(y, vaddq_f32(vmulq_f32(w, t), vmulq_n_f32(mz, c)))
               : vaddq_f32(y, vmulq_f32(w, vsubq_f32(t, vmulq_n_f32(mz, c))));
}

/* A tile of 8 rows of a 4-bit or 6-bit linear against rm (1 to TILE_RM) activation rows: lane r of the tile's vector v is
 * row r's channels 8 v + b (low nibbles) and 8 v + 4 + b (high nibbles), b = 0..3, so each half of a vector meets
 * one int32 lane of the activations: v's low nibbles lane 2 v % 4, its high ones the next. A 6-bit tile (Q6_K)
 * adds each value's high bits and takes q - 32 as signed bytes, each half sub-block times its int8 scale. */
static void qtile(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                  const float *const *c, float *out) {
    int nsb = l->k / SB, aff = affine(l), six = l->sc16 != NULL;
    const uint8_t *t = l->q + (size_t)(n0 / TILE) * nsb * tile_bytes(l);
    const uint8x16_t low = vdupq_n_u8(15);
    float32x4_t y[TILE_RM][2];
    for (int j = 0; j < rm; j++) y[j][0] = y[j][1] = vdupq_n_f32(0.f);
    for (int sb = 0; sb < nsb; sb++, t += tile_bytes(l)) {
        int8x16_t lo[8], hi[8]; /* [2 v + h]: vector v's rows 4 h .. 4 h + 3 */
        for (int e = 0; e < 8; e++) {
            uint8x16_t w = vld1q_u8(t + 16 * e), wl = vandq_u8(w, low), wh = vshrq_n_u8(w, 4);
            if (six) { /* the high bits (tile_lane), then q - 32: signed, as the dot products take them */
                uint8x16_t h = vld1q_u8(t + 128 + 16 * (e % 4));
                if (e >= 4) h = vshrq_n_u8(h, 4);
                wl = vsubq_u8(vorrq_u8(wl, vshlq_n_u8(vandq_u8(h, vdupq_n_u8(3)), 4)), vdupq_n_u8(32));
                wh = vsubq_u8(vorrq_u8(wh, vshlq_n_u8(vandq_u8(h, vdupq_n_u8(12)), 2)), vdupq_n_u8(32));
            }
            lo[e] = vreinterpretq_s8_u8(wl), hi[e] = vreinterpretq_s8_u8(wh);
        }
        if (six) {
            for (int j = 0; j < rm; j++) {
                int8x16_t x0 = vld1q_s8(xq[j] + sb * SB), x1 = vld1q_s8(xq[j] + sb * SB + 16);
                for (int h = 0; h < 2; h++) { /* rows 4 h ..: the first 16 channels (x0), the last 16 (x1) */
                    int32x4_t da = vdupq_n_s32(0), db = vdupq_n_s32(0);
                    da = DOT_LANE(da, lo[h], x0, 0), da = DOT_LANE(da, hi[h], x0, 1);
                    da = DOT_LANE(da, lo[2 + h], x0, 2), da = DOT_LANE(da, hi[2 + h], x0, 3);
                    db = DOT_LANE(db, lo[4 + h], x1, 0), db = DOT_LANE(db, hi[4 + h], x1, 1);
                    db = DOT_LANE(db, lo[6 + h], x1, 2), db = DOT_LANE(db, hi[6 + h], x1, 3);
                    const uint8_t *r = k_rec(l, n0, sb), *sc = r + Q6_SC + q6_lane(n0, sb, 0) + 4 * h;
                    int32x4_t sca = vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(rd32(sc))))));
                    int32x4_t scb = vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(rd32(sc + TILE))))));
                    int32x4_t isum = vaddq_s32(vmulq_s32(sca, da), vmulq_s32(scb, db));
                    float32x4_t t4 = vmulq_n_f32(vcvtq_f32_s32(isum), sa[j][sb]);
                    y[j][h] = vaddq_f32(y[j][h], vmulq_f32(t4, half4_to_f32((const uint16_t *)(r + Q6_D) + 4 * h)));
                }
            }
            continue;
        }
        float32x4_t w[2], mz[2];
        tile_figures(l, n0, sb, 0, &w[0], &mz[0]);
        tile_figures(l, n0, sb, 4, &w[1], &mz[1]);
        for (int j = 0; j < rm; j++) {
            int8x16_t x0 = vld1q_s8(xq[j] + sb * SB), x1 = vld1q_s8(xq[j] + sb * SB + 16);
            for (int h = 0; h < 2; h++) {
                int32x4_t d = vdupq_n_s32(0);
                d = DOT_LANE(d, lo[h], x0, 0), d = DOT_LANE(d, hi[h], x0, 1);
                d = DOT_LANE(d, lo[2 + h], x0, 2), d = DOT_LANE(d, hi[2 + h], x0, 3);
                d = DOT_LANE(d, lo[4 + h], x1, 0), d = DOT_LANE(d, hi[4 + h], x1, 1);
                d = DOT_LANE(d, lo[6 + h], x1, 2), d = DOT_LANE(d, hi[6 + h], x1, 3);
                y[j][h] = fig_apply(aff, y[j][h], d, sa[j][sb], c[j][sb], w[h], mz[h]);
            }
        }
    }
    for (int j = 0; j < rm; j++) vst1q_f32(out + j * TILE, y[j][0]), vst1q_f32(out + j * TILE + 4, y[j][1]);
}

/* ROWS rows of an 8-bit linear against rm (1 or 2) activation rows, each row's sub-block against the activations' A
 * and B halves (place_sub_block), the figures read as the portable path reads them */
static void qdot_rows(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                      const float *const *c, float *out) {
    int nsb = l->k / SB, aff = affine(l);
    for (int i = 0; i < ROWS; i++) {
        int n = n0 + i < l->n ? n0 + i : l->n - 1;
        const uint8_t *row = l->q + (size_t)n * l->k;
        float y[2] = {0.f, 0.f};
        for (int sb = 0; sb < nsb; sb++) {
            int pair = sb & ~1, lone = (pair + 1 == nsb), slot = act_slot(sb, l->bits);
            int half = lone ? 16 : 32, off = lone ? 0 : (sb & 1) * 16, swap = off ? 16 : 0;
            uint8x16_t wa = vld1q_u8(row + (size_t)sb * SB + swap), wb = vld1q_u8(row + (size_t)sb * SB + (16 ^ swap));
            float w = fig_scale(l, n, sb), mz = fig_min(l, n, sb);
            for (int j = 0; j < rm; j++) {
                const int8_t *base = xq[j] + pair * SB;
                int d = dot_u8(wa, vld1q_s8(base + off)) + dot_u8(wb, vld1q_s8(base + half + off));
                if (aff)
                    y[j] += w * (sa[j][slot] * (float)d) + mz * c[j][slot];
                else
                    y[j] += w * (sa[j][slot] * (float)d - mz * c[j][slot]);
            }
        }
        for (int j = 0; j < rm; j++) out[j * ROWS + i] = y[j];
    }
}

/* quantize_row's sub-block: qv = round half to even of v * 127 / max|v| (vcvtnq, as nearbyintf by default), its
 * sum and scale */
static inline float quantize_sub_block(const float *v, int8_t *qv, int *sum) {
    float32x4_t x[8], m = vdupq_n_f32(0.f);
    for (int i = 0; i < 8; i++) x[i] = vld1q_f32(v + 4 * i), m = vmaxq_f32(m, vabsq_f32(x[i]));
    float amax = vmaxvq_f32(m), id = amax > 0.f ? 127.f / amax : 0.f;
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < 8; i += 2) {
        int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(x[i], id)), b = vcvtnq_s32_f32(vmulq_n_f32(x[i + 1], id));
        s = vaddq_s32(s, vaddq_s32(a, b));
        vst1_s8(qv + 4 * i, vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(b))));
    }
    *sum = vaddvq_s32(s);
    return amax / 127.f;
}

/* e^x for x <= 0 (softmax after subtracting the max; SiLU's e^-|v|), lane for lane the AVX2 path's exp_neg:
 * 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-6 Taylor polynomial (relative error < 2e-7); x is clamped at -87
 * (e^-87 is 1.6e-38, float32's smallest normal) */
static inline float32x4_t exp_neg4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-87.f));
    float32x4_t t = vmulq_n_f32(x, 1.44269504088896341f), n = vrndnq_f32(t);
    float32x4_t f = vmulq_n_f32(vsubq_f32(t, n), 0.69314718055994531f); /* f ln2 */
    float32x4_t p = vdupq_n_f32(1.f / 720.f);
    static const float c[6] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    for (int i = 0; i < 6; i++) p = vfmaq_f32(vdupq_n_f32(c[i]), p, f);
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* v * sigmoid(v) for 4 values: sigmoid(v) = 1 / (1 + e) for v >= 0 and e / (1 + e) below, e = e^-|v| */
static inline float32x4_t silu4(float32x4_t v) {
    float32x4_t one = vdupq_n_f32(1.f), e = exp_neg4(vnegq_f32(vabsq_f32(v)));
    return vmulq_f32(v, vdivq_f32(vbslq_f32(vcltzq_f32(v), e, one), vaddq_f32(one, e)));
}
