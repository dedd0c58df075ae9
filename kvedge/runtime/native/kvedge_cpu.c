/* kvedge's native CPU engine: one decoder step (prefill chunk or decode) of the one model definition,
 * with weight-only INT4/INT8 projections, over caches the caller owns and this code updates in place.
 *
 * Built by kvedge/runtime/native_backend.py at first use with the system C compiler (-O3 -march=native
 * -fopenmp) and loaded with ctypes; that module is the Python side.
 *
 * Quantized linears hold ONNX Runtime's MatMulNBits integers (kvedge.models.quant):
 *   8 bits: row n holds K bytes, read in place;
 *   4 bits: row n holds K/2 bytes, element 2i in the low nibble of byte i, 2i+1 in the high one; the engine
 *   keeps them rewritten as tiles of 8 rows (kv_pack_tiles: the same integers, interleaved).
 * The kernels work on sub-blocks of 32 input channels (groups of 32, 64 or 128 are whole sub-blocks):
 *   y[n] = sum_sb sw[n,sb] * (sa[sb] * dot(q[n,sb], xq[sb]) - z[n,sb] * sa[sb] * sum(xq[sb]))
 * where xq are the activations quantized to int8 per sub-block (scale sa = max|x| / 127, round half
 * to even), q the stored unsigned integers, sw the group scale (a float16: kvedge's quantizer makes every
 * scale one) and z the group zero point. This is ONNX Runtime's accuracy_level 4 scheme (int8
 * activations); the dot products are integer.
 * Affine blocks (GGUF's Q4_1: w = q * d + m, d and m float16) run as they are, without re-rounding the
 * weights: y[n] = sum_sb sw * sa * dot(q, xq) + m * sa * sum(xq), with the file's float16 mins (l->mins), or,
 * for K-quants (Q4_K, Q5_K: scale d * sc and min dmin * m, not float16 values), float32 scales and mins
 * (l->s32, l->mins32), or, for Q4_K tiles packed from a file, its own 6-bit figures and d, dmin (l->ksc, k_rec),
 * the same products computed in the kernel. GGUF's Q6_K (a scale per 16 channels) is its own format, bits 6:
 * tiles as the 4-bit ones with a plane of each value's 2 high bits beside them (l->sc16, k_rec; gg_tile_lane).
 * A GGUF file's blocks are packed into these layouts by kv_pack_gguf, and an embedding is looked up in its
 * packed form (kv_weight_rows).
 * For speed, a 4-bit kernel call computes a tile of 8 rows against 1 to 4 activation rows: each weight vector
 * is unpacked once for all of them and meets 4 activations broadcast to every lane, so the lanes' sums are the
 * 8 rows' own (no horizontal add): fewer instructions per multiply-add than the row kernel, most of all for
 * several activation rows (docs/benchmarks.md). An 8-bit call computes 4 weight rows against 1 or 2
 * activation rows, every 8 sub-blocks reduced together: their scales are stored in the order the reduction
 * produces them (kv_slot), and the activations' per-sub-block figures are written in that order too, so no
 * shuffle happens per weight. Weight rows are prefetched ahead: decode reads every weight once per token, so
 * it is a stream.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
/* The vector paths: x86's take AVX2 with FMA and F16C (every AVX2 CPU has both; -march=native turns them on),
 * aarch64's NEON (kernels_neon.h), with the dot product (ARMv8.2 +dotprod) and int8 matrix multiply (+i8mm)
 * where the build targets them. -DKV_NO_SIMD builds the portable C path on any CPU (the tests' reference). */
#if !defined(KV_NO_SIMD) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_AVX2 1
#include <immintrin.h>
#else
#define KV_AVX2 0
#endif
#if !defined(KV_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
#define KV_NEON 1
#else
#define KV_NEON 0
#endif
#if KV_NEON && defined(__ARM_FEATURE_DOTPROD)
#define KV_DOTPROD 1
#else
#define KV_DOTPROD 0
#endif
#if KV_NEON && defined(__ARM_FEATURE_MATMUL_INT8)
#define KV_I8MM 1
#else
#define KV_I8MM 0
#endif

/* Which kernels this build runs (the Python side's KERNELS names them): 0 portable C, 1 AVX2 (without VNNI:
 * maddubs), 2 AVX-VNNI, 3 AVX512-VNNI (dot_u8s8 picks the same way), 4 NEON, 5 NEON with the dot product,
 * 6 NEON with the dot product and i8mm */
int kv_simd(void) {
#if KV_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3;
#elif KV_AVX2 && defined(__AVXVNNI__)
    return 2;
#elif KV_NEON
    return 4 + KV_DOTPROD + (KV_DOTPROD && KV_I8MM);
#else
    return KV_AVX2;
#endif
}

#define SB 32 /* input channels per sub-block */
/* Weight rows are fetched this far ahead into L2 (prefetcht1): faster than 4 KiB ahead into L1, and far faster
 * than no software prefetch (docs/benchmarks.md). 4-bit tiles are one contiguous run per thread, which the
 * hardware prefetchers follow, and prefetch instructions among their loads slowed the stream: by default (-1)
 * a thread fetches only the head of its next run (fetch_head); 0 or more fetches that far (at least a tile)
 * ahead in the stream too. */
#ifndef TILE_PREFETCH_BYTES
#define TILE_PREFETCH_BYTES -1
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384
#endif
/* An asm statement on x86: GCC may delete a loop of nothing but __builtin_prefetch as dead code, and did
 * here once the stride was inlined. */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH_L2(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif

typedef struct {
    int32_t n, k, bits, sym;  /* sym: every zero point is zsym (kvedge --symmetric) */
    float zsym;
    const uint8_t *q;         /* 8 bits: MatMulNBits bytes [n][k]; 4 bits: tiles of TILE rows (kv_pack_tiles) */
    uint16_t *s;              /* [kv_figures] float16 scales per sub-block, kernel order (fig_at; kv_pack) */
    uint8_t *z;               /* [kv_figures] zero points per sub-block, kernel order; NULL when sym or affine */
    uint16_t *mins;           /* [kv_figures] float16 mins per sub-block, kernel order (kv_pack_mins);
                               * NULL unless affine (then sym is 0 and z NULL) */
    const float *w;           /* fp32 weight [n][k] instead of q/s/z (an unquantized linear) */
    const float *bias;        /* [n] or NULL */
    int32_t planes;           /* activations: 1 (or 0), int8 per sub-block; 2, int16 as two int8 planes
                               * (quantize_row16), which doubles the kernels' multiply-adds, not the weight reads */
    float *s32, *mins32;      /* [kv_figures] an affine linear's float32 scales and mins (kv_pack_affine32)
                               * instead of s and mins; NULL otherwise */
    int8_t *sc16;             /* bits 6 (GGUF's Q6_K, kv_pack_gguf: 6-bit tiles): its int8 scales per 16 channels and
                               * float16 d, a record per tile and super-block (k_rec); NULL otherwise */
    uint8_t *ksc;             /* 4-bit tiles of GGUF's Q4_K: its figures as the file has them instead of s32 / mins32,
                               * a record per tile and super-block (k_rec); NULL otherwise */
} kv_linear;

/* Per-sub-block figures (scales, zero points, activation scales) are stored per row with a stride of
 * whole chunks of 8 sub-blocks, zero-padded, so every chunk (the last partial one too) is reduced alike. */
static inline int sub_stride(int k) { return (k / SB + 7) & ~7; }

/* Where sub-block sb sits among its row's figures: permuted within each chunk as its reduction leaves the
 * sums (0,2,4,6,1,3,5,7). */
static inline int kv_slot(int sb) {
    static const int inv[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    return (sb & ~7) + inv[sb & 7];
}

/* 4-bit linears are stored in tiles of TILE rows (kv_pack_tiles), which one kernel call computes together:
 * tile t, sub-block sb is 128 bytes, 4 vectors of TILE lanes of 4 bytes; lane r of vector v holds row
 * TILE t + r's weights at channels 32 sb + 8 v + b (low nibble of byte b) and 32 sb + 8 v + 4 + b (high
 * nibble), so each vector meets 4 consecutive activations broadcast to every lane, and the lanes' sums are
 * the TILE rows' sums without a horizontal add. Their figures (scales, zero points, mins) are [tile][sb][TILE]
 * and the activations they meet stay in channel order. The last tile's missing rows are zero. */
#define TILE 8

/* 6-bit tiles (GGUF's Q6_K, values 0..63 for q - 32) are the 4-bit tiles of each value's low 4 bits, then a plane
 * of its 2 high bits, 64 bytes a tile's sub-block: byte i holds those of nibble byte i's low value (bits 0-1) and
 * high value (2-3), then of nibble byte 64 + i's (4-5, 6-7), so that a 512-bit vector of the plane completes
 * both halves of the sub-block's nibbles with shifts and masks. */
static inline int tiles(int bits) { return bits == 4 || bits == 6; }
static inline int tiled(const kv_linear *l) { return tiles(l->bits) && !l->w; }

/* bytes of a tile's sub-block: 4 bits or 6 a weight, TILE rows of 32 channels */
static inline size_t tile_bytes(const kv_linear *l) { return l->bits == 6 ? 6 * 32 : 4 * 32; }

/* bytes of a quantized row: a tile's sub-block per TILE rows, or (another format) one a weight */
static inline size_t row_bytes(const kv_linear *l) {
    return tiled(l) ? (size_t)l->k / SB * tile_bytes(l) / TILE : (size_t)l->k;
}

/* where row n's figure of sub-block sb is */
static inline size_t fig_at(const kv_linear *l, int n, int sb) {
    if (tiled(l)) return ((size_t)(n / TILE) * (l->k / SB) + sb) * TILE + n % TILE;
    return (size_t)n * sub_stride(l->k) + kv_slot(sb);
}

/* figures a linear of n rows and k inputs stores per kind (scales, zero points, mins): for the Python side */
size_t kv_figures(int n, int k, int bits) {
    return tiles(bits) ? (size_t)((n + TILE - 1) / TILE * TILE) * (k / SB) : (size_t)n * sub_stride(k);
}

/* A K-quant tile's figures of a super-block are one record, so that they stream beside the values as one. Q4_K's
 * (ksc): its 8 sub-blocks' 6-bit scales [sb % 8][TILE], their mins alike, then the rows' d and dmin [TILE] each
 * (the file's float16), K_REC bytes. Q6_K's (sc16): the int8 scales of each sub-block's two halves
 * [sb % 8][2][TILE], then the rows' d [TILE], Q6_REC bytes. kv_figures / (8 * TILE) records a linear. */
enum { K_SC = 0, K_MIN = 8 * TILE, K_D = 16 * TILE, K_DMIN = 18 * TILE, K_REC = 20 * TILE };
enum { Q6_SC = 0, Q6_D = 16 * TILE, Q6_REC = 18 * TILE };
static inline uint8_t *k_rec(const kv_linear *l, int n, int sb) {
    size_t at = (size_t)(n / TILE) * (l->k / 256) + sb / 8;
    return l->sc16 ? (uint8_t *)l->sc16 + at * Q6_REC : l->ksc + at * K_REC;
}

/* where row n's byte of sub-block sb is in its record: a Q4_K scale or min (after K_SC or K_MIN), a Q6_K half's
 * scale (after Q6_SC) */
static inline int k_lane(int n, int sb) { return sb % 8 * TILE + n % TILE; }
static inline int q6_lane(int n, int sb, int half) { return (sb % 8 * 2 + half) * TILE + n % TILE; }

/* row n's float16 at `at` (K_D, K_DMIN or Q6_D) of the record of sub-block sb's super-block */
static inline uint16_t k_half(const kv_linear *l, int n, int sb, int at) {
    uint16_t h;
    memcpy(&h, k_rec(l, n, sb) + at + 2 * (n % TILE), 2);
    return h;
}


/* where an activation row's figures (scale, sum) of sub-block sb are, for a linear of `bits` */
static inline int act_slot(int sb, int bits) { return tiles(bits) ? sb : kv_slot(sb); }

/* row n's int8 scale of channels 32 sb + 16 half .. + 15 (half 0 or 1), for 6-bit tiles */
static inline int q6_scale(const kv_linear *l, int n, int sb, int half) {
    return (int8_t)k_rec(l, n, sb)[Q6_SC + q6_lane(n, sb, half)];
}

/* row n's unsigned values of sub-block sb from its tile (4 or 6 bits): lane n % TILE of the tile's 4 vectors,
 * channels 8 v + b (low nibbles) and 8 v + 4 + b (high ones), b = 0..3, and for 6 bits their high-bit plane */
static inline void tile_lane(const kv_linear *l, int n, int sb, uint8_t *v) {
    const uint8_t *t = l->q + ((size_t)(n / TILE) * (l->k / SB) + sb) * tile_bytes(l);
    for (int vv = 0; vv < 4; vv++)
        for (int b = 0; b < 4; b++) {
            int i = (vv * TILE + n % TILE) * 4 + b, h = l->bits == 6 ? t[128 + i % 64] >> 4 * (i / 64) : 0;
            v[8 * vv + b] = (uint8_t)((t[i] & 15) | (h & 3) << 4);
            v[8 * vv + 4 + b] = (uint8_t)((t[i] >> 4) | (h >> 2 & 3) << 4);
        }
}

/* Write a 4-bit linear's tiles (ceil(n / TILE) * TILE * k / 2 bytes) into dst from its MatMulNBits bytes src,
 * and point l->q at them. */
int kv_pack_tiles(kv_linear *l, uint8_t *dst, const uint8_t *src) {
    if (l->bits != 4 || l->k % SB) return -1;
    int nsb = l->k / SB, np = (l->n + TILE - 1) / TILE * TILE;
    size_t rb = (size_t)l->k / 2;
    for (int n = 0; n < np; n++)
        for (int sb = 0; sb < nsb; sb++)
            for (int v = 0; v < 4; v++)
                for (int b = 0; b < 4; b++) {
                    int e = sb * SB + 8 * v + b, f = e + 4; /* channels: MatMulNBits holds 2i low, 2i + 1 high */
                    const uint8_t *row = src + (size_t)n * rb;
                    int lo = n < l->n ? (row[e / 2] >> 4 * (e & 1)) & 15 : 0;
                    int hi = n < l->n ? (row[f / 2] >> 4 * (f & 1)) & 15 : 0;
                    dst[((((size_t)(n / TILE) * nsb + sb) * 4 + v) * TILE + n % TILE) * 4 + b] = (uint8_t)(lo | hi << 4);
                }
    l->q = dst;
    return 0;
}

/* Fill l->s and l->z (allocated by the caller, kv_figures(n, k, bits) each) from per-group float16
 * scales [n][k / group] and, unless symmetric or affine (l->mins: kv_pack_mins fills it), unpacked zero
 * points [n][k / group]. */
int kv_pack(kv_linear *l, const uint16_t *scales, const uint8_t *zeros, int group) {
    if (l->k % SB || group % SB || l->k % group) return -1;
    int nsb = l->k / SB, ng = l->k / group, per = group / SB, uz = !l->sym && !l->mins;
    size_t figs = kv_figures(l->n, l->k, l->bits);
    if (uz && (!l->z || !zeros)) return -1;
    memset(l->s, 0, sizeof(uint16_t) * figs);
    if (uz) memset(l->z, 0, figs);
    for (int n = 0; n < l->n; n++)
        for (int sb = 0; sb < nsb; sb++) {
            size_t at = fig_at(l, n, sb);
            l->s[at] = scales[(size_t)n * ng + sb / per];
            if (uz) l->z[at] = zeros[(size_t)n * ng + sb / per];
        }
    return 0;
}

/* Fill l->mins (allocated by the caller, kv_figures(n, k, bits) halves) from an affine block's per-group float16
 * mins [n][k / group]. */
int kv_pack_mins(kv_linear *l, const uint16_t *mins, int group) {
    if (!l->mins || !mins || l->sym || l->k % SB || group % SB || l->k % group) return -1;
    int nsb = l->k / SB, ng = l->k / group, per = group / SB;
    memset(l->mins, 0, sizeof(uint16_t) * kv_figures(l->n, l->k, l->bits));
    for (int n = 0; n < l->n; n++)
        for (int sb = 0; sb < nsb; sb++) l->mins[fig_at(l, n, sb)] = mins[(size_t)n * ng + sb / per];
    return 0;
}

/* IEEE half -> float (exact): normal, subnormal (renormalized), zero, inf / NaN; F16C's conversion where the
 * build has it (the same values) */
static float half_to_float(uint16_t h) {
#if KV_AVX2
    return _cvtsh_ss(h);
#elif KV_NEON
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31)
        bits = sign | 0x7F800000u | (m << 13);
    else if (e)
        bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m)
        bits = sign;
    else {
        e = 113;
        while (!(m & 1024)) m <<= 1, e--;
        bits = sign | (e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline int affine(const kv_linear *l) { return l->ksc || l->s32 || l->mins; }

/* row n's scale of sub-block sb as float32 (a Q4_K tile's d * sc, computed as the file's dequantizer does) */
static inline float fig_scale(const kv_linear *l, int n, int sb) {
    size_t f = fig_at(l, n, sb);
    if (l->ksc) return half_to_float(k_half(l, n, sb, K_D)) * (float)k_rec(l, n, sb)[K_SC + k_lane(n, sb)];
    return l->s32 ? l->s32[f] : half_to_float(l->s[f]);
}

/* row n's min of sub-block sb for an affine linear (a Q4_K tile's -(dmin * m)), else its zero point */
static inline float fig_min(const kv_linear *l, int n, int sb) {
    size_t f = fig_at(l, n, sb);
    if (l->ksc) return -(half_to_float(k_half(l, n, sb, K_DMIN)) * (float)k_rec(l, n, sb)[K_MIN + k_lane(n, sb)]);
    if (l->s32) return l->mins32[f];
    if (l->mins) return half_to_float(l->mins[f]);
    return l->sym ? l->zsym : (float)l->z[f];
}

/* GGUF blocks (llama.cpp's ggml-common.h layouts) packed into a linear's layout as they are: the same integers
 * and figures, never re-rounded (kvedge.models.gguf's module doc gives each type's formula). Codes: the Python
 * side's GGUF_TYPES. Q6_K (16-channel scales) becomes a bits-6 linear (kv_linear.sc16). */
enum { GG_Q8_0, GG_Q4_0, GG_Q4_1, GG_Q5_0, GG_Q5_1, GG_Q4_K, GG_Q5_K, GG_Q6_K, GG_TYPES };
static const struct {
    int block, bytes;
} gg_type[GG_TYPES] = {{32, 34}, {32, 18}, {32, 20}, {32, 22}, {32, 24}, {256, 144}, {256, 176}, {256, 210}};

/* bytes of the records of a Q4_K or Q6_K linear of n rows and k inputs (type: GG_Q4_K or GG_Q6_K's code, the
 * Python side's GGUF_TYPES), 0 for another type: for the Python side */
size_t kv_record_bytes(int n, int k, int type) {
    if (type != GG_Q4_K && type != GG_Q6_K) return 0;
    return kv_figures(n, k, 4) / (8 * TILE) * (type == GG_Q4_K ? K_REC : Q6_REC);
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* 32 values from 16 bytes: the low nibbles are elements 0-15, the high ones 16-31 */
static inline void gg_nibbles(const uint8_t *qs, uint8_t *v) {
    for (int e = 0; e < 16; e++) v[e] = qs[e] & 15, v[e + 16] = qs[e] >> 4;
}

/* the fifth bits of 32 elements, bit e of a little-endian 32-bit word */
static inline void gg_fifth(const uint8_t *qh, uint8_t *v) {
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int e = 0; e < 32; e++) v[e] |= (uint8_t)(((h >> e) & 1) << 4);
}

/* A K-quant super-block's 6-bit scale and min of sub-block j (0..7) from its 12 bytes q (ggml's get_scale_min_k4) */
static inline void gg_k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4)
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    else
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

/* Sub-block sb (channels 32 sb ..) of a GGUF row: its unsigned integers v and its figures (float16 scale and
 * min as stored, or a K-quant's float32 d * sc and -(dmin * m)). */
static inline __attribute__((always_inline)) void gg_sub_block(const int type, const uint8_t *row, int sb, uint8_t *v,
                                                               uint16_t *s16, uint16_t *m16, float *s32, float *m32) {
    if (gg_type[type].block == 32) {
        const uint8_t *b = row + (size_t)sb * gg_type[type].bytes;
        *s16 = rd16(b);
        if (type == GG_Q8_0)
            for (int e = 0; e < 32; e++) v[e] = b[2 + e] ^ 0x80; /* int8 q as q + 128 */
        else if (type == GG_Q4_0)
            gg_nibbles(b + 2, v);
        else if (type == GG_Q4_1)
            *m16 = rd16(b + 2), gg_nibbles(b + 4, v);
        else if (type == GG_Q5_0)
            gg_nibbles(b + 6, v), gg_fifth(b + 2, v);
        else /* Q5_1 */
            *m16 = rd16(b + 2), gg_nibbles(b + 8, v), gg_fifth(b + 4, v);
        return;
    }
    /* Q5_K (Q4_K is always tiled: gg_tile_lane) */
    const uint8_t *b = row + (size_t)(sb / 8) * gg_type[type].bytes;
    int j = sb % 8, sc, mn;
    gg_k_scale_min(b + 4, j, &sc, &mn);
    *s32 = half_to_float(rd16(b)) * (float)sc;
    *m32 = -(half_to_float(rd16(b + 2)) * (float)mn);
    const uint8_t *qs = b + 48 + 32 * (j / 2); /* sub-blocks 2i, 2i + 1: one run's nibbles */
    for (int e = 0; e < 32; e++) v[e] = ((qs[e] >> 4 * (j & 1)) & 15) | (uint8_t)(((b[16 + e] >> j) & 1) << 4);
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A 4-bit or 6-bit type's sub-block as a tile lane's 4 words (kv_pack_tiles: word v holds channels 8 v + b in its
 * low nibbles and 8 v + 4 + b in its high ones), built a word at a time from the block's nibble words: n[w] holds
 * values 4 w .. 4 w + 3 (bytes), which Q4_0 / Q4_1 keep as the low then the high nibbles of 16 bytes, Q4_K as one
 * nibble of its run's 32 bytes and Q6_K as one nibble of a quarter's 32 (element e of a super-block: half e / 128,
 * quarter i = e % 128 / 32 the low nibbles of its half's ql[0..31], of ql[32..63], then the high ones; qh's bits
 * 2i its high bits). Q6_K's high bits go to the lane's words of the plane (tile_lane), its int8 scales to k6;
 * a K-quant's d (Q4_K: and dmin) to kdd, the file's float16 bits. */
static inline __attribute__((always_inline)) void gg_tile_lane(const int type, const uint8_t *row, int sb, uint8_t *lane,
                                                               uint16_t *s16, uint16_t *m16, int *k6, uint16_t *kdd) {
    const uint32_t lo = 0x0F0F0F0Fu;
    uint32_t n[8];
    if (type == GG_Q6_K) {
        const uint8_t *b = row + (size_t)(sb / 8) * gg_type[type].bytes;
        int j = sb % 8, i = j % 4;
        const uint8_t *ql = b + 64 * (j / 4) + 32 * (i & 1), *qh = b + 128 + 32 * (j / 4);
        uint32_t p[4];
        for (int w = 0; w < 8; w++) n[w] = (rd32(ql + 4 * w) >> 4 * (i >> 1)) & lo;
        for (int v = 0; v < 4; v++)
            p[v] = ((rd32(qh + 8 * v) >> 2 * i) & 0x03030303u) | ((rd32(qh + 8 * v + 4) >> 2 * i) & 0x03030303u) << 2;
        uint32_t h0 = p[0] | p[2] << 4, h1 = p[1] | p[3] << 4; /* the plane: vectors 0, 2 and 1, 3 */
        memcpy(lane + 128, &h0, 4), memcpy(lane + 160, &h1, 4);
        k6[0] = (int8_t)b[192 + 2 * j], k6[1] = (int8_t)b[193 + 2 * j];
        kdd[0] = rd16(b + 208);
    } else if (type == GG_Q4_K) {
        const uint8_t *b = row + (size_t)(sb / 8) * gg_type[type].bytes;
        int j = sb % 8;
        gg_k_scale_min(b + 4, j, &k6[0], &k6[1]);
        kdd[0] = rd16(b), kdd[1] = rd16(b + 2);
        const uint8_t *qs = b + 16 + 32 * (j / 2);
        for (int w = 0; w < 8; w++) n[w] = (rd32(qs + 4 * w) >> 4 * (j & 1)) & lo;
    } else {
        const uint8_t *b = row + (size_t)sb * gg_type[type].bytes, *qs = b + (type == GG_Q4_0 ? 2 : 4);
        *s16 = rd16(b);
        if (type == GG_Q4_1) *m16 = rd16(b + 2);
        for (int w = 0; w < 4; w++) n[w] = rd32(qs + 4 * w) & lo, n[w + 4] = (rd32(qs + 4 * w) >> 4) & lo;
    }
    for (int v = 0; v < 4; v++) {
        uint32_t word = n[2 * v] | n[2 * v + 1] << 4;
        memcpy(lane + 32 * v, &word, 4);
    }
}

/* Rows [u * per, (u + 1) * per) of l (per: TILE for tiles, else 1) from GGUF rows of a constant type (inlined
 * per type, so the type's branches fold away) */
static inline __attribute__((always_inline)) void gg_pack_unit(kv_linear *l, const int type, const uint8_t *const *rows,
                                                               int u, int per) {
    int nsb = l->k / SB;
    uint8_t *dst = (uint8_t *)l->q;
    for (int n = u * per; n < (u + 1) * per; n++)
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t v[SB] = {0};
            uint16_t s16 = 0, m16 = 0;
            float s32 = 0.f, m32 = 0.f;
            uint16_t kdd[2] = {0, 0};
            int k6[2] = {0, 0};
            uint8_t *tq = per == TILE ? dst + ((size_t)(n / TILE) * nsb + sb) * tile_bytes(l) + (size_t)(n % TILE) * 4 : NULL;
            if (n < l->n && tq)
                gg_tile_lane(type, rows[n], sb, tq, &s16, &m16, k6, kdd);
            else if (n < l->n)
                gg_sub_block(type, rows[n], sb, v, &s16, &m16, &s32, &m32);
            size_t f = fig_at(l, n, sb);
            if (l->sc16) { /* Q6_K: the int8 scales of the sub-block's halves, d once a super-block */
                uint8_t *r = k_rec(l, n, sb);
                r[Q6_SC + q6_lane(n, sb, 0)] = (uint8_t)k6[0], r[Q6_SC + q6_lane(n, sb, 1)] = (uint8_t)k6[1];
                if (sb % 8 == 0) memcpy(r + Q6_D + 2 * (n % TILE), &kdd[0], 2);
            } else if (l->ksc) { /* Q4_K: the file's 6-bit scale and min, d and dmin once a super-block */
                uint8_t *r = k_rec(l, n, sb);
                r[K_SC + k_lane(n, sb)] = (uint8_t)k6[0], r[K_MIN + k_lane(n, sb)] = (uint8_t)k6[1];
                if (sb % 8 == 0)
                    memcpy(r + K_D + 2 * (n % TILE), &kdd[0], 2), memcpy(r + K_DMIN + 2 * (n % TILE), &kdd[1], 2);
            } else if (l->s32) {
                l->s32[f] = s32, l->mins32[f] = m32;
            } else {
                l->s[f] = s16;
            }
            if (l->mins) l->mins[f] = m16;
            if (tq) { /* a missing row of the last tile: zero */
                if (n >= l->n)
                    for (int vv = 0; vv < (l->bits == 6 ? 6 : 4); vv++) memset(tq + 32 * vv, 0, 4);
            } else {
                memcpy(dst + (size_t)n * l->k + (size_t)sb * SB, v, SB);
            }
        }
}

/* Pack l (n, k, bits, sym / zsym and its buffers set by the caller: q, and s (+ mins) or s32 + mins32 of
 * kv_figures, or ksc or sc16 of kv_record_bytes) from GGUF rows of one type: rows[r] is where row r's blocks
 * start (any order: the caller undoes a permutation or joins tensors that way). Rows past n, in the last
 * tile, are zero. */
int kv_pack_gguf(kv_linear *l, int type, const uint8_t *const *rows, int threads) {
    if (type < 0 || type >= GG_TYPES || l->k % gg_type[type].block || l->w) return -1;
    int bits = type == GG_Q6_K ? 6 : type == GG_Q4_0 || type == GG_Q4_1 || type == GG_Q4_K ? 4 : 8;
    if (l->bits != bits || (type == GG_Q6_K) != (l->sc16 != NULL)) return -1;
    if ((type == GG_Q4_K) != (l->ksc != NULL)) return -1;
    int nsb = l->k / SB, per = tiled(l) ? TILE : 1, units = (l->n + per - 1) / per;
#pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), me = omp_get_thread_num();
        int u0 = (int)((long long)units * me / nt), u1 = (int)((long long)units * (me + 1) / nt);
#define GG_PACK(T)                                                                                                \
    case T:                                                                                                       \
        for (int u = u0; u < u1; u++) gg_pack_unit(l, T, rows, u, per);                                          \
        break;
        switch (type) {
            GG_PACK(GG_Q8_0) GG_PACK(GG_Q4_0) GG_PACK(GG_Q4_1) GG_PACK(GG_Q5_0) GG_PACK(GG_Q5_1) GG_PACK(GG_Q4_K)
            GG_PACK(GG_Q5_K) GG_PACK(GG_Q6_K)
        }
#undef GG_PACK
    }
    if (!tiled(l)) /* the figures' padding to whole chunks of 8 sub-blocks */
        for (int n = 0; n < l->n; n++)
            for (int sb = nsb; sb < sub_stride(l->k); sb++) {
                size_t f = (size_t)n * sub_stride(l->k) + kv_slot(sb);
                if (l->s32) l->s32[f] = l->mins32[f] = 0.f;
                else l->s[f] = 0;
                if (l->mins) l->mins[f] = 0;
            }
    return 0;
}

/* Rows ids[0..count) of l's weights as float32, times scale, into out [count][k]: an embedding looked up in the
 * table's own type (a tied head's bytes). The values are the dequantizer's, exact: s * (q - z), or s * q + m
 * rounded twice (volatile: never one fused multiply-add), as gguf's dequantizer and kvedge.models.quant give
 * them; then times scale. */
void kv_weight_rows(const kv_linear *l, int count, const int64_t *ids, float scale, float *out) {
    int k = l->k, nsb = k / SB;
    for (int r = 0; r < count; r++) {
        int64_t n = ids[r];
        float *o = out + (size_t)r * k;
        if (l->w) {
            for (int i = 0; i < k; i++) o[i] = l->w[(size_t)n * k + i] * scale;
            continue;
        }
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t v[SB];
            if (tiled(l)) {
                tile_lane(l, (int)n, sb, v);
                if (l->sc16) { /* (d * sc) * (q - 32), as gguf's dequantizer */
                    float d = half_to_float(k_half(l, (int)n, sb, Q6_D));
                    for (int e = 0; e < SB; e++) {
                        float s = d * (float)q6_scale(l, (int)n, sb, e / 16); /* exact: 11 bits times 8 */
                        o[sb * SB + e] = s * (float)(v[e] - 32) * scale;
                    }
                    continue;
                }
            } else {
                memcpy(v, l->q + (size_t)n * k + (size_t)sb * SB, SB);
            }
            float s = fig_scale(l, (int)n, sb), mz = fig_min(l, (int)n, sb);
            int aff = affine(l);
            for (int e = 0; e < SB; e++) {
                volatile float w = aff ? s * (float)v[e] : s * ((float)v[e] - mz);
                o[sb * SB + e] = (aff ? w + mz : w) * scale;
            }
        }
    }
}

/* Where a sub-block's 32 quantized activations qv go in a row xq [k] in kernel byte order: for 4-bit weights
 * (tiles), in channel order; for 8-bit ones, each pair of sub-blocks as [sb0 A, sb1 A, sb0 B, sb1 B] and a lone
 * last sub-block as [A, B], where A and B are the 16 channels the weight vectors pair them with (chunk_sums):
 * the first and the last 16, swapped for the second of a pair. */
static inline void place_sub_block(const int8_t *qv, int sb, int nsb, int bits, int8_t *xq) {
    if (tiles(bits)) {
        memcpy(xq + sb * SB, qv, SB);
        return;
    }
    int pair = sb & ~1, lone = (pair + 1 == nsb);
    int8_t *base = xq + pair * SB;
    int half = lone ? 16 : 32, off = lone ? 0 : (sb & 1) * 16, swap = off ? 16 : 0;
    for (int i = 0; i < 16; i++) {
        base[off + i] = qv[swap + i];
        base[half + off + i] = qv[(16 ^ swap) + i];
    }
}

/* Fill l->s32 and l->mins32 (allocated by the caller, kv_figures(n, k, bits) floats each) from an affine block's
 * per-group float32 scales and mins [n][k / group]: a K-quant's d * sc and -dmin * m, kept as they are. */
int kv_pack_affine32(kv_linear *l, const float *scales, const float *mins, int group) {
    if (!l->s32 || !l->mins32 || l->s || l->mins || l->sym || l->k % SB || group % SB || l->k % group) return -1;
    int nsb = l->k / SB, ng = l->k / group, per = group / SB;
    size_t figs = kv_figures(l->n, l->k, l->bits);
    memset(l->s32, 0, sizeof(float) * figs);
    memset(l->mins32, 0, sizeof(float) * figs);
    for (int n = 0; n < l->n; n++)
        for (int sb = 0; sb < nsb; sb++) {
            size_t at = fig_at(l, n, sb), from = (size_t)n * ng + sb / per;
            l->s32[at] = scales[from], l->mins32[at] = mins[from];
        }
    return 0;
}

#define ROWS 4 /* 8-bit weight rows a kernel call computes together (sharing activation loads and the final sums) */
#define TILE_RM 4 /* activation rows a 4-bit tile kernel call computes: each unpacked weight vector serves them all */

/* This build's kernels, one file per instruction set, one interface: quantize_sub_block (an activation
 * sub-block to int8), qdot_rows (ROWS rows of an 8-bit linear), qtile (a tile of a 4-bit or 6-bit one) */
#if KV_AVX2
#include "kernels_avx2.h"
#elif KV_NEON
#include "kernels_neon.h"
#else
#include "kernels_portable.h"
#endif

/* A sub-block's c: sa * sum(qv), or for 6-bit tiles the sums of its first and last 16 activations, int16 each in
 * the float's bits (the x86 kernels take the values as unsigned q and subtract 32 times those sums) */
static inline float act_c(int bits, float sa, const int8_t *qv, int sum) {
    if (bits != 6) return sa * (float)sum;
    int first = 0;
    for (int i = 0; i < 16; i++) first += qv[i];
    uint32_t both = (uint16_t)first | (uint32_t)(uint16_t)(sum - first) << 16;
    float c;
    memcpy(&c, &both, sizeof c);
    return c;
}

/* One row of activations quantized for the kernels: xq [k] in kernel byte order (place_sub_block), and sa and
 * c (act_c) [sub_stride(k)] per sub-block at act_slot, zero-padded. */
static void quantize_row(const float *x, int k, int bits, int8_t *xq, float *sa, float *c) {
    int nsb = k / SB;
    memset(sa, 0, sizeof(float) * sub_stride(k));
    memset(c, 0, sizeof(float) * sub_stride(k));
    for (int sb = 0; sb < nsb; sb++) {
        const float *v = x + sb * SB;
        int8_t qv[SB];
        int sum;
        float d = quantize_sub_block(v, qv, &sum);
        int slot = act_slot(sb, bits);
        sa[slot] = d;
        c[slot] = act_c(bits, d, qv, sum);
        place_sub_block(qv, sb, nsb, bits, xq);
    }
}

/* One row of activations as int16 per sub-block, xi = round(x * 16256 / amax), held as two int8 planes the
 * kernels take as two activation rows: hi = round(xi / 128) in [-127, 127] and lo = xi - 128 hi in [-64, 63],
 * with scales 128 d and d (d = amax / 16256), so the two rows' dot products add up to the int16 one. An
 * activation's error is at most amax / 32512 of its sub-block's largest, against amax / 254 for int8. */
static void quantize_row16(const float *x, int k, int bits, int8_t *xq, float *sa, float *c, int8_t *xq_lo,
                           float *sa_lo, float *c_lo) {
    int nsb = k / SB;
    memset(sa, 0, sizeof(float) * sub_stride(k)), memset(c, 0, sizeof(float) * sub_stride(k));
    memset(sa_lo, 0, sizeof(float) * sub_stride(k)), memset(c_lo, 0, sizeof(float) * sub_stride(k));
    for (int sb = 0; sb < nsb; sb++) {
        const float *v = x + sb * SB;
        int8_t hi[SB], lo[SB];
        int sum_hi = 0, sum_lo = 0;
        float amax = 0.f;
        for (int i = 0; i < SB; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        float d = amax / 16256.f, id = amax > 0.f ? 16256.f / amax : 0.f;
        for (int i = 0; i < SB; i++) {
            int xi = (int)nearbyintf(v[i] * id), h = (xi + 64) >> 7; /* an arithmetic shift: floor */
            hi[i] = (int8_t)h, lo[i] = (int8_t)(xi - 128 * h);
            sum_hi += hi[i], sum_lo += lo[i];
        }
        int slot = act_slot(sb, bits);
        sa[slot] = 128.f * d, c[slot] = act_c(bits, 128.f * d, hi, sum_hi);
        sa_lo[slot] = d, c_lo[slot] = act_c(bits, d, lo, sum_lo);
        place_sub_block(hi, sb, nsb, bits, xq);
        place_sub_block(lo, sb, nsb, bits, xq_lo);
    }
}


static float fdot(const float *a, const float *b, int k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* The rows [*r0, *r1) of n this thread handles: all of them when every thread does the work itself (rep). */
static inline void span(int rep, int n, int *r0, int *r1) {
    if (rep) {
        *r0 = 0, *r1 = n;
        return;
    }
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *r0 = (int)((long)n * t / nt), *r1 = (int)((long)n * (t + 1) / nt);
}

/* The team's barrier. libgomp's own spins only about a thousand times before it sleeps in the kernel once the
 * process's OpenMP threads outnumber the cores, and they do as soon as a second thread runs a team beside the
 * main thread's idle one (a server's scheduler thread, after torch ran on the main thread): every barrier of a
 * step then costs a sleep and a wake-up, and a step takes far longer (docs/benchmarks.md). This one spins
 * (pause) for SPIN_NS first, then sleeps on a futex (Linux; elsewhere it yields the core), so that a team larger
 * than the cores does not spin on the core a late member needs. Arrivals count up; the last to arrive resets
 * the count, moves the phase on and wakes the sleepers. team_barrier: the current parallel region's. */
typedef struct {
    atomic_int arrived, phase, sleepers;
    atomic_int pool; /* the next chunk of a projection's pooled units (linear_rows); 0 again at every barrier */
} kv_barrier;
static _Thread_local kv_barrier *team_barrier;
#ifndef SPIN_NS
#define SPIN_NS 12000 /* how long a waiting member spins before it sleeps: time, as a pause lasts from about a
                       * nanosecond (an ARM yield) to tens (x86) */
#endif

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* sleep while *phase == seen (the kernel checks it atomically), and wake every sleeper */
static void phase_sleep(atomic_int *phase, int seen) {
#ifdef __linux__
    syscall(SYS_futex, (int *)phase, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)phase, (void)seen;
    sched_yield();
#endif
}

static void phase_wake(atomic_int *phase) {
#ifdef __linux__
    syscall(SYS_futex, (int *)phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)phase;
#endif
}

static void sync_team(void) {
    int n = omp_get_num_threads();
    kv_barrier *b = team_barrier;
    if (n == 1) {
        atomic_store_explicit(&b->pool, 0, memory_order_relaxed);
        return;
    }
    int phase = atomic_load_explicit(&b->phase, memory_order_relaxed); /* read before arriving: it cannot move on */
    if (atomic_fetch_add(&b->arrived, 1) == n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->pool, 0, memory_order_relaxed);
        atomic_store(&b->phase, phase + 1);
        if (atomic_load(&b->sleepers)) phase_wake(&b->phase); /* a sleeper counted after this load sees the phase */
        return;
    }
    long long until = now_ns() + SPIN_NS;
    for (int spins = 1;; spins++) {
        if (atomic_load_explicit(&b->phase, memory_order_acquire) != phase) return;
        cpu_relax();
        if (spins % 16 == 0 && now_ns() >= until) break;
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->phase) == phase) phase_sleep(&b->phase, phase);
    atomic_fetch_sub(&b->sleepers, 1);
}

/* prefetch `bytes` from p on */
static inline void fetch_span(const void *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) PREFETCH_L2((const char *)p + o);
}

/* prefetch weight rows [n0, n1) of a quantized linear (n0 a multiple of its unit): bytes, scales and an affine
 * one's mins */
static inline void fetch_rows(const kv_linear *l, int n0, int n1) {
    if (l->w || n1 <= n0) return;
    size_t rb = row_bytes(l), per = tiled(l) ? (size_t)l->k / SB : (size_t)sub_stride(l->k);
    size_t at = (size_t)n0 * per, figs = (size_t)(n1 - n0) * per; /* a tile's figures follow the one before */
    fetch_span(l->q + (size_t)n0 * rb, (size_t)(n1 - n0) * rb);
    if (l->sc16 || l->ksc) { /* a record per 8 * TILE figures */
        size_t rec = l->sc16 ? Q6_REC : K_REC;
        fetch_span(k_rec(l, n0, 0), (figs + 8 * TILE - 1) / (8 * TILE) * rec);
        return;
    }
    if (l->s32) {
        fetch_span(l->s32 + at, sizeof(float) * figs), fetch_span(l->mins32 + at, sizeof(float) * figs);
        return;
    }
    fetch_span(l->s + at, sizeof(uint16_t) * figs);
    if (l->mins) fetch_span(l->mins + at, sizeof(uint16_t) * figs);
}

/* Byte ranges a thread fetches into L2 a share at a time while it streams a projection's weights: decode's
 * attention reads each layer's cache once a token, a few slices too short for the hardware prefetchers to
 * ramp up on, so each thread fetches its attention work's K and V rows during the qkv projection. */
#define FETCH_RANGES 16
typedef struct {
    const char *p[FETCH_RANGES];
    size_t left[FETCH_RANGES], total;
    int count, at;
} kv_fetch;

static void fetch_add(kv_fetch *f, const void *p, size_t bytes) {
    if (f->count < FETCH_RANGES && bytes) f->p[f->count] = p, f->left[f->count++] = bytes, f->total += bytes;
}

/* fetch the next `bytes` (rounded up to whole lines) of f's ranges */
static void fetch_some(kv_fetch *f, size_t bytes) {
    while (bytes && f->at < f->count) {
        size_t take = f->left[f->at] < bytes ? f->left[f->at] : bytes;
        for (size_t o = 0; o < take; o += 64) PREFETCH_L2(f->p[f->at] + o);
        f->p[f->at] += take, f->left[f->at] -= take, bytes -= take;
        if (!f->left[f->at]) f->at++;
    }
}

/* the weight rows a kernel call computes: a 4-bit tile, or ROWS rows of another linear */
static inline int unit(const kv_linear *l) { return tiled(l) ? TILE : ROWS; }

/* A projection's last units are pooled: each thread first streams its static share of the other units, one
 * contiguous run, then takes chunks of the pool until none is left, so that a thread slowed for a while (another
 * process, a slower share of memory) does not keep the team waiting at the barrier. */
#define POOL_SHARE 8  /* 1 / POOL_SHARE of the units, */
#define POOL_CHUNKS 4 /* in POOL_CHUNKS chunks per thread */
static inline int pooled_units(int units) { return units / POOL_SHARE; }

/* this thread's static weight rows [*n0, *n1) of l (whole units), and how many rows it fetches ahead */
static inline int my_rows(const kv_linear *l, int *n0, int *n1) {
    int u = unit(l), units = (l->n + u - 1) / u, t0, t1;
    span(0, units - pooled_units(units), &t0, &t1);
    *n0 = t0 * u, *n1 = t1 * u < l->n ? t1 * u : l->n;
    size_t bytes = tiled(l) ? (TILE_PREFETCH_BYTES > 0 ? TILE_PREFETCH_BYTES : 0) : PREFETCH_BYTES;
    return ((int)(bytes / row_bytes(l)) + u) / u * u;
}

/* fetch the head of this thread's rows of l: called one projection early, so the next stream is under
 * way during the barrier and the small phases between */
static void fetch_head(const kv_linear *l) {
    int n0, n1, ahead = my_rows(l, &n0, &n1);
    fetch_rows(l, n0, n0 + ahead < n1 ? n0 + ahead : n1);
}

/* y's columns [n0, n0 + unit(l)) for the m rows of x, from their quantized form (xq, sa, c; planes: p2) */
static void unit_rows(const kv_linear *l, int m, int n0, const float *x, float *y, int ldy, const int8_t *xq,
                      const float *sa, const float *c) {
    const int u = unit(l), st = sub_stride(l->k), p2 = l->planes == 2 && !l->w;
    int rows = l->n - n0 < u ? l->n - n0 : u;
    if (tiled(l)) { /* TILE_RM quantized rows at a time: a row's two planes (p2) are rows 2r, 2r + 1 */
        int qm = p2 ? 2 * m : m;
        for (int r = 0; r < qm; r += TILE_RM) {
            int rm = qm - r < TILE_RM ? qm - r : TILE_RM;
            float out[TILE_RM * TILE];
            const int8_t *xs[TILE_RM];
            const float *ss[TILE_RM], *cc[TILE_RM];
            for (int j = 0; j < rm; j++)
                xs[j] = xq + (size_t)(r + j) * l->k, ss[j] = sa + (size_t)(r + j) * st, cc[j] = c + (size_t)(r + j) * st;
            qtile(l, rm, n0, xs, ss, cc, out);
            for (int j = 0; j < rm; j += 1 + p2)
                for (int i = 0; i < rows; i++) {
                    float v = out[j * TILE + i];
                    if (p2) v += out[(j + 1) * TILE + i]; /* the planes' dot products add up to their row's */
                    y[(size_t)((r + j) >> p2) * ldy + n0 + i] = v + (l->bias ? l->bias[n0 + i] : 0.f);
                }
        }
        return;
    }
    for (int r = 0; r < m; r += 2 - p2) { /* two rows at once, or one row's two planes */
        int rm = r + 1 < m || p2 ? 2 : 1, qr = p2 ? 2 * r : r; /* qr: the first quantized row */
        float out[2 * ROWS];
        if (l->w) {
            for (int j = 0; j < rm; j++)
                for (int i = 0; i < rows; i++)
                    out[j * ROWS + i] = fdot(x + (size_t)(r + j) * l->k, l->w + (size_t)(n0 + i) * l->k, l->k);
        } else {
            const int8_t *xs[2] = {xq + (size_t)qr * l->k, xq + (size_t)(qr + rm - 1) * l->k};
            const float *ss[2] = {sa + (size_t)qr * st, sa + (size_t)(qr + rm - 1) * st};
            const float *cc[2] = {c + (size_t)qr * st, c + (size_t)(qr + rm - 1) * st};
            qdot_rows(l, rm, n0, xs, ss, cc, out);
            if (p2) { /* the planes' dot products add up to row r's */
                for (int i = 0; i < rows; i++) out[i] += out[ROWS + i];
                rm = 1;
            }
        }
        for (int j = 0; j < rm; j++)
            for (int i = 0; i < rows; i++)
                y[(size_t)(r + j) * ldy + n0 + i] = out[j * ROWS + i] + (l->bias ? l->bias[n0 + i] : 0.f);
    }
}

/* y[m][n] = x[m] . W[n] (+ bias) for m rows; called inside a parallel region (units of W's rows, unit(), split
 * between the threads: a static run each, then the pool), it ends with a barrier. xq, sa, c: scratch for 2m rows (2m * k bytes,
 * 2m * sub_stride(k) floats: an int16 linear's two planes per row); with rep, this thread's own. next: the projection that follows, whose weight
 * stream this thread starts before the barrier. more (or NULL): ranges fetched along the way. */
static void linear_rows(const kv_linear *l, int m, const float *x, float *y, int ldy, int8_t *xq, float *sa,
                        float *c, int rep, const kv_linear *next, kv_fetch *more) {
    int st = sub_stride(l->k), n_start, n_end;
    int ahead = my_rows(l, &n_start, &n_end);
    size_t share = more ? more->total / ((n_end - n_start) / unit(l) + 1) + 64 : 0; /* of `more`, a unit */
    int r0, r1, p2 = l->planes == 2 && !l->w; /* rep: each thread quantizes the (few) rows into its own buffers */
    span(rep, m, &r0, &r1);
    for (int r = r0; r < r1 && !l->w; r++) {
        const float *xr = x + (size_t)r * l->k;
        if (p2) /* row r's planes are rows 2r and 2r + 1 */
            quantize_row16(xr, l->k, l->bits, xq + (size_t)2 * r * l->k, sa + (size_t)2 * r * st, c + (size_t)2 * r * st,
                           xq + (size_t)(2 * r + 1) * l->k, sa + (size_t)(2 * r + 1) * st,
                           c + (size_t)(2 * r + 1) * st);
        else
            quantize_row(xr, l->k, l->bits, xq + (size_t)r * l->k, sa + (size_t)r * st, c + (size_t)r * st);
    }
    if (!rep) sync_team(); /* every row's input (and its quantization) is complete before any tile reads it */
    const int u = unit(l), units = (l->n + u - 1) / u, first = units - pooled_units(units);
    const int per = (units - first + POOL_CHUNKS * omp_get_num_threads() - 1) / (POOL_CHUNKS * omp_get_num_threads());
    for (int chunk = -1; chunk < 0 || first + chunk * per < units; /* the static run, then chunks of the pool */
         chunk = atomic_fetch_add_explicit(&team_barrier->pool, 1, memory_order_relaxed)) {
        if (chunk >= 0) {
            int c1 = first + (chunk + 1) * per;
            n_start = (first + chunk * per) * u, n_end = c1 < units ? c1 * u : l->n;
        }
        for (int n0 = n_start; n0 < n_end; n0 += u) {
            if ((!tiled(l) || TILE_PREFETCH_BYTES >= 0) && n0 + ahead < n_end) /* decode streams every weight once */
                fetch_rows(l, n0 + ahead, n0 + ahead + u < n_end ? n0 + ahead + u : n_end);
            if (more) fetch_some(more, share);
            unit_rows(l, m, n0, x, y, ldy, xq, sa, c);
        }
    }
    if (next) fetch_head(next);
    sync_team();
}

/* y = x W^T for m rows, on `threads` threads: the entry point the tests and benchmarks call */
int kv_linear_forward(const kv_linear *l, int m, const float *x, float *y, int threads) {
    int st = sub_stride(l->k);
    int8_t *xq = malloc((size_t)2 * m * l->k);
    float *sa = malloc(sizeof(float) * 2 * (size_t)m * st), *c = malloc(sizeof(float) * 2 * (size_t)m * st);
    if (!xq || !sa || !c) return -1;
    kv_barrier bar = {0, 0, 0, 0};
#pragma omp parallel num_threads(threads)
    {
        team_barrier = &bar;
        linear_rows(l, m, x, y, l->n, xq, sa, c, 0, NULL, NULL);
    }
    free(xq), free(sa), free(c);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* The decoder (kvedge.models.decoder) for RMSNorm models with rotary positions.                   */

typedef struct {
    /* NULL: absent (no attn_norm / mlp_norm: the sublayer reads the residual stream as it is, olmo2) */
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    kv_linear qkv, o, up, down;
    int32_t window;           /* sliding window, 0: none */
    void *k_cache, *v_cache;  /* [max_batch][hkv][max_seq][d] float32, float16 (kv_model.kv_half), or int8 with
                               * scales; written in place */
    /* an int8 cache's scales per KV head and channel [hkv][d], and their reciprocals (the write multiplies by
     * them, as kvedge.models.attention does); NULL for a float cache */
    const float *k_scale, *v_scale, *k_inv, *v_inv;
    const float *cos, *sin; /* this layer's RoPE tables [max_seq][rot_half]; NULL: no RoPE on this layer */
    kv_linear qkv_tail;     /* n > 0: qkv's rows past qkv.n, in another format (kv_forward); n = 0: none */
} kv_layer;

typedef struct {
    int32_t vocab, hidden, n_layers, hq, hkv, d, inter, rot_half, glu, act, unit_offset, max_batch, max_seq;
    int32_t qk_norm_all; /* q/k norms over the whole projection (all heads), not per head */
    int32_t kv_half;     /* 1: float caches hold float16, new k and v rounded to nearest even as they are written */
    float eps, attn_scale, attn_softcap, final_softcap, embed_scale; /* softcaps: 0 = none */
    float residual_scale, logits_divisor; /* sublayer outputs times residual_scale; logits / logits_divisor */
    kv_linear embed; /* [vocab][hidden]: looked up a row at a time in its own type (kv_weight_rows) */
    const float *final_norm;
    kv_linear lm_head;
    kv_layer *layers;
} kv_model;

/* The layout of kv_linear, kv_layer and kv_model for the Python side, which mirrors them as ctypes structs and
 * checks the mirrors against this at every load (native_backend.check_layout): entry i names a struct
 * ("kv_linear": offset 0, its sizeof) or one of its fields ("kv_linear.n": offsetof, sizeof), fields in
 * declaration order. A field added to a struct goes here too. */
typedef struct {
    const char *name;
    size_t offset, size;
} kv_layout_entry;
#define KV_STRUCT(T) {#T, 0, sizeof(T)}
#define KV_FIELD(T, f) {#T "." #f, offsetof(T, f), sizeof(((T *)0)->f)}
#define LIN(f) KV_FIELD(kv_linear, f)
#define LAY(f) KV_FIELD(kv_layer, f)
#define MOD(f) KV_FIELD(kv_model, f)
static const kv_layout_entry kv_layout_table[] = {
    KV_STRUCT(kv_linear), LIN(n), LIN(k), LIN(bits), LIN(sym), LIN(zsym), LIN(q), LIN(s), LIN(z), LIN(mins), LIN(w),
    LIN(bias), LIN(planes), LIN(s32), LIN(mins32), LIN(sc16), LIN(ksc),
    KV_STRUCT(kv_layer), LAY(attn_norm), LAY(mlp_norm), LAY(q_norm), LAY(k_norm), LAY(post_attn_norm),
    LAY(post_mlp_norm), LAY(qkv), LAY(o), LAY(up), LAY(down), LAY(window), LAY(k_cache), LAY(v_cache), LAY(k_scale),
    LAY(v_scale), LAY(k_inv), LAY(v_inv), LAY(cos), LAY(sin), LAY(qkv_tail),
    KV_STRUCT(kv_model), MOD(vocab), MOD(hidden), MOD(n_layers), MOD(hq), MOD(hkv), MOD(d), MOD(inter),
    MOD(rot_half), MOD(glu), MOD(act), MOD(unit_offset), MOD(max_batch), MOD(max_seq), MOD(qk_norm_all),
    MOD(kv_half), MOD(eps), MOD(attn_scale), MOD(attn_softcap), MOD(final_softcap), MOD(embed_scale),
    MOD(residual_scale), MOD(logits_divisor), MOD(embed), MOD(final_norm), MOD(lm_head), MOD(layers)};
#undef LIN
#undef LAY
#undef MOD

/* Entry i of the table: its name, with offset_size[0], [1] filled; NULL past the end. */
const char *kv_layout(int i, size_t *offset_size) {
    if (i < 0 || i >= (int)(sizeof kv_layout_table / sizeof kv_layout_table[0])) return NULL;
    offset_size[0] = kv_layout_table[i].offset, offset_size[1] = kv_layout_table[i].size;
    return kv_layout_table[i].name;
}

enum { ACT_SILU, ACT_GELU, ACT_GELU_TANH };

static inline float activate(int act, float v) {
    if (act == ACT_SILU) return v / (1.f + expf(-v));
    if (act == ACT_GELU) return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

/* x / sqrt(mean(x^2) + eps), times w (or 1 + w) */
static void rmsnorm(const float *x, const float *w, int n, float eps, int unit_offset, float *y) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] / r) * (unit_offset ? 1.f + w[i] : w[i]);
}

/* half rotation of the first 2 * half channels: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rope(float *x, const float *cs, const float *sn, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[half + i];
        x[i] = a * cs[i] - b * sn[i];
        x[half + i] = b * cs[i] + a * sn[i];
    }
}

#if KV_AVX2
/* e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
 * 2^f by its degree-6 Taylor polynomial (relative error < 2e-7); x is clamped at -87 (e^-87 is 1.6e-38). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f)); /* f ln2 */
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[i] = e^(s[i] - mx) for i < n; returns their sum */
static float softmax_exp(float *s, int n, float mx) {
    float sum = 0.f;
    int i = 0;
#if KV_AVX2
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum_f32(acc);
#elif KV_NEON
    float32x4_t acc = vdupq_n_f32(0.f), m = vdupq_n_f32(mx);
    for (; i + 4 <= n; i += 4) {
        float32x4_t e = exp_neg4(vsubq_f32(vld1q_f32(s + i), m));
        vst1q_f32(s + i, e);
        acc = vaddq_f32(acc, e);
    }
    sum = vaddvq_f32(acc);
#endif
    for (; i < n; i++) sum += (s[i] = expf(s[i] - mx));
    return sum;
}

/* a[i] = act(u[i]) (* u[I + i] for a GLU) for i in [i0, i1); SiLU 8 at a time on AVX2 (and NEON: silu4):
 * v * sigmoid(v), sigmoid(v) = 1 / (1 + e) for v >= 0 and e / (1 + e) below, e = exp(-|v|) */
static void act_chunk(const kv_model *m, const float *u, float *a, int i0, int i1) {
    int I = m->inter, i = i0;
#if KV_AVX2
    if (m->act == ACT_SILU && i1 - i0 == 8) {
        __m256 v = _mm256_loadu_ps(u + i0), one = _mm256_set1_ps(1.f);
        __m256 e = exp_neg(_mm256_or_ps(v, _mm256_set1_ps(-0.f))); /* -|v| */
        __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, v), _mm256_add_ps(one, e)); /* v < 0: e */
        __m256 y = _mm256_mul_ps(v, sig);
        if (m->glu) y = _mm256_mul_ps(y, _mm256_loadu_ps(u + I + i0));
        _mm256_storeu_ps(a + i0, y);
        return;
    }
#elif KV_NEON
    if (m->act == ACT_SILU && i1 - i0 == 8) {
        for (int h = i0; h < i1; h += 4) {
            float32x4_t y = silu4(vld1q_f32(u + h));
            vst1q_f32(a + h, m->glu ? vmulq_f32(y, vld1q_f32(u + I + h)) : y);
        }
        return;
    }
#endif
    for (; i < i1; i++) a[i] = m->glu ? activate(m->act, u[i]) * u[I + i] : activate(m->act, u[i]);
}

#define QB 4 /* queries of one row and head attended together: each K and V row is loaded once for them */

/* Write d values of a new k or v row into an int8 cache: round-half-even(x * (1 / scale)) clamped to
 * [-128, 127] (kvedge.models.attention.quantize_kv) */
static void store_int8(int8_t *to, const float *x, const float *inv, int d) {
    for (int t = 0; t < d; t++) {
        float v = nearbyintf(x[t] * inv[t]);
        to[t] = (int8_t)(v < -128.f ? -128.f : v > 127.f ? 127.f : v);
    }
}

/* Write d values of a new k or v row into a float16 cache (rounded to nearest even, as torch's .to(float16)) */
static void store_half(_Float16 *to, const float *x, int d) {
    for (int t = 0; t < d; t++) to[t] = (_Float16)x[t];
}

/* An int8 or float16 cache's rows [lo, hi] of one (batch row, KV head), as float32 (int8 * scale, as the
 * reference attends them) in a thread's rows indexed like the cache; kept across the attention items this
 * thread takes and only extended, as items of one KV head come in rising positions. */
typedef struct {
    int b, kh, lo, hi; /* b < 0: nothing held */
    float *k, *v;      /* [max_seq][d] */
} kv_deq;

static void deq_rows(const kv_model *m, const kv_layer *ly, int b, int kh, int j0, int j1, kv_deq *q) {
    size_t d = m->d, base = ((size_t)b * m->hkv + kh) * m->max_seq * d;
    if (!ly->k_scale) { /* float16 */
        size_t e = (size_t)j0 * d, end = (size_t)(j1 + 1) * d;
        const _Float16 *k16 = (const _Float16 *)ly->k_cache + base, *v16 = (const _Float16 *)ly->v_cache + base;
#if KV_AVX2
        for (; e + 8 <= end; e += 8) /* GCC leaves the _Float16 loop below scalar */
            _mm256_storeu_ps(q->k + e, load_half8((const uint16_t *)k16 + e)),
                _mm256_storeu_ps(q->v + e, load_half8((const uint16_t *)v16 + e));
#endif
        for (; e < end; e++) q->k[e] = (float)k16[e], q->v[e] = (float)v16[e];
        return;
    }
    const int8_t *k8 = (const int8_t *)ly->k_cache + base, *v8 = (const int8_t *)ly->v_cache + base;
    const float *ks = ly->k_scale + kh * d, *vs = ly->v_scale + kh * d;
    for (size_t j = j0; (int)j <= j1; j++)
#pragma omp simd
        for (size_t t = 0; t < d; t++) q->k[j * d + t] = (float)k8[j * d + t] * ks[t], q->v[j * d + t] = (float)v8[j * d + t] * vs[t];
}

static void deq_need(const kv_model *m, const kv_layer *ly, int b, int kh, int lo, int hi, kv_deq *q) {
    if (q->b != b || q->kh != kh) q->b = b, q->kh = kh, q->lo = lo, q->hi = lo - 1;
    if (lo < q->lo) deq_rows(m, ly, b, kh, lo, q->lo - 1, q), q->lo = lo;
    if (hi > q->hi) deq_rows(m, ly, b, kh, q->hi + 1, hi, q), q->hi = hi;
}

/* The first cache slot a query at position p sees (window 0: none) */
static inline int first_slot(int p, int window) { return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0; }

/* Queries i < nq over one KV head's cache, sharing every K and V load: consecutive positions of one row and
 * head (prefill), or the query heads of one KV head at one position (decode, GQA). Query i, at position
 * ps[i] (non-decreasing), sees slots [lo_i, ps[i]], lo_i = max(0, ps[i] - window + 1) (window 0: none),
 * of which this call takes those in [j0, j1] (each query must keep one). ml NULL: out is the attention
 * output. Else a slice's share, to be merged: out unnormalized, ml[2i], ml[2i + 1] query i's largest score
 * and its sum of e^(score - largest). scores: QB * max_seq. */
static void attend(const kv_model *m, const float *const *q, int nq, const int *ps, int window, const float *kc,
                   const float *vc, float *scores, float *const *out, int j0, int j1, float *ml) {
    int d = m->d, lo[QB], p[QB];
    for (int i = 0; i < QB; i++) {
        p[i] = ps[i < nq ? i : nq - 1];
        lo[i] = first_slot(p[i], window);
        lo[i] = lo[i] > j0 ? lo[i] : j0, p[i] = p[i] < j1 ? p[i] : j1;
    }
    int first = lo[0], hi = p[QB - 1];
    float *sc[QB], mx[QB];
    for (int i = 0; i < QB; i++) sc[i] = scores + (size_t)i * m->max_seq, mx[i] = -INFINITY;
    int j = first;
#if KV_AVX2
    if (d % 8 == 0) { /* 2 keys x the queries at a time, in 2 QB accumulators (4 keys' 4 QB spilled registers) */
        __m128 mxv[QB];
        for (int i = 0; i < QB; i++) mxv[i] = _mm_set1_ps(-INFINITY);
        for (; j <= hi; j += 2) { /* a last odd key pairs with itself: a key's score never depends on its partner, so
                                   * on where a chunk starts or ends (a row alone or padded among others) */
            const float *k1p = kc + (size_t)(j + 1 <= hi ? j + 1 : j) * d;
            __m256 acc[QB][2];
            for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int t = 0; t < d; t += 8) {
                __m256 k0 = _mm256_loadu_ps(kc + (size_t)j * d + t), k1 = _mm256_loadu_ps(k1p + t);
#pragma GCC unroll 4
                for (int i = 0; i < QB; i++) {
                    if (i >= nq) break;
                    __m256 qv = _mm256_loadu_ps(q[i] + t);
                    acc[i][0] = _mm256_fmadd_ps(qv, k0, acc[i][0]), acc[i][1] = _mm256_fmadd_ps(qv, k1, acc[i][1]);
                }
            }
            for (int i = 0; i < nq; i++) { /* [s0 s0 s1 s1 | s0 s0 s1 s1] partial sums -> s0, s1 */
                __m256 h = _mm256_hadd_ps(acc[i][0], acc[i][1]);
                __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                __m128 s2 = _mm_mul_ps(_mm_hadd_ps(h4, h4), _mm_set1_ps(m->attn_scale)); /* [s0 s1 s0 s1] */
                if (j >= lo[i] && j + 1 <= p[i] && !(m->attn_softcap > 0.f)) { /* both keys in query i's slots: no branch a key */
                    _mm_storel_pi((__m64 *)(sc[i] + j), s2);
                    mxv[i] = _mm_max_ps(mxv[i], s2);
                    continue;
                }
                float s4[4];
                _mm_storeu_ps(s4, s2);
                for (int kk = 0; kk < 2; kk++) {
                    if (j + kk < lo[i] || j + kk > p[i]) continue;
                    float v = s4[kk];
                    if (m->attn_softcap > 0.f) v = tanhf(v / m->attn_softcap) * m->attn_softcap;
                    sc[i][j + kk] = v;
                    mx[i] = v > mx[i] ? v : mx[i];
                }
            }
        }
        for (int i = 0; i < nq; i++) {
            __m128 v = _mm_max_ps(mxv[i], _mm_movehl_ps(mxv[i], mxv[i]));
            float f = _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
            mx[i] = f > mx[i] ? f : mx[i];
        }
    }
#endif
    for (; j <= hi; j++) {
        const float *k = kc + (size_t)j * d;
        float s[QB];
        for (int i = 0; i < nq; i++) s[i] = fdot(q[i], k, d);
        for (int i = 0; i < nq; i++) {
            if (j < lo[i] || j > p[i]) continue;
            float v = s[i] * m->attn_scale;
            if (m->attn_softcap > 0.f) v = tanhf(v / m->attn_softcap) * m->attn_softcap;
            sc[i][j] = v;
            mx[i] = v > mx[i] ? v : mx[i];
        }
    }
    for (int i = 0; i < QB; i++) {
        if (i < nq) {
            float sum = softmax_exp(sc[i] + lo[i], p[i] - lo[i] + 1, mx[i]);
            if (ml)
                ml[2 * i] = mx[i], ml[2 * i + 1] = sum;
            else {
                float inv = 1.f / sum;
                for (int j = lo[i]; j <= p[i]; j++) sc[i][j] *= inv;
            }
        }
        for (int j = first; i < nq && j < lo[i]; j++) sc[i][j] = 0.f; /* weight 0 outside each query's slots */
        for (int j = p[i] + 1; i < nq && j <= hi; j++) sc[i][j] = 0.f;
    }
#if KV_AVX2
    if (d % 64 == 0) { /* 64 channels of one query's output in 8 registers over all the slots (not loaded and stored
                        * a slot), 8 independent chains of FMAs */
        for (int i = 0; i < nq; i++)
            for (int t = 0; t < d; t += 64) {
                __m256 acc[8];
                for (int e = 0; e < 8; e++) acc[e] = _mm256_setzero_ps();
                for (int j = first; j <= hi; j++) {
                    __m256 w = _mm256_broadcast_ss(sc[i] + j);
                    const float *v = vc + (size_t)j * d + t;
#pragma GCC unroll 8
                    for (int e = 0; e < 8; e++) acc[e] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * e), acc[e]);
                }
                for (int e = 0; e < 8; e++) _mm256_storeu_ps(out[i] + t + 8 * e, acc[e]);
            }
        return;
    }
#endif
    for (int i = 0; i < nq; i++)
        for (int t = 0; t < d; t++) out[i][t] = 0.f;
    for (int j = first; j <= hi; j++) {
        const float *v = vc + (size_t)j * d;
        for (int i = 0; i < nq; i++) {
            float w = sc[i][j];
            float *o = out[i];
#pragma omp simd
            for (int t = 0; t < d; t++) o[t] += w * v[t];
        }
    }
}

/* Decode splits an item's slots in slices when the items alone would leave threads idle (3 KV heads on 2
 * threads: one thread does two, the other one); slices are at least this many slots long */
#ifndef SLICE_MIN
#define SLICE_MIN 64
#endif

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* How many slices decode cuts each item of layer li in, for B rows at positions pos (one a row) on nt threads:
 * the items are the (row, KV head, block of QB query heads) triples; enough slices that the units split evenly
 * between the threads, none under SLICE_MIN slots of the longest row's span; 1 (none) under 2 SLICE_MIN slots */
static inline int decode_slices(const kv_model *m, int li, int B, const int64_t *pos, int nt) {
    int items = B * m->hkv * ((m->hq / m->hkv + QB - 1) / QB), longest = 0, parts;
    for (int b = 0; b < B; b++) {
        int n = (int)pos[b] - first_slot((int)pos[b], m->layers[li].window) + 1;
        longest = n > longest ? n : longest;
    }
    if (longest < 2 * SLICE_MIN) return 1;
    parts = nt / gcd(items, nt);
    return parts < longest / SLICE_MIN ? parts : longest / SLICE_MIN;
}
int kv_decode_slices(const kv_model *m, int li, int B, const int64_t *pos, int nt) { /* for the tests */
    return decode_slices(m, li, B, pos, nt);
}

/* slice k of `parts` near-equal slices of slots [lo, hi]: [*s0, *s1] (empty when *s1 < *s0) */
static inline void slice(int lo, int hi, int k, int parts, int *s0, int *s1) {
    long n = hi - lo + 1;
    *s0 = lo + (int)(n * k / parts), *s1 = lo + (int)(n * (k + 1) / parts) - 1;
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* kv_forward's scratch for B rows of L tokens on `threads` threads: the buffers' byte offsets in one block
 * (each 64-byte aligned; at[9] is the total). A few rows (decode, rep): every thread keeps its own copy of
 * the residual stream, norms it and quantizes each projection's input itself, so only the projections,
 * rotation, attention and activation are split: 6 barriers a layer (7 when decode slices the slots). Many rows (prefill): every phase is
 * split, 10 barriers a layer. Two output buffers: qkv and up write t, o and down write t2, so with rep a
 * projection never writes a buffer another thread may still be reading for its residual. */
enum { S_X, S_H, S_T, S_T2, S_A, S_XQ, S_SA, S_C, S_SCORES, S_DEQ, S_PART, S_END };
static void scratch_layout(const kv_model *m, int B, int L, int threads, size_t at[S_END + 1]) {
    size_t M = (size_t)B * L, H = m->hidden, kmax = max3(H, (size_t)m->hq * m->d, m->inter);
    size_t copies = M <= 4 ? threads : 1, qkv_n = (size_t)(m->hq + 2 * m->hkv) * m->d;
    size_t up_n = (size_t)m->inter * (m->glu ? 2 : 1), a_n = max3((size_t)m->hq * m->d, m->inter, 0);
    size_t bytes[S_END] = {sizeof(float) * copies * M * H, sizeof(float) * copies * M * H,
                           sizeof(float) * M * (qkv_n > up_n ? qkv_n : up_n), sizeof(float) * M * H,
                           sizeof(float) * M * a_n, 2 * copies * M * kmax,
                           sizeof(float) * 2 * copies * M * sub_stride(kmax),
                           sizeof(float) * 2 * copies * M * sub_stride(kmax), /* two planes a row (int16) */ sizeof(float) * threads * QB * m->max_seq,
                           /* an int8 or float16 cache's K and V rows as float32, per thread */
                           m->layers[0].k_scale || m->kv_half ? sizeof(float) * threads * 2 * m->max_seq * m->d : 0,
                           /* decode's slices: per item and slice, QB queries' largest score, sum and output */
                           L == 1 ? sizeof(float) * B * m->hkv * ((m->hq / m->hkv + QB - 1) / QB) * threads * QB * (m->d + 2)
                                  : 0};
    at[0] = 0;
    for (int i = 0; i < S_END; i++) at[i + 1] = (at[i] + bytes[i] + 63) & ~(size_t)63;
}

/* Bytes of scratch kv_forward needs (the caller keeps one block and reuses it: allocating per call made the
 * kernel zero fresh pages on every prefill). */
size_t kv_scratch_bytes(const kv_model *m, int B, int L, int threads) {
    size_t at[S_END + 1];
    scratch_layout(m, B, L, threads, at);
    return at[S_END] + 64;
}

/* Run B rows of L tokens (ids, pos [B][L]; positions contiguous per row) through the decoder, writing
 * each row's k, v into the caches, and the logits of positions logit_index[b][0..K-1] of each row (K <= L:
 * generation asks 1, kvedge eval every position of its chunk) to logits [B][K][vocab].
 * scratch: kv_scratch_bytes(m, B, L, threads) bytes. */
/* One thread's view of a kv_forward call: the phases below run inside its parallel region, each ending at the
 * team's barrier where its output is another thread's input. */
typedef struct {
    const kv_model *m;
    int B, L, M, rep, tid, r0, r1, qkv_n, up_n; /* rep: every thread computes all M rows itself (M <= 4) */
    const int64_t *pos;
    float *xs, *hs;                              /* the residual stream and the normed rows: this thread's or shared */
    float *t, *t2, *a, *part, *sc;               /* projections' outputs, attention's, slices' shares, scores */
    int8_t *qs8;                                 /* the projections' quantized inputs, their scales and sums */
    float *sas, *cs;
    kv_deq dq;                                   /* an int8 / float16 cache's rows as float32 */
} kv_step;

/* attention's work items: prefill, blocks of QB consecutive queries of one head; decode (L = 1), the query heads
 * of one KV head in groups of QB, so each K/V row is read once for them; decode splits an item into `parts`
 * slices (unit u: item u / parts, slice u % parts) so that the units split evenly between the threads */
typedef struct {
    int per, heads, items, parts;
} kv_items;

static kv_items attention_items(const kv_step *s, int li) {
    const kv_model *m = s->m;
    int g = m->hq / m->hkv, L = s->L;
    kv_items w = {L > 1 ? (L + QB - 1) / QB : (g + QB - 1) / QB, L > 1 ? m->hq : m->hkv, 0, 1};
    w.items = s->B * w.heads * w.per;
    if (L == 1) w.parts = decode_slices(m, li, s->B, s->pos, omp_get_num_threads());
    return w;
}

/* decode: the cache rows this thread's attention units will read (unit u: thread u % nt), fetched during qkv */
static void plan_cache_fetch(const kv_step *s, const kv_layer *ly, kv_items w, kv_fetch *more) {
    const kv_model *m = s->m;
    int nt = omp_get_num_threads(), d = m->d;
    size_t esize = ly->k_scale ? 1 : m->kv_half ? 2 : sizeof(float); /* a cache element's bytes */
    for (int u = s->tid; u < w.items * w.parts; u += nt) {
        int it = u / w.parts, b = it / (w.heads * w.per), kh = it / w.per % w.heads, p = (int)s->pos[b], lo, hi;
        slice(first_slot(p, ly->window), p, u % w.parts, w.parts, &lo, &hi);
        hi = hi < p - 1 ? hi : p - 1; /* slot p is written this step */
        if (hi < lo) continue;
        size_t at = esize * (((size_t)b * m->hkv + kh) * m->max_seq + lo) * d, bytes = esize * (size_t)(hi - lo + 1) * d;
        const char *kp = (const char *)ly->k_cache + at, *vp = (const char *)ly->v_cache + at;
        if (more->count && more->p[more->count - 2] == kp) continue; /* a KV head's next block of queries */
        fetch_add(more, kp, bytes), fetch_add(more, vp, bytes);
    }
}

/* q/k norms, rotation and the cache write of the new k, v rows: one (row, head) at a time */
static void qk_rotate_and_store(const kv_step *s, const kv_layer *ly) {
    const kv_model *m = s->m;
    int hq = m->hq, hkv = m->hkv, d = m->d, qkv_n = s->qkv_n;
    float *t = s->t;
    if (m->qk_norm_all) { /* q/k norms over all heads of a row's projection at once */
#pragma omp for schedule(static) nowait
        for (int r = 0; r < s->M; r++) {
            float *v = t + (size_t)r * qkv_n;
            rmsnorm(v, ly->q_norm, hq * d, m->eps, m->unit_offset, v);
            rmsnorm(v + (size_t)hq * d, ly->k_norm, hkv * d, m->eps, m->unit_offset, v + (size_t)hq * d);
        }
        sync_team();
    }
#pragma omp for schedule(static) collapse(2) nowait
    for (int r = 0; r < s->M; r++)
        for (int hh = 0; hh < hq + hkv; hh++) {
            int b = r / s->L;
            int64_t p = s->pos[r];
            float *v = t + (size_t)r * qkv_n + (size_t)hh * d;
            const float *nw = hh < hq ? ly->q_norm : ly->k_norm;
            if (nw && !m->qk_norm_all) rmsnorm(v, nw, d, m->eps, m->unit_offset, v);
            if (m->rot_half && ly->cos) rope(v, ly->cos + p * m->rot_half, ly->sin + p * m->rot_half, m->rot_half);
            if (hh >= hq) {
                int kh = hh - hq;
                size_t slot = (((size_t)b * hkv + kh) * m->max_seq + p) * d;
                if (ly->k_scale) {
                    store_int8((int8_t *)ly->k_cache + slot, v, ly->k_inv + (size_t)kh * d, d);
                    store_int8((int8_t *)ly->v_cache + slot, v + (size_t)hkv * d, ly->v_inv + (size_t)kh * d, d);
                } else if (m->kv_half) {
                    store_half((_Float16 *)ly->k_cache + slot, v, d);
                    store_half((_Float16 *)ly->v_cache + slot, v + (size_t)hkv * d, d);
                } else {
                    memcpy((float *)ly->k_cache + slot, v, sizeof(float) * d);
                    memcpy((float *)ly->v_cache + slot, v + (size_t)hkv * d, sizeof(float) * d);
                }
            }
        }
    sync_team();
}

/* every attention unit into a (or, sliced, into its share in part) */
static void attend_items(kv_step *s, const kv_layer *ly, kv_items w) {
    const kv_model *m = s->m;
    int g = m->hq / m->hkv, d = m->d, L = s->L, hq = m->hq, hkv = m->hkv;
#pragma omp for schedule(static, 1) nowait
    for (int u = 0; u < w.items * w.parts; u++) {
        int it = u / w.parts, b = it / (w.heads * w.per), hh = it / w.per % w.heads, blk = it % w.per;
        int nq = L > 1 ? (L - blk * QB < QB ? L - blk * QB : QB) : (g - blk * QB < QB ? g - blk * QB : QB);
        const float *qp[QB];
        float *outs[QB], *ml = NULL;
        int ps[QB], kh = L > 1 ? hh / g : hh, j0 = 0, j1 = m->max_seq;
        for (int i = 0; i < QB; i++) {
            int ii = i < nq ? i : 0;
            int r = L > 1 ? b * L + blk * QB + ii : b, head = L > 1 ? hh : hh * g + blk * QB + ii;
            qp[i] = s->t + (size_t)r * s->qkv_n + (size_t)head * d;
            outs[i] = s->a + (size_t)r * hq * d + (size_t)head * d;
            ps[i] = (int)s->pos[r];
        }
        if (w.parts > 1) { /* decode: this slice's share, into the unit's place for the merge below */
            slice(first_slot(ps[0], ly->window), ps[0], u % w.parts, w.parts, &j0, &j1);
            ml = s->part + (size_t)u * QB * (d + 2);
            for (int i = 0; i < QB; i++) outs[i] = ml + 2 * QB + (size_t)i * d;
            if (j1 < j0) { /* a short row's empty slice */
                for (int i = 0; i < QB; i++) ml[2 * i + 1] = 0.f;
                continue;
            }
        }
        size_t base = ((size_t)b * hkv + kh) * m->max_seq * d;
        const float *kc = (const float *)ly->k_cache + base, *vc = (const float *)ly->v_cache + base;
        if (ly->k_scale || m->kv_half) { /* int8 or float16: the rows these queries see, as float32 */
            int lo = first_slot(ps[0], ly->window), hi = ps[nq - 1];
            deq_need(m, ly, b, kh, lo > j0 ? lo : j0, hi < j1 ? hi : j1, &s->dq);
            kc = s->dq.k, vc = s->dq.v;
        }
        attend(m, qp, nq, ps, ly->window, kc, vc, s->sc, outs, j0, j1, ml);
    }
    sync_team();
}

/* decode's slices merged per query: shares weighted e^(their largest - the largest) */
static void merge_slices(const kv_step *s, kv_items w) {
    const kv_model *m = s->m;
    int g = m->hq / m->hkv, d = m->d, parts = w.parts;
#pragma omp for schedule(static) nowait
    for (int x = 0; x < w.items * QB; x++) {
        int it = x / QB, i = x % QB, b = it / (w.heads * w.per), hh = it / w.per % w.heads, blk = it % w.per;
        if (blk * QB + i >= g) continue; /* an absent query of the last block */
        float *o = s->a + (size_t)b * m->hq * d + (size_t)(hh * g + blk * QB + i) * d, mx = -INFINITY, sum = 0.f;
        for (int k = 0; k < parts; k++) {
            const float *mk = s->part + (size_t)(it * parts + k) * QB * (d + 2);
            if (mk[2 * i + 1] > 0.f && mk[2 * i] > mx) mx = mk[2 * i];
        }
        for (int e = 0; e < d; e++) o[e] = 0.f;
        for (int k = 0; k < parts; k++) {
            const float *mk = s->part + (size_t)(it * parts + k) * QB * (d + 2), *ok = mk + 2 * QB + (size_t)i * d;
            if (!(mk[2 * i + 1] > 0.f)) continue; /* empty */
            float wk = expf(mk[2 * i] - mx);
            sum += wk * mk[2 * i + 1];
#pragma omp simd
            for (int e = 0; e < d; e++) o[e] += wk * ok[e];
        }
        for (int e = 0; e < d; e++) o[e] /= sum;
    }
    sync_team();
}

/* h = a block's input: this thread's rows [r0, r1) of x normed by w (or copied: no norm) */
static void norm_rows(const kv_step *s, const float *w) {
    const kv_model *m = s->m;
    int H = m->hidden;
    for (int r = s->r0; r < s->r1; r++)
        if (w) rmsnorm(s->xs + (size_t)r * H, w, H, m->eps, m->unit_offset, s->hs + (size_t)r * H);
        else memcpy(s->hs + (size_t)r * H, s->xs + (size_t)r * H, sizeof(float) * H);
}

/* x += the projection's rows t2, post-normed into h first where the layer has that norm (t2 stays read-only) */
static void add_residual(const kv_step *s, const float *post_norm) {
    const kv_model *m = s->m;
    int H = m->hidden;
    for (int r = s->r0; r < s->r1; r++) {
        const float *o = s->t2 + (size_t)r * H;
        float *xr = s->xs + (size_t)r * H;
        if (post_norm) rmsnorm(o, post_norm, H, m->eps, m->unit_offset, s->hs + (size_t)r * H), o = s->hs + (size_t)r * H;
        for (int i = 0; i < H; i++) xr[i] += o[i] * m->residual_scale;
    }
}

/* layer li's attention block: its input norm, qkv, rotation and cache write, attention, o and the residual */
static void attention_block(kv_step *s, int li) {
    const kv_model *m = s->m;
    const kv_layer *ly = &m->layers[li];
    int H = m->hidden;
    norm_rows(s, ly->attn_norm); /* rows [r0, r1) are this thread's up to each projection's quantized input */
    kv_items w = attention_items(s, li);
    kv_fetch more = {0};
    if (s->L == 1) plan_cache_fetch(s, ly, w, &more);
    s->dq.b = -1; /* a new layer's cache */
    /* a qkv whose last rows are of another format (qkv_tail: a GGUF file's attn_v in Q6_K beside Q4_K q and k) is
     * two projections into the same rows of t */
    linear_rows(&ly->qkv, s->M, s->hs, s->t, s->qkv_n, s->qs8, s->sas, s->cs, s->rep,
                ly->qkv_tail.n ? &ly->qkv_tail : &ly->o, s->L == 1 ? &more : NULL);
    if (ly->qkv_tail.n)
        linear_rows(&ly->qkv_tail, s->M, s->hs, s->t + ly->qkv.n, s->qkv_n, s->qs8, s->sas, s->cs, s->rep, &ly->o, NULL);
    qk_rotate_and_store(s, ly);
    attend_items(s, ly, w);
    if (w.parts > 1) merge_slices(s, w);
    linear_rows(&ly->o, s->M, s->a, s->t2, H, s->qs8, s->sas, s->cs, s->rep, &ly->up, NULL);
    add_residual(s, ly->post_attn_norm);
    norm_rows(s, ly->mlp_norm);
}

/* layer li's MLP block: up (and gate), the activation, down and the residual */
static void mlp_block(kv_step *s, int li) {
    const kv_model *m = s->m;
    const kv_layer *ly = &m->layers[li];
    int I = m->inter, chunks = (I + 7) / 8;
    linear_rows(&ly->up, s->M, s->hs, s->t, s->up_n, s->qs8, s->sas, s->cs, s->rep, &ly->down, NULL);
#pragma omp for schedule(static) collapse(2) nowait
    for (int r = 0; r < s->M; r++)
        for (int ch = 0; ch < chunks; ch++)
            act_chunk(m, s->t + (size_t)r * s->up_n, s->a + (size_t)r * I, ch * 8, ch * 8 + 8 < I ? ch * 8 + 8 : I);
    sync_team();
    linear_rows(&ly->down, s->M, s->a, s->t2, m->hidden, s->qs8, s->sas, s->cs, s->rep,
                li + 1 < m->n_layers ? &m->layers[li + 1].qkv : &m->lm_head, NULL);
    add_residual(s, ly->post_mlp_norm);
}

/* the final norm of each output row (position logit_index[j] of batch row j / K), the head and its scalings */
static void logits_rows(kv_step *s, const int64_t *logit_index, int K, float *logits) {
    const kv_model *m = s->m;
    int H = m->hidden, n = s->B * K, j0, j1; /* n <= M: hs holds them */
    if (!s->rep) sync_team(); /* the final norm splits by output row: other threads' token rows */
    span(s->rep, n, &j0, &j1);
    for (int j = j0; j < j1; j++)
        rmsnorm(s->xs + ((size_t)(j / K) * s->L + logit_index[j]) * H, m->final_norm, H, m->eps, m->unit_offset,
                s->hs + (size_t)j * H);
    linear_rows(&m->lm_head, n, s->hs, logits, m->vocab, s->qs8, s->sas, s->cs, s->rep, NULL, NULL);
    if (m->logits_divisor != 1.f) {
#pragma omp for schedule(static) nowait
        for (size_t i = 0; i < (size_t)n * m->vocab; i++) logits[i] /= m->logits_divisor;
        sync_team();
    }
    if (m->final_softcap > 0.f) {
#pragma omp for schedule(static) nowait
        for (size_t i = 0; i < (size_t)n * m->vocab; i++) logits[i] = tanhf(logits[i] / m->final_softcap) * m->final_softcap;
        sync_team();
    }
}

void kv_forward(const kv_model *m, int B, int L, const int64_t *ids, const int64_t *pos, const int64_t *logit_index,
                int K, float *logits, int threads, void *scratch) {
    int M = B * L, H = m->hidden, d = m->d;
    size_t kmax = max3(H, (size_t)m->hq * d, m->inter), at[S_END + 1];
    int rep = M <= 4;
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    scratch_layout(m, B, L, threads, at);
    float *x = (float *)(base + at[S_X]), *h = (float *)(base + at[S_H]), *sa = (float *)(base + at[S_SA]);
    float *c = (float *)(base + at[S_C]), *scores = (float *)(base + at[S_SCORES]), *deq = (float *)(base + at[S_DEQ]);
    int8_t *xq = (int8_t *)(base + at[S_XQ]);
    kv_barrier bar = {0, 0, 0, 0};
#pragma omp parallel num_threads(threads)
    {
        team_barrier = &bar;
        int tid = omp_get_thread_num(), me = rep ? tid : 0;
        kv_step s = {m, B, L, M, rep, tid, 0, 0, (m->hq + 2 * m->hkv) * d, m->glu ? 2 * m->inter : m->inter, pos,
                     x + (size_t)me * M * H, h + (size_t)me * M * H, /* this thread's (or the shared) */
                     (float *)(base + at[S_T]), (float *)(base + at[S_T2]), (float *)(base + at[S_A]),
                     (float *)(base + at[S_PART]), scores + (size_t)tid * QB * m->max_seq,
                     xq + (size_t)2 * me * M * kmax, sa + (size_t)2 * me * M * sub_stride(kmax),
                     c + (size_t)2 * me * M * sub_stride(kmax),
                     {-1, 0, 0, 0, deq + (size_t)tid * 2 * m->max_seq * d, deq + ((size_t)tid * 2 + 1) * m->max_seq * d}};
        span(rep, M, &s.r0, &s.r1);
        for (int r = s.r0; r < s.r1; r++) kv_weight_rows(&m->embed, 1, ids + r, m->embed_scale, s.xs + (size_t)r * H);
        for (int li = 0; li < m->n_layers; li++) {
            attention_block(&s, li);
            mlp_block(&s, li);
        }
        logits_rows(&s, logit_index, K, logits);
    }
}
