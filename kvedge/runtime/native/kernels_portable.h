/* The portable C kernels of kvedge_cpu.c (included there when neither KV_AVX2 nor KV_NEON): the reference every
 * vector build is tested against, one channel at a time. */

/* quantize_row's sub-block: qv = round half to even of v * 127 / max|v|, its sum; returns the scale max|v| / 127 */
static inline float quantize_sub_block(const float *v, int8_t *qv, int *sum) {
    float amax = 0.f;
    int total = 0;
    for (int i = 0; i < SB; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < SB; i++) {
        qv[i] = (int8_t)nearbyintf(v[i] * id);
        total += qv[i];
    }
    *sum = total;
    return d;
}

/* row n of a quantized linear . one activation row (quantize_row's layout for the linear's width) */
static float qdot_one(const kv_linear *l, int n, const int8_t *xq, const float *sa, const float *c) {
    int nsb = l->k / SB;
    float y = 0.f;
    for (int sb = 0; sb < nsb; sb++) {
        int d = 0;
        if (tiled(l)) { /* activations in channel order */
            uint8_t v[SB];
            tile_lane(l, n, sb, v);
            if (l->sc16) { /* 6 bits: q - 32, each half of the sub-block times its own integer scale */
                int da = 0, db = 0;
                for (int e = 0; e < 16; e++) da += (v[e] - 32) * xq[sb * SB + e], db += (v[16 + e] - 32) * xq[sb * SB + 16 + e];
                int isum = q6_scale(l, n, sb, 0) * da + q6_scale(l, n, sb, 1) * db;
                y += (float)isum * sa[sb] * half_to_float(k_half(l, n, sb, Q6_D));
                continue;
            }
            for (int e = 0; e < SB; e++) d += v[e] * xq[sb * SB + e];
        } else { /* 8 bits: the activations' A and B halves (place_sub_block) */
            int pair = sb & ~1, lone = (pair + 1 == nsb);
            const int8_t *base = xq + pair * SB;
            const uint8_t *qq = l->q + (size_t)n * l->k + (size_t)sb * SB;
            int half = lone ? 16 : 32, off = lone ? 0 : (sb & 1) * 16, swap = off ? 16 : 0;
            for (int t = 0; t < 16; t++) d += qq[swap + t] * base[off + t] + qq[(16 ^ swap) + t] * base[half + off + t];
        }
        int slot = act_slot(sb, l->bits);
        float w = fig_scale(l, n, sb), mz = fig_min(l, n, sb);
        if (affine(l))
            y += w * (sa[slot] * (float)d) + mz * c[slot];
        else
            y += w * (sa[slot] * (float)d - mz * c[slot]);
    }
    return y;
}

static void qdot_rows(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                      const float *const *c, float *out) {
    for (int j = 0; j < rm; j++)
        for (int i = 0; i < ROWS; i++) out[j * ROWS + i] = qdot_one(l, n0 + i < l->n ? n0 + i : l->n - 1, xq[j], sa[j], c[j]);
}

static void qtile(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                  const float *const *c, float *out) {
    for (int j = 0; j < rm; j++)
        for (int i = 0; i < TILE; i++) out[j * TILE + i] = qdot_one(l, n0 + i, xq[j], sa[j], c[j]);
}
