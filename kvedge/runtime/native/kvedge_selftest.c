/* kvedge_selftest: runs the engine's entry points on inputs a file describes, for an engine build the Python side
 * cannot load: another instruction set's, run under qemu-user (tests/runtime/test_native_arm.py). The file comes
 * from kvedge.runtime.native_dump, which writes the x86 engine's packed structs and every buffer they point into;
 * both sides are LP64 and little-endian, so the structs lay out alike (kv_layout checks it on each side).
 *
 *   kvedge_selftest FILE   -> each call's outputs on stdout, raw, in call order
 *
 * FILE (little-endian): "KVD1"; u32 regions, each u64 bytes then the bytes; u32 relocations, each u32 region,
 * u64 offset, u32 target, u64 target offset (a pointer at region + offset to target + target offset); u32 calls,
 * each u32 kind and its u32 arguments (regions by index):
 *   0 kv_simd:           -> int32
 *   1 kv_linear_forward: linear, m, x, threads                         -> float32 [m][n]
 *   2 kv_forward:        model, B, L, ids, positions, logit_index, K, threads -> float32 [B][K][vocab]
 *   3 kv_layout:         -> per struct and field: u32 name bytes, the name, u64 offset, u64 size; then u32 0
 *   4 the float helpers: x, n (a multiple of 8) -> float32: softmax_exp of x[0..n-1) (e^(x - max), then their
 *                        sum), then SiLU of x[0..n) (act_chunk, 8 at a time)
 * Exits 1 with a one-line reason on a malformed file. */
#include "kvedge_cpu.c"

#include <stdio.h>

static FILE *in;

static void need(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "kvedge_selftest: %s\n", what);
        exit(1);
    }
}

static uint64_t rd(int bytes) {
    uint64_t v = 0;
    need(fread(&v, bytes, 1, in) == 1, "the file ends early");
    return v;
}

int main(int argc, char **argv) {
    need(argc == 2 && (in = fopen(argv[1], "rb")) != NULL, "usage: kvedge_selftest FILE (a readable file)");
    char magic[4];
    need(fread(magic, 4, 1, in) == 1 && !memcmp(magic, "KVD1", 4), "not a KVD1 file");
    uint32_t nr = (uint32_t)rd(4);
    char **region = calloc(nr, sizeof *region);
    uint64_t *size = calloc(nr, sizeof *size);
    need(region && size, "out of memory");
    for (uint32_t i = 0; i < nr; i++) {
        size[i] = rd(8);
        region[i] = aligned_alloc(64, (size[i] + 63) & ~(uint64_t)63);
        need(region[i] && (size[i] == 0 || fread(region[i], size[i], 1, in) == 1), "a region is short");
    }
    for (uint32_t n = (uint32_t)rd(4); n; n--) {
        uint32_t r = (uint32_t)rd(4);
        uint64_t at = rd(8);
        uint32_t t = (uint32_t)rd(4);
        uint64_t off = rd(8);
        need(r < nr && t < nr && at + sizeof(void *) <= size[r] && off <= size[t], "a relocation is out of range");
        void *p = region[t] + off;
        memcpy(region[r] + at, &p, sizeof p);
    }
    for (uint32_t n = (uint32_t)rd(4); n; n--) {
        uint32_t kind = (uint32_t)rd(4);
        if (kind == 0) {
            int32_t simd = kv_simd();
            fwrite(&simd, sizeof simd, 1, stdout);
        } else if (kind == 1) {
            uint32_t l = (uint32_t)rd(4), m = (uint32_t)rd(4), x = (uint32_t)rd(4), threads = (uint32_t)rd(4);
            need(l < nr && x < nr && size[l] >= sizeof(kv_linear), "a linear call names no linear");
            const kv_linear *lin = (const kv_linear *)region[l];
            need(size[x] >= (uint64_t)m * lin->k * sizeof(float), "a linear call's input is short");
            float *y = malloc(sizeof(float) * (size_t)m * lin->n);
            need(y && kv_linear_forward(lin, (int)m, (const float *)region[x], y, (int)threads) == 0,
                 "kv_linear_forward failed");
            fwrite(y, sizeof(float), (size_t)m * lin->n, stdout);
            free(y);
        } else if (kind == 2) {
            uint32_t a[8];
            for (int i = 0; i < 8; i++) a[i] = (uint32_t)rd(4);
            need(a[0] < nr && a[3] < nr && a[4] < nr && a[5] < nr && size[a[0]] >= sizeof(kv_model),
                 "a forward call names no model");
            const kv_model *m = (const kv_model *)region[a[0]];
            int B = (int)a[1], L = (int)a[2], K = (int)a[6], threads = (int)a[7];
            need(size[a[3]] >= (uint64_t)B * L * 8 && size[a[4]] >= (uint64_t)B * L * 8 && size[a[5]] >= (uint64_t)B * K * 8,
                 "a forward call's ids, positions or logit_index are short");
            float *logits = malloc(sizeof(float) * (size_t)B * K * m->vocab);
            void *scratch = malloc(kv_scratch_bytes(m, B, L, threads));
            need(logits && scratch, "out of memory");
            kv_forward(m, B, L, (const int64_t *)region[a[3]], (const int64_t *)region[a[4]],
                       (const int64_t *)region[a[5]], K, logits, threads, scratch);
            fwrite(logits, sizeof(float), (size_t)B * K * m->vocab, stdout);
            free(logits), free(scratch);
        } else if (kind == 3) {
            size_t at[2];
            const char *name;
            for (int i = 0; (name = kv_layout(i, at)) != NULL; i++) {
                uint32_t len = (uint32_t)strlen(name);
                uint64_t o = at[0], z = at[1];
                fwrite(&len, 4, 1, stdout), fwrite(name, 1, len, stdout), fwrite(&o, 8, 1, stdout), fwrite(&z, 8, 1, stdout);
            }
            uint32_t end = 0;
            fwrite(&end, 4, 1, stdout);
        } else if (kind == 4) {
            uint32_t x = (uint32_t)rd(4), n = (uint32_t)rd(4);
            need(x < nr && n % 8 == 0 && n >= 8 && size[x] >= (uint64_t)n * sizeof(float), "a helpers call's input is short");
            const float *v = (const float *)region[x];
            float *e = malloc(sizeof(float) * n), mx = -INFINITY;
            need(e != NULL, "out of memory");
            for (uint32_t i = 0; i + 1 < n; i++) e[i] = v[i], mx = v[i] > mx ? v[i] : mx;
            e[n - 1] = softmax_exp(e, (int)n - 1, mx); /* an odd count: the vector loop's tail too */
            fwrite(e, sizeof(float), n, stdout);
            kv_model silu;
            memset(&silu, 0, sizeof silu);
            silu.act = ACT_SILU, silu.inter = (int)n;
            for (uint32_t i = 0; i < n; i += 8) act_chunk(&silu, v, e, (int)i, (int)i + 8);
            fwrite(e, sizeof(float), n, stdout);
            free(e);
        } else {
            need(0, "an unknown call kind");
        }
    }
    return 0;
}
