/* The x86 AVX2 kernels of kvedge_cpu.c (included there when KV_AVX2): quantize_sub_block, qdot_rows and qtile over
 * the layouts the file's head describes, with AVX-VNNI or AVX512-VNNI's dot products where the build has them. */

/* quantize_row's sub-block: qv = v * 127 / max|v| rounded (cvtps rounds half to even, as nearbyintf does by
 * default), its sum; returns the scale max|v| / 127 */
static inline float quantize_sub_block(const float *v, int8_t *qv, int *sum) {
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
           v3 = _mm256_loadu_ps(v + 24), sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    __m256 idv = _mm256_set1_ps(id);
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, idv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, idv));
    __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, idv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, idv));
    __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s1 = _mm_hadd_epi32(s1, s1);
    *sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s1, s1));
    /* to bytes: the packs leave each lane's dwords as [q0 q1 q2 q3] quarters; put them back in order */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)qv, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}

/* Without VNNI, 8-bit weights u are multiplied as the signed bytes u - 128: maddubs of |u - 128| and of s with
 * u - 128's sign, whose pair sums stay within int16 (2 * 128 * 127: activations are within [-127, 127]). Widening
 * both to 16 bits instead was slower at 8 rows (docs/benchmarks.md). The sums are then those of u - 128, so the
 * kernels take the zero point z - 128 (and an affine linear's min gains 128 scales). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KV_VNNI 1 /* dpbusd: u8 x s8 products summed 4 at a time into int32 */
#else
#define KV_VNNI 0
#endif
#define SIGNED8 (!KV_VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_ZMM 1 /* 512-bit registers for the tiles (tile_sums, qtile_w) */
#else
#define KV_ZMM 0
#endif

/* acc + the sums of each 4 adjacent products u * s (u unsigned bytes, s signed bytes; u less 128 under SIGNED8) */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); /* u - 128 (SIGNED8) */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w)),
                                                   _mm256_set1_epi16(1)));
#endif
}

static inline __m256 load_half8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }
static inline __m256 load_u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* The integer sums of the `have` (1..8) sub-blocks of a chunk of 8-bit weights, in kv_slot order, for rm
 * activation rows (a[j] + off): each weight byte is loaded once for all of them. A pair of sub-blocks makes two
 * weight vectors, A = [sb0 first 16 | sb1 last 16] (a blend) and B = [sb0 last 16 | sb1 first 16] (a swap),
 * whose lanes 0-3 hold the first sub-block's sums and 4-7 the second's: so one vector of sums covers two
 * sub-blocks and 3 horizontal adds reduce eight (converting and scaling every sub-block's own 8 lanes instead
 * was slower). */
static inline __attribute__((always_inline)) void chunk_sums(const int rm, const uint8_t *q, const int8_t *const *a,
                                                             size_t off, const int have, __m256i *r) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i p[2][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        int left = have - 2 * i;
        const uint8_t *qp = q + 64 * i; /* this pair's weight bytes */
        if (left >= 2) { /* a pair: lanes 0-3 the first sub-block's partial sums, lanes 4-7 the second's */
            __m256i b0 = _mm256_loadu_si256((const __m256i *)qp), b1 = _mm256_loadu_si256((const __m256i *)(qp + 32));
            __m256i wa = _mm256_blend_epi32(b0, b1, 0xF0), wb = _mm256_permute2x128_si256(b0, b1, 0x21);
            for (int j = 0; j < rm; j++) {
                const int8_t *aa = a[j] + off + 64 * i;
                p[j][i] = dot_u8s8(dot_u8s8(zero, wa, _mm256_loadu_si256((const __m256i *)aa)), wb,
                                   _mm256_loadu_si256((const __m256i *)(aa + 32)));
            }
        } else if (left == 1) { /* a lone last sub-block (activations [A, B]): lanes 0-3, 4-7 zero */
            __m256i w = _mm256_loadu_si256((const __m256i *)qp);
            for (int j = 0; j < rm; j++) {
                __m256i v = dot_u8s8(zero, w, _mm256_loadu_si256((const __m256i *)(a[j] + off + 64 * i)));
                p[j][i] = _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
            }
        } else {
            for (int j = 0; j < rm; j++) p[j][i] = zero;
        }
    }
    for (int j = 0; j < rm; j++)
        r[j] = _mm256_hadd_epi32(_mm256_hadd_epi32(p[j][0], p[j][1]), _mm256_hadd_epi32(p[j][2], p[j][3]));
}

/* out[j * ROWS + i] = row n0 + i of an 8-bit linear . activation row j, for i < ROWS (rows past the end repeat
 * the last) and j < rm (1 or 2: a second activation row reuses every weight load). aff (a constant): an affine
 * linear, whose mins add m * c instead of a zero point's -z * c term; 1 with float16 scales and mins (l->s,
 * l->mins), 2 with float32 ones (l->s32, l->mins32). */
static inline __attribute__((always_inline)) void qdot_rows_w(const int aff, const kv_linear *l, const int rm, int n0,
                                                              const int8_t *const *xq, const float *const *sa,
                                                              const float *const *c, float *out) {
    int nsb = l->k / SB, st = sub_stride(l->k);
    const uint8_t *q[ROWS];
    const uint16_t *sw[ROWS], *mr[ROWS];
    const float *sw32[ROWS], *mr32[ROWS];
    const uint8_t *zr[ROWS];
    __m256 acc[ROWS][2];
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; i++) {
        size_t row = (size_t)(n0 + i < l->n ? n0 + i : l->n - 1);
        q[i] = l->q + row * l->k;
        sw[i] = aff == 2 ? NULL : l->s + row * st;
        sw32[i] = aff == 2 ? l->s32 + row * st : NULL;
        zr[i] = aff || l->sym ? NULL : l->z + row * st;
        mr[i] = aff == 1 ? l->mins + row * st : NULL;
        mr32[i] = aff == 2 ? l->mins32 + row * st : NULL;
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    }
    const float z8 = SIGNED8 ? 128.f : 0.f; /* the sums' offset from u's (dot_u8s8) */
    const __m256 zs = _mm256_set1_ps(l->zsym - z8), z8v = _mm256_set1_ps(z8);
    for (int sb = 0; sb < nsb; sb += 8) {
        __m256 sav[2], cv[2];
        for (int j = 0; j < rm; j++) sav[j] = _mm256_loadu_ps(sa[j] + sb), cv[j] = _mm256_loadu_ps(c[j] + sb);
#pragma GCC unroll 4
        for (int i = 0; i < ROWS; i++) {
            __m256i r[2];
            if (sb + 8 <= nsb)
                chunk_sums(rm, q[i] + sb * SB, xq, (size_t)sb * SB, 8, r);
            else
                chunk_sums(rm, q[i] + sb * SB, xq, (size_t)sb * SB, nsb - sb, r);
            /* aff is a constant: the figures' width is chosen at compile time, not per chunk */
            __m256 w = aff == 2 ? _mm256_loadu_ps(sw32[i] + sb) : load_half8(sw[i] + sb);
            if (aff) {
                __m256 m = aff == 2 ? _mm256_loadu_ps(mr32[i] + sb) : load_half8(mr[i] + sb);
                if (z8 != 0.f) m = _mm256_fmadd_ps(z8v, w, m);
                for (int j = 0; j < rm; j++)
                    acc[i][j] = _mm256_fmadd_ps(m, cv[j], _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(r[j]),
                                                                                        sav[j]), w, acc[i][j]));
                continue;
            }
            __m256 z = zr[i] ? _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                 _mm_loadl_epi64((const __m128i *)(zr[i] + sb)))), z8v)
                             : zs;
            for (int j = 0; j < rm; j++) {
                __m256 t = _mm256_fnmadd_ps(z, cv[j], _mm256_mul_ps(_mm256_cvtepi32_ps(r[j]), sav[j]));
                acc[i][j] = _mm256_fmadd_ps(t, w, acc[i][j]);
            }
        }
    }
    for (int j = 0; j < rm; j++) { /* four rows' sums at once: lanes [0 1 2 3] of the two halves of h, added */
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][j], acc[1][j]), _mm256_hadd_ps(acc[2][j], acc[3][j]));
        _mm_storeu_ps(out + j * ROWS, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

/* The integer sums of a 4-bit tile's sub-block (its 128 bytes at q) against activation row j's 32 at xq[j] + off,
 * for j < rm. Each of the tile's 4 vectors gives a low and a high nibble vector, each multiplied by 4 activations
 * broadcast to all lanes. With AVX512-VNNI (tile_sums512: t[j], lanes i and 8 + i row i's), two vectors fill one
 * 512-bit register and a permute of the 32 activations puts each half's 4 in place: half the instructions a
 * weight byte, which bound prefill. Otherwise (tile_sums: d[j], lane i row i's) without VNNI: 8 maddubs pairs of
 * at most 2 * 15 * 127 each, added in int16 (within 8 * 3810), widened once. */
#if KV_ZMM
/* The sums of a tile sub-block's value vectors (l0, h0: its first 64 nibble bytes' low and high values; l1, h1:
 * the last 64's) against activation row a's 32: s0 from the first 16 channels, s1 from the last 16. A permute
 * puts the 4 activations each half of a 512-bit vector meets in place: [vector 2p | vector 2p + 1]. */
static inline void value_sums512(__m512i l0, __m512i h0, __m512i l1, __m512i h1, const int8_t *a, __m512i *s0,
                                 __m512i *s1) {
    const __m512i lo0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i hi0 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m512i lo1 = _mm512_add_epi32(lo0, _mm512_set1_epi32(4)), hi1 = _mm512_add_epi32(hi0, _mm512_set1_epi32(4));
    __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a));
    *s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, _mm512_permutexvar_epi32(lo0, x)), h0,
                              _mm512_permutexvar_epi32(hi0, x));
    *s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l1, _mm512_permutexvar_epi32(lo1, x)), h1,
                              _mm512_permutexvar_epi32(hi1, x));
}

static inline __attribute__((always_inline)) void tile_sums512(const int rm, const uint8_t *q, const int8_t *const *xq,
                                                               size_t off, __m512i *t) {
    const __m512i m = _mm512_set1_epi8(0x0F);
    __m512i b0 = _mm512_loadu_si512(q), b1 = _mm512_loadu_si512(q + 64);
    __m512i l0 = _mm512_and_si512(b0, m), h0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), m);
    __m512i l1 = _mm512_and_si512(b1, m), h1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), m);
    for (int j = 0; j < rm; j++) {
        __m512i s0, s1;
        value_sums512(l0, h0, l1, h1, xq[j] + off, &s0, &s1);
        t[j] = _mm512_add_epi32(s0, s1);
    }
}
#else
static inline __attribute__((always_inline)) void tile_sums(const int rm, const uint8_t *q, const int8_t *const *xq,
                                                            size_t off, __m256i *d) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < rm; j++) d[j] = _mm256_setzero_si256();
    /* two vectors at a time: unrolled by 4, GCC hoisted every vector's loads and unpacking ahead and spilled
     * registers at 3 and 4 activation rows (by 2, those ran faster; 1 and 2 rows ran alike) */
#pragma GCC unroll 2
    for (int v = 0; v < 4; v++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(q + 32 * v));
        __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
        for (int j = 0; j < rm; j++) {
            int32_t a0, a1; /* activations 8 v .. 8 v + 3 and 8 v + 4 .. 8 v + 7 of the sub-block */
            memcpy(&a0, xq[j] + off + 8 * v, 4), memcpy(&a1, xq[j] + off + 8 * v + 4, 4);
#if KV_VNNI
            d[j] = dot_u8s8(dot_u8s8(d[j], lo, _mm256_set1_epi32(a0)), hi, _mm256_set1_epi32(a1));
#else
            d[j] = _mm256_add_epi16(_mm256_add_epi16(d[j], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0))),
                                    _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)));
#endif
        }
    }
#if !KV_VNNI
    for (int j = 0; j < rm; j++) d[j] = _mm256_madd_epi16(d[j], _mm256_set1_epi16(1));
#endif
}
#endif

/* out[j * TILE + i] = row n0 + i (n0 a multiple of TILE) of a 4-bit linear . activation row j (channel order),
 * for i < TILE and j < rm (1 to TILE_RM, a constant, as aff: qdot_rows_w's): per sub-block, the TILE rows' integer
 * sums (tile_sums) scaled by its figures. */
static inline __attribute__((always_inline)) void qtile_w(const int aff, const int rm, const kv_linear *l, int n0,
                                                          const int8_t *const *xq, const float *const *sa,
                                                          const float *const *c, float *out) {
    const int nsb = l->k / SB;
    const size_t f0 = (size_t)(n0 / TILE) * nsb * TILE; /* this tile's figures */
    const uint8_t *q = l->q + (size_t)n0 * l->k / 2;
#if KV_ZMM
    /* two sub-blocks at a time, one per half of each 512-bit vector of figures (sb's then sb + 1's TILE rows: the
     * figures' order), so each figure instruction serves both; an odd last one has the upper half masked off
     * (its activation figures are the zero padding). Masked loads only there: in every iteration they slowed
     * decode. */
    const __m512 zs16 = _mm512_set1_ps(l->zsym);
    __m512 acc16[TILE_RM];
    for (int j = 0; j < rm; j++) acc16[j] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb += 2, q += 2 * 4 * 32) {
        const int two = sb + 1 < nsb;
        const __mmask16 mk = two ? 0xFFFF : 0x00FF;
        __m512i t0[TILE_RM], t1[TILE_RM];
        tile_sums512(rm, q, xq, (size_t)sb * SB, t0);
        if (two)
            tile_sums512(rm, q + 4 * 32, xq, (size_t)(sb + 1) * SB, t1);
        else
            for (int j = 0; j < rm; j++) t1[j] = _mm512_setzero_si512();
        const size_t f = f0 + (size_t)sb * TILE;
        const uint8_t *kr = aff == 3 ? k_rec(l, n0, sb) : NULL; /* sb and sb + 1 share a super-block: sb is even */
#define U8X16(p) \
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(two ? _mm_loadu_si128((const __m128i *)(p)) : _mm_maskz_loadu_epi8(mk, (p))))
#define HALF16(p) _mm512_cvtph_ps(two ? _mm256_loadu_si256((const __m256i *)(p)) : _mm256_maskz_loadu_epi16(mk, (p)))
#define F32X16(p) (two ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mk, (p)))
        __m512 w = aff == 3 ? _mm512_mul_ps(_mm512_broadcast_f32x8(load_half8((const uint16_t *)(kr + K_D))),
                                            U8X16(kr + K_SC + k_lane(n0, sb)))
                   : aff == 2 ? F32X16(l->s32 + f) : HALF16(l->s + f);
        __m512 mn = aff == 3 ? _mm512_xor_ps(_mm512_mul_ps(_mm512_broadcast_f32x8(load_half8((const uint16_t *)(kr + K_DMIN))),
                                                           U8X16(kr + K_MIN + k_lane(n0, sb))), _mm512_set1_ps(-0.f))
                    : aff == 2 ? F32X16(l->mins32 + f)
                    : aff == 1 ? HALF16(l->mins + f)
                    : l->sym   ? zs16
                               : U8X16(l->z + f);
#undef U8X16
#undef HALF16
#undef F32X16
/* [p[0] x8 | p[1] x8]: broadcast loads (a permute instead competes with tile_sums512's for the shuffle unit) */
#define PAIR(p) _mm512_mask_broadcastss_ps(_mm512_set1_ps(*(p)), 0xFF00, _mm_load_ss((p) + 1))
        for (int j = 0; j < rm; j++) { /* [sb's rows | sb + 1's], each the sum of its sub-block's two halves */
            __m512i d = _mm512_add_epi32(_mm512_shuffle_i64x2(t0[j], t1[j], 0x44),
                                         _mm512_shuffle_i64x2(t0[j], t1[j], 0xEE));
            __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(d), PAIR(sa[j] + sb)), cj = PAIR(c[j] + sb);
            if (aff)
                acc16[j] = _mm512_fmadd_ps(mn, cj, _mm512_fmadd_ps(x, w, acc16[j]));
            else
                acc16[j] = _mm512_fmadd_ps(_mm512_fnmadd_ps(mn, cj, x), w, acc16[j]);
        }
    }
#undef PAIR
    for (int j = 0; j < rm; j++) /* lanes i and 8 + i: row i's two partial sums */
        _mm256_storeu_ps(out + j * TILE,
                         _mm256_add_ps(_mm512_castps512_ps256(acc16[j]), _mm512_extractf32x8_ps(acc16[j], 1)));
#else
    const __m256 zs = _mm256_set1_ps(l->zsym);
    __m256 acc[TILE_RM];
    for (int j = 0; j < rm; j++) acc[j] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++, q += 4 * 32) {
        __m256i d[TILE_RM];
        tile_sums(rm, q, xq, (size_t)sb * SB, d);
        const size_t f = f0 + (size_t)sb * TILE;
        const uint8_t *kr = aff == 3 ? k_rec(l, n0, sb) : NULL;
        __m256 w = aff == 3 ? _mm256_mul_ps(load_half8((const uint16_t *)(kr + K_D)), load_u8x8(kr + K_SC + k_lane(n0, sb)))
                   : aff == 2 ? _mm256_loadu_ps(l->s32 + f) : load_half8(l->s + f);
        __m256 mn = aff == 3 ? _mm256_xor_ps(_mm256_mul_ps(load_half8((const uint16_t *)(kr + K_DMIN)),
                                                           load_u8x8(kr + K_MIN + k_lane(n0, sb))),
                                             _mm256_set1_ps(-0.f)) /* -(dmin * m), as the packer of s32 */
                    : aff == 2 ? _mm256_loadu_ps(l->mins32 + f) /* the mins, or the zero points */
                    : aff == 1 ? load_half8(l->mins + f)
                    : l->sym   ? zs
                               : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(l->z + f))));
        for (int j = 0; j < rm; j++) {
            __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(d[j]), _mm256_broadcast_ss(sa[j] + sb));
            __m256 cj = _mm256_broadcast_ss(c[j] + sb);
            if (aff) /* w * sa * dot + m * c */
                acc[j] = _mm256_fmadd_ps(mn, cj, _mm256_fmadd_ps(x, w, acc[j]));
            else /* w * (sa * dot - z * c) */
                acc[j] = _mm256_fmadd_ps(_mm256_fnmadd_ps(mn, cj, x), w, acc[j]);
        }
    }
    for (int j = 0; j < rm; j++) _mm256_storeu_ps(out + j * TILE, acc[j]);
#endif
}

/* The 6-bit values of a tile's vector from its nibbles b and its high-bit plane h (the plane's bits `at` and
 * at + 2 for the low and the high nibbles: 0 for the sub-block's first 64 nibble bytes, 4 for the last 64) */
#if KV_ZMM
static inline void six_bits(__m512i b, __m512i h, const int at, __m512i *lo, __m512i *hi) {
    const __m512i m = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512i hl = at == 0 ? _mm512_slli_epi16(h, 4) : h, hh = at == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
    *lo = _mm512_or_si512(_mm512_and_si512(b, m), _mm512_and_si512(hl, top));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m), _mm512_and_si512(hh, top));
}
#endif
static inline void six_bits256(__m256i b, __m256i h, const int at, __m256i *lo, __m256i *hi) {
    const __m256i m = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256i hl = at == 0 ? _mm256_slli_epi16(h, 4) : h, hh = at == 0 ? _mm256_slli_epi16(h, 2) : _mm256_srli_epi16(h, 2);
    *lo = _mm256_or_si256(_mm256_and_si256(b, m), _mm256_and_si256(hl, top));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m), _mm256_and_si256(hh, top));
}

/* tile_sums for a 6-bit tile's sub-block (its 192 bytes at q), the values unsigned (0..63), the sums of its first
 * 16 channels (vectors 0 and 1) in da and of its last 16 in db apart, as each half has its own scale. Without
 * VNNI, a vector's two maddubs (each pair within 2 * 63 * 127) add within int16 and are widened at once. */
static inline __attribute__((always_inline)) void tile6_sums(const int rm, const uint8_t *q, const int8_t *const *xq,
                                                             size_t off, __m256i *da, __m256i *db) {
#if KV_ZMM
    __m512i h = _mm512_loadu_si512(q + 128), l0, h0, l1, h1;
    six_bits(_mm512_loadu_si512(q), h, 0, &l0, &h0);
    six_bits(_mm512_loadu_si512(q + 64), h, 4, &l1, &h1);
    for (int j = 0; j < rm; j++) {
        __m512i s0, s1;
        value_sums512(l0, h0, l1, h1, xq[j] + off, &s0, &s1);
        da[j] = _mm256_add_epi32(_mm512_castsi512_si256(s0), _mm512_extracti64x4_epi64(s0, 1));
        db[j] = _mm256_add_epi32(_mm512_castsi512_si256(s1), _mm512_extracti64x4_epi64(s1, 1));
    }
#else
    for (int j = 0; j < rm; j++) da[j] = db[j] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int v = 0; v < 4; v++) {
        __m256i lo, hi;
        six_bits256(_mm256_loadu_si256((const __m256i *)(q + 32 * v)),
                    _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * (v & 1))), v < 2 ? 0 : 4, &lo, &hi);
        for (int j = 0; j < rm; j++) {
            int32_t a0, a1; /* activations 8 v .. 8 v + 3 and 8 v + 4 .. 8 v + 7 of the sub-block */
            memcpy(&a0, xq[j] + off + 8 * v, 4), memcpy(&a1, xq[j] + off + 8 * v + 4, 4);
            __m256i *d = v < 2 ? &da[j] : &db[j];
#if KV_VNNI
            *d = dot_u8s8(dot_u8s8(*d, lo, _mm256_set1_epi32(a0)), hi, _mm256_set1_epi32(a1));
#else
            __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0)),
                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)));
            *d = _mm256_add_epi32(*d, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
#endif
        }
    }
#endif
}

/* qtile_w for 6-bit tiles (GGUF's Q6_K): per sub-block and half, the integer sum less 32 times the activations'
 * (act_c's half sums), times its int8 scale, both halves added before anything is converted to float, then
 * times sa and the row's d. */
static inline __attribute__((always_inline)) void q6_tile_w(const int rm, const kv_linear *l, int n0,
                                                            const int8_t *const *xq, const float *const *sa,
                                                            const float *const *c, float *out) {
    const int nsb = l->k / SB;
    const uint8_t *q = l->q + (size_t)(n0 / TILE) * nsb * 6 * 32;
    __m256 acc[TILE_RM];
    for (int j = 0; j < rm; j++) acc[j] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++, q += 6 * 32) {
        __m256i da[TILE_RM], db[TILE_RM];
        tile6_sums(rm, q, xq, (size_t)sb * SB, da, db);
        const uint8_t *r = k_rec(l, n0, sb), *sc = r + Q6_SC + q6_lane(n0, sb, 0);
        __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + TILE)));
        __m256 d = load_half8((const uint16_t *)(r + Q6_D));
        for (int j = 0; j < rm; j++) {
            uint32_t both;
            memcpy(&both, c[j] + sb, 4);
            __m256i ta = _mm256_sub_epi32(da[j], _mm256_set1_epi32(32 * (int16_t)(both & 0xFFFF)));
            __m256i tb = _mm256_sub_epi32(db[j], _mm256_set1_epi32(32 * (int16_t)(both >> 16)));
            __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(sca, ta), _mm256_mullo_epi32(scb, tb));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(sa[j] + sb)), d, acc[j]);
        }
    }
    for (int j = 0; j < rm; j++) _mm256_storeu_ps(out + j * TILE, acc[j]);
}

/* The instances of one kind of zero point (AFF: 0 uint8 or symmetric, 1 affine float16, 2 affine float32, 3 a Q4_K
 * tile's own figures, d * sc and -(dmin * m) computed per sub-block) */
#define QDOT_ROWS_OF(AFF)                                                                                         \
    if (rm == 2)                                                                                                  \
        qdot_rows_w(AFF, l, 2, n0, xq, sa, c, out);                                                               \
    else                                                                                                          \
        qdot_rows_w(AFF, l, 1, n0, xq, sa, c, out);
#define QTILE_OF(AFF)                                                                                             \
    switch (rm) {                                                                                                 \
    case 4: qtile_w(AFF, 4, l, n0, xq, sa, c, out); break;                                                        \
    case 3: qtile_w(AFF, 3, l, n0, xq, sa, c, out); break;                                                        \
    case 2: qtile_w(AFF, 2, l, n0, xq, sa, c, out); break;                                                        \
    default: qtile_w(AFF, 1, l, n0, xq, sa, c, out);                                                              \
    }

/* an 8-bit linear's rows (ROWS of them from n0) against rm (1 or 2) activation rows */
static void qdot_rows(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                      const float *const *c, float *out) {
    if (l->s32) {
        QDOT_ROWS_OF(2)
    } else if (l->mins) {
        QDOT_ROWS_OF(1)
    } else {
        QDOT_ROWS_OF(0)
    }
}

/* a 4-bit or 6-bit linear's tile at row n0 against rm (1 to TILE_RM) activation rows */
static void qtile(const kv_linear *l, int rm, int n0, const int8_t *const *xq, const float *const *sa,
                  const float *const *c, float *out) {
    if (l->sc16) {
        switch (rm) {
        case 4: q6_tile_w(4, l, n0, xq, sa, c, out); break;
        case 3: q6_tile_w(3, l, n0, xq, sa, c, out); break;
        case 2: q6_tile_w(2, l, n0, xq, sa, c, out); break;
        default: q6_tile_w(1, l, n0, xq, sa, c, out);
        }
    } else if (l->ksc) {
        QTILE_OF(3)
    } else if (l->s32) {
        QTILE_OF(2)
    } else if (l->mins) {
        QTILE_OF(1)
    } else {
        QTILE_OF(0)
    }
}
#undef QDOT_ROWS_OF
#undef QTILE_OF
