/* NVFP4 quantization of bf16 (and fp32) weights on the CPU: the same bytes as fp4kit.nvfp4.quantize (compressed-tensors'
 * math), in one pass per 16-block instead of a dozen whole-tensor torch ops.
 * Also the exact MXFP4 -> NVFP4 cast's block scales (fp4kit.nvfp4.cast_mxfp4_group), at the end of the file.
 *
 * Every step is an IEEE fp32 operation in the order torch performs it, so the result is bit-identical provided the
 * compiler neither contracts to FMA nor flushes denormals (built with -ffp-contract=off, without -ffast-math). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define BLOCK 16

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif

/* One build runs anywhere: the loops are also compiled for AVX2 and picked at load time where the CPU has it. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 6)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* A block's 16 lanes (GCC/clang vector extensions: one AVX2 register of 16-bit lanes, two of fp32 ones, in the avx2
 * clone; SSE registers else) */
typedef int16_t v16s __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint8_t v16b __attribute__((vector_size(16))); /* an FP8 block's codes */
typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* Round a finite fp32 to bf16, nearest-even (torch's rounding of a bf16 op's fp32 result). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp8 e4m3fn code of v in [0, 448], nearest-even. Subnormals are multiples of 2^-9; lrintf rounds half to even
 * in the default rounding mode, and 8 * 2^-9 comes out as code 0x08, the smallest normal. */
static inline uint8_t f32_to_e4m3(float v) {
    if (v < 0.015625f) return (uint8_t)lrintf(v * 512.0f);
    uint32_t u = f32_to_bits(v);
    u += 0x7FFFFu + ((u >> 20) & 1u);
    return (uint8_t)((((u >> 23) - 127u + 7u) << 3) | ((u >> 20) & 7u));
}

static inline float e4m3_to_f32(uint8_t code) {
    uint32_t exponent = code >> 3, mantissa = code & 7u;
    if (exponent == 0) return (float)mantissa * 0.001953125f;
    return bits_to_f32(((exponent - 7u + 127u) << 23) | (mantissa << 20));
}

/* max |x| per 16-block as a bf16 bit pattern (compared as integers: |x| orders like its bits), and the largest of
 * them in *tensor_amax. Returns 1 when a value is NaN or Inf. */
VECTOR_CLONES int fp4kit_block_amax_bf16(const uint16_t *x, int64_t n_blocks, uint16_t *amax, uint16_t *tensor_amax) {
    uint16_t worst = 0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint16_t *block = x + b * BLOCK;
        uint16_t m = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint16_t a = block[i] & 0x7FFFu;
            m = a > m ? a : m;
        }
        amax[b] = m;
        worst = m > worst ? m : worst;
    }
    *tensor_amax = worst;
    return worst >= 0x7F80u;
}

/* fp32 quotient x / divisor as torch computes it, compared with an E2M1 rounding boundary. */
static inline int above(uint16_t magnitude, float divisor, float boundary) {
    return bf16_to_f32(magnitude) / divisor > boundary;
}

/* Smallest bf16 magnitude whose quotient by divisor lies above boundary (0x7F80 if none). The quotient is monotone
 * in the magnitude, so "quotient above boundary" is exactly "magnitude bits >= threshold". */
static uint16_t threshold(float divisor, float boundary) {
    uint32_t low = 0, high = 0x7F80u;
    while (low < high) {
        uint32_t mid = (low + high) / 2;
        if (above((uint16_t)mid, divisor, boundary)) high = mid;
        else low = mid + 1;
    }
    return (uint16_t)low;
}

#define SCALE_UNSET 0xFFu
#define NUM_THRESHOLDS 8 /* seven E2M1 rounding boundaries, then "quotient above zero" for the sign */

typedef struct {
    float global_mul;
    uint8_t scale_of_amax[0x7F80]; /* fp8 block-scale code per bf16 block-amax pattern, filled on first use */
    uint8_t ready[128];
    uint16_t thresholds[128][NUM_THRESHOLDS]; /* per fp8 block-scale code */
} Tables;

static uint8_t block_scale_code(Tables *t, uint16_t amax) {
    uint8_t code8 = t->scale_of_amax[amax];
    if (code8 != SCALE_UNSET) return code8;
    float amax_over_6 = bf16_to_f32(f32_to_bf16(bf16_to_f32(amax) / 6.0f));
    float scale = t->global_mul * amax_over_6;
    code8 = f32_to_e4m3(scale > 448.0f ? 448.0f : scale);
    if (code8 == 0) code8 = 0x20; /* an all-zero block: 0.125, as compressed-tensors */
    t->scale_of_amax[amax] = code8;
    return code8;
}

static const uint16_t *thresholds_of(Tables *t, uint8_t code8) {
    if (!t->ready[code8]) {
        /* codes count the boundaries strictly below |x / divisor|; the midpoints that round up to an even code
         * (0.75, 1.75, 3.5) sit one ulp lower so that "strictly below" includes them (round half to even) */
        const float boundaries[NUM_THRESHOLDS] = {0.25f, nextafterf(0.75f, 0.0f), 1.25f, nextafterf(1.75f, 0.0f),
                                                  2.5f,  nextafterf(3.5f, 0.0f),  5.0f,  0.0f};
        float divisor = e4m3_to_f32(code8) / t->global_mul;
        for (int k = 0; k < NUM_THRESHOLDS; k++) t->thresholds[code8][k] = threshold(divisor, boundaries[k]);
        t->ready[code8] = 1;
    }
    return t->thresholds[code8];
}

/* The E2M1 codes of one block from its thresholds: integer compares on bf16 bit patterns give the same codes as
 * dividing in fp32 and comparing with the boundaries; the sign bit is set where x < 0 and x / divisor is not 0.
 * The thresholds sit in locals, so that the byte stores cannot alias them and the loop vectorizes. */
static inline void encode_block(const uint16_t *block, const uint16_t *th, uint8_t *out) {
    const int16_t t0 = (int16_t)th[0], t1 = (int16_t)th[1], t2 = (int16_t)th[2], t3 = (int16_t)th[3],
                  t4 = (int16_t)th[4], t5 = (int16_t)th[5], t6 = (int16_t)th[6], t7 = (int16_t)th[7];
    int16_t codes[BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        int16_t a = (int16_t)(block[i] & 0x7FFFu);
        int16_t c = (int16_t)((a >= t0) + (a >= t1) + (a >= t2) + (a >= t3) + (a >= t4) + (a >= t5) + (a >= t6));
        codes[i] = (int16_t)(c | (((block[i] >> 15) & (a >= t7)) << 3));
    }
    for (int j = 0; j < BLOCK / 2; j++) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
}

/* Thresholds of a block-scale code broadcast to a block's 16 lanes, computed on first use. */
static inline const v16s *wide_thresholds(Tables *t, v16s (*wide)[NUM_THRESHOLDS], uint8_t *wide_ready, uint8_t code8) {
    if (!wide_ready[code8]) {
        const uint16_t *th = thresholds_of(t, code8);
        for (int k = 0; k < NUM_THRESHOLDS; k++)
            for (int i = 0; i < BLOCK; i++) wide[code8][k][i] = (int16_t)th[k]; /* all below 0x7F81: no sign */
        wide_ready[code8] = 1;
    }
    return wide[code8];
}

/* encode_block on a block in one vector: the codes of elements 2j and 2j + 1 sit in the low and high half of 32-bit
 * lane j, so one shift puts both nibbles in the lane's low byte. */
static inline void encode_block_wide(const uint16_t *block, const v16s *th, uint8_t *out) {
    v16s x;
    memcpy(&x, block, sizeof x);
    v16s magnitude = x & 0x7FFF, c = {0};
    for (int k = 0; k < 7; k++) c -= (v16s)(magnitude >= th[k]); /* a true compare is -1 in every bit */
    c |= (v16s)(x < 0) & (v16s)(magnitude >= th[7]) & 8;
    v8u pairs;
    memcpy(&pairs, &c, sizeof pairs);
    pairs = (pairs | (pairs >> 12)) & 0xFF;
#ifdef __SSE2__
    __m128i halves[2]; /* SSE2's saturating packs narrow the eight lanes to bytes (all below 256) */
    memcpy(halves, &pairs, sizeof halves);
    __m128i words = _mm_packs_epi32(halves[0], halves[1]);
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(words, words));
#else
    for (int j = 0; j < BLOCK / 2; j++) out[j] = (uint8_t)pairs[j];
#endif
}

/* Packed E2M1 codes (two per byte, element 2j in the low nibble) and fp8 block scales of n_blocks 16-blocks. */
VECTOR_CLONES int fp4kit_encode_bf16(const uint16_t *x, const uint16_t *amax, int64_t n_blocks, float global_mul,
                       uint8_t *packed, uint8_t *block_scale) {
    Tables *t = malloc(sizeof *t);
    v16s (*wide)[NUM_THRESHOLDS] = aligned_alloc(sizeof(v16s), 128 * sizeof *wide);
    if (t == NULL || wide == NULL) {
        free(t), free(wide);
        return -1;
    }
    uint8_t wide_ready[128] = {0};
    t->global_mul = global_mul;
    memset(t->scale_of_amax, SCALE_UNSET, sizeof t->scale_of_amax);
    memset(t->ready, 0, sizeof t->ready);
    for (int64_t b = 0; b < n_blocks; b++) {
        uint8_t code8 = t->scale_of_amax[amax[b]]; /* the table's hit, inline: the call only on a miss */
        if (code8 == SCALE_UNSET) code8 = block_scale_code(t, amax[b]);
        block_scale[b] = code8;
        encode_block_wide(x + b * BLOCK, wide_ready[code8] ? wide[code8] : wide_thresholds(t, wide, wide_ready, code8),
                          packed + b * (BLOCK / 2));
    }
    free(wide);
    free(t);
    return 0;
}

/* fp32 weights (a quantized source dequantized in fp32): the same steps on fp32 bit patterns. amax / 6 stays fp32
 * (torch computes it in the weight's dtype), so the block scale is computed per block instead of looked up. */
VECTOR_CLONES int fp4kit_block_amax_f32(const uint32_t *x, int64_t n_blocks, uint32_t *amax, uint32_t *tensor_amax) {
    uint32_t worst = 0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint32_t *block = x + b * BLOCK;
        uint32_t m = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t a = block[i] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        amax[b] = m;
        worst = m > worst ? m : worst;
    }
    *tensor_amax = worst;
    return worst >= 0x7F800000u;
}

/* Smallest fp32 magnitude whose quotient by divisor lies above boundary (0x7F800000 if none). */
static uint32_t threshold_f32(float divisor, float boundary) {
    uint32_t low = 0, high = 0x7F800000u;
    while (low < high) {
        uint32_t mid = low + (high - low) / 2;
        if (bits_to_f32(mid) / divisor > boundary) high = mid;
        else low = mid + 1;
    }
    return low;
}

typedef struct {
    uint8_t ready[128];
    uint32_t thresholds[128][NUM_THRESHOLDS]; /* per fp8 block-scale code */
} TablesF32;

/* The packed codes of one fp32 block: encode_block's compares on 32-bit patterns (the thresholds in locals, so that
 * the byte stores cannot alias them and the loop vectorizes; magnitudes and thresholds are below 2^31). */
static inline void encode_block_f32(const uint32_t *block, const uint32_t *th, uint8_t *out) {
    const int32_t t0 = (int32_t)th[0], t1 = (int32_t)th[1], t2 = (int32_t)th[2], t3 = (int32_t)th[3],
                  t4 = (int32_t)th[4], t5 = (int32_t)th[5], t6 = (int32_t)th[6], t7 = (int32_t)th[7];
    int32_t codes[BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        int32_t a = (int32_t)(block[i] & 0x7FFFFFFFu);
        int32_t c = (a >= t0) + (a >= t1) + (a >= t2) + (a >= t3) + (a >= t4) + (a >= t5) + (a >= t6);
        codes[i] = c | ((int32_t)((block[i] >> 31) & (uint32_t)(a >= t7)) << 3);
    }
    for (int j = 0; j < BLOCK / 2; j++) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
}

/* The fp8 block-scale code of an fp32 block amax: fp8(G * (amax / 6)), amax / 6 in fp32 (torch computes it in the
 * weight's dtype), 0x20 (0.125) for an all-zero block as compressed-tensors. */
static inline uint8_t block_scale_code_f32(float amax, float global_mul) {
    float scale = global_mul * (amax / 6.0f);
    uint8_t code8 = f32_to_e4m3(scale > 448.0f ? 448.0f : scale);
    return code8 == 0 ? 0x20 : code8;
}

static const uint32_t *thresholds_f32_of(TablesF32 *t, uint8_t code8, float global_mul) {
    if (!t->ready[code8]) {
        const float boundaries[NUM_THRESHOLDS] = {0.25f, nextafterf(0.75f, 0.0f), 1.25f, nextafterf(1.75f, 0.0f),
                                                  2.5f,  nextafterf(3.5f, 0.0f),  5.0f,  0.0f};
        float divisor = e4m3_to_f32(code8) / global_mul;
        for (int k = 0; k < NUM_THRESHOLDS; k++) t->thresholds[code8][k] = threshold_f32(divisor, boundaries[k]);
        t->ready[code8] = 1;
    }
    return t->thresholds[code8];
}

VECTOR_CLONES int fp4kit_encode_f32(const uint32_t *x, const uint32_t *amax, int64_t n_blocks, float global_mul,
                                    uint8_t *packed, uint8_t *block_scale) {
    TablesF32 *t = malloc(sizeof *t);
    if (t == NULL) return -1;
    memset(t->ready, 0, sizeof t->ready);
    for (int64_t b = 0; b < n_blocks; b++) {
        uint8_t code8 = block_scale_code_f32(bits_to_f32(amax[b]), global_mul);
        block_scale[b] = code8;
        encode_block_f32(x + b * BLOCK, thresholds_f32_of(t, code8, global_mul), packed + b * (BLOCK / 2));
    }
    free(t);
    return 0;
}

/* FP8-block dequantization of a [rows, cols] e4m3 weight (fp4kit.io.sources): out = value(code) * scale_inv of its
 * (bm, bn) block, one fp32 multiply as torch's; the last block of a row or column may be partial. table: the 256
 * fp32 values of the codes, as torch converts them (NaN included). */
VECTOR_CLONES int fp4kit_dequant_fp8_block(const uint8_t *w, int64_t rows, int64_t cols, const float *scale_inv,
                                           int64_t bm, int64_t bn, const float *table, float *out) {
    int64_t grid_cols = (cols + bn - 1) / bn;
    for (int64_t r = 0; r < rows; r++) {
        const float *scales = scale_inv + (r / bm) * grid_cols;
        const uint8_t *codes = w + r * cols;
        float *row = out + r * cols;
        for (int64_t c0 = 0; c0 < cols; c0 += bn) {
            float s = scales[c0 / bn];
            int64_t end = c0 + bn < cols ? c0 + bn : cols;
            for (int64_t c = c0; c < end; c++) row[c] = table[codes[c]] * s;
        }
    }
    return 0;
}

/* FP8-block weights quantized from their stored e4m3 codes, with the bytes fp4kit_block_amax_f32 and
 * fp4kit_encode_f32 give for their fp32 dequantization, without computing it. Within one (bm, bn) block of
 * multiplier s, |value(code) * s| = value(code & 0x7F) * |s| in IEEE fp32 (a product's magnitude does not depend on
 * the signs) and does not decrease with the magnitude code m = code & 0x7F (0x7F: NaN). So a 16-block (bn a multiple
 * of 16: one s per 16-block) has the fp32 amax value(max m) * |s|, and "|value * s| >= fp32 threshold" is
 * "m >= the smallest m whose product reaches it": the encode compares bytes, one per weight. */

/* The largest fp32 |value * s| of a [rows, cols] FP8-block weight in *tensor_amax (from the largest magnitude code of
 * each (bm, bn) block). Returns 1 when a value is NaN or Inf (a NaN code, or a product that is not finite). */
VECTOR_CLONES int fp4kit_fp8_block_amax(const uint8_t *w, int64_t rows, int64_t cols, const float *scale_inv,
                                        int64_t bm, int64_t bn, const float *table, uint32_t *tensor_amax) {
    int64_t grid_cols = (cols + bn - 1) / bn;
    uint8_t *column_max = calloc((size_t)cols, 1); /* per column, over the current row block */
    if (column_max == NULL) return -1;
    uint32_t worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *codes = w + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            uint8_t a = codes[c] & 0x7Fu;
            column_max[c] = a > column_max[c] ? a : column_max[c];
        }
        if ((r + 1) % bm == 0 || r + 1 == rows) {
            const float *scales = scale_inv + (r / bm) * grid_cols;
            for (int64_t g = 0; g < grid_cols; g++) {
                uint8_t m = 0;
                for (int64_t c = g * bn; c < cols && c < (g + 1) * bn; c++) m = column_max[c] > m ? column_max[c] : m;
                uint32_t a = f32_to_bits(table[m] * fabsf(scales[g])) & 0x7FFFFFFFu;
                worst = a > worst ? a : worst;
            }
            memset(column_max, 0, (size_t)cols);
        }
    }
    free(column_max);
    *tensor_amax = worst;
    return worst >= 0x7F800000u;
}

/* The largest of a block's 16 bytes: four halvings with SSE2's unsigned byte max where there is one (every x86-64) */
static inline uint8_t block_max(v16b a) {
#ifdef __SSE2__
    __m128i v;
    memcpy(&v, &a, sizeof v);
    v = _mm_max_epu8(v, _mm_srli_si128(v, 8));
    v = _mm_max_epu8(v, _mm_srli_si128(v, 4));
    v = _mm_max_epu8(v, _mm_srli_si128(v, 2));
    v = _mm_max_epu8(v, _mm_srli_si128(v, 1));
    return (uint8_t)_mm_cvtsi128_si32(v);
#else
    uint8_t m = 0;
    for (int i = 0; i < BLOCK; i++) m = a[i] > m ? a[i] : m;
    return m;
#endif
}

typedef struct {
    int32_t slot; /* its thresholds' place in the pool, -1 until computed */
    uint8_t scale_code;
} Fp8Entry;

/* Per threshold the largest magnitude code below it (126: none reaches it), in all 16 lanes: magnitude codes and
 * thresholds are below 128, so "m >= threshold" is the signed byte compare "m > below", one instruction. */
typedef struct {
    v16c below[NUM_THRESHOLDS];
} Fp8Thresholds;

/* The block-scale code and thresholds of 16-blocks whose largest magnitude code is m, under the multiplier whose
 * |value(c) * s| bit patterns are magnitude[0..127] (magnitude[127] above every threshold). */
static void fp8_entry(Fp8Entry *entry, Fp8Thresholds *out, const uint32_t *magnitude, uint8_t m, TablesF32 *t,
                      float global_mul) {
    entry->scale_code = block_scale_code_f32(bits_to_f32(magnitude[m]), global_mul);
    const uint32_t *th = thresholds_f32_of(t, entry->scale_code, global_mul);
    uint8_t low[NUM_THRESHOLDS] = {0}; /* per threshold the first code whose magnitude reaches it: 7 halvings of 128 */
    for (int half = 64; half > 0; half /= 2)
        for (int k = 0; k < NUM_THRESHOLDS; k++) low[k] += magnitude[low[k] + half - 1] < th[k] ? half : 0;
    for (int k = 0; k < NUM_THRESHOLDS; k++)
        for (int i = 0; i < BLOCK; i++) out->below[k][i] = (int8_t)(low[k] - 1);
}

/* The packed E2M1 codes and fp8 block scales of a finite FP8-block weight (fp4kit_fp8_block_amax said so): per
 * (bm, bn) block and largest magnitude code of a 16-block, the block-scale code and the thresholds are computed
 * once. */
VECTOR_CLONES int fp4kit_encode_fp8_block(const uint8_t *w, int64_t rows, int64_t cols, const float *scale_inv,
                                          int64_t bm, int64_t bn, const float *table, float global_mul,
                                          uint8_t *packed, uint8_t *block_scale) {
    int64_t grid_cols = (cols + bn - 1) / bn, k_blocks = cols / BLOCK, bn_blocks = bn / BLOCK;
    TablesF32 *t = malloc(sizeof *t);
    Fp8Entry *entries = malloc((size_t)grid_cols * 128 * sizeof *entries);
    /* filled from the start in each row of (bm, bn) blocks: only the pages of the entries in use are touched */
    Fp8Thresholds *pool = aligned_alloc(sizeof(v16c), (size_t)grid_cols * 128 * sizeof *pool);
    uint32_t *magnitudes = malloc((size_t)grid_cols * 128 * sizeof *magnitudes); /* per scale column */
    uint8_t *magnitudes_ready = malloc((size_t)grid_cols);
    if (t == NULL || entries == NULL || pool == NULL || magnitudes == NULL || magnitudes_ready == NULL) {
        free(t), free(entries), free(pool), free(magnitudes), free(magnitudes_ready);
        return -1;
    }
    memset(t->ready, 0, sizeof t->ready);
    int32_t pool_used = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *scales = scale_inv + (r / bm) * grid_cols;
        if (r % bm == 0) { /* a new row of (bm, bn) blocks */
            for (int64_t e = 0; e < grid_cols * 128; e++) entries[e].slot = -1;
            memset(magnitudes_ready, 0, (size_t)grid_cols);
            pool_used = 0;
        }
        for (int64_t g = 0; g < grid_cols; g++) {
            Fp8Entry *column_entries = entries + g * 128;
            /* the product's sign is the code's, flipped where s is negative */
            const v16c flip = (v16c){0} - (int8_t)(signbit(scales[g]) ? 1 : 0);
            int64_t j_end = (g + 1) * bn_blocks < k_blocks ? (g + 1) * bn_blocks : k_blocks;
            for (int64_t j = g * bn_blocks; j < j_end; j++) {
                int64_t b = r * k_blocks + j;
                v16c x;
                memcpy(&x, w + b * BLOCK, sizeof x);
                v16c magnitude = x & 0x7F;
                uint8_t m = block_max((v16b)magnitude);
                Fp8Entry *entry = column_entries + m;
                if (entry->slot < 0) {
                    uint32_t *column_magnitudes = magnitudes + g * 128;
                    if (!magnitudes_ready[g]) {
                        float s = fabsf(scales[g]);
                        for (int c = 0; c < 127; c++) column_magnitudes[c] = f32_to_bits(table[c] * s);
                        column_magnitudes[127] = 0xFFFFFFFFu;
                        magnitudes_ready[g] = 1;
                    }
                    entry->slot = pool_used++;
                    fp8_entry(entry, pool + entry->slot, column_magnitudes, m, t, global_mul);
                }
                block_scale[b] = entry->scale_code;
                const v16c *below = pool[entry->slot].below;
                v16c e2m1 = {0};
                for (int k = 0; k < 7; k++) e2m1 -= (v16c)(magnitude > below[k]); /* a true compare is -1 */
                e2m1 |= ((v16c)(x < 0) ^ flip) & (v16c)(magnitude > below[7]) & 8;
                v8h pairs; /* elements 2i and 2i + 1 in 16-bit lane i: both nibbles into its low byte */
                memcpy(&pairs, &e2m1, sizeof pairs);
                v8b out = __builtin_convertvector(pairs | (pairs >> 4), v8b);
                memcpy(packed + b * (BLOCK / 2), &out, sizeof out);
            }
        }
    }
    free(t), free(entries), free(pool), free(magnitudes), free(magnitudes_ready);
    return 0;
}

/* Weighted squared error of one block under a block-scale code, computed as fp4kit.quantize.scale_search.block_errors does:
 * (E2M1 value * divisor - |x|)^2, times the channel's importance, summed as the halving tree e[i] + e[i + n/2].
 * The code is counted with the encode's threshold compares on the bf16 bit patterns; its value c/2 + max(c-4, 0)/2
 * + max(c-6, 0) (0, .5, ..., 2, 3, 4, 6) is exact, so the product with the divisor is torch's. */
static inline float block_error(v16s magnitude, v16f x, const v16s *th, float divisor, const v16f *weights) {
    v16s c = {0};
    for (int k = 0; k < 7; k++) c -= (v16s)(magnitude >= th[k]); /* a true compare is -1 in every bit */
    v16s twice = c + ((c - 4) & (v16s)(c > 4)), above6 = (c - 6) & (v16s)(c > 6);
    v16f value = __builtin_convertvector(twice, v16f) * 0.5f + __builtin_convertvector(above6, v16f);
    v16f d = value * divisor - x;
    v16f e = d * d;
    if (weights != NULL) e = e * *weights;
#ifdef HAVE_SHUFFLEVECTOR
    v8f s8 = __builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
#else
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = e[i] + e[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* The mse block-scale search (fp4kit.quantize.scale_search.search_block_scales) and the encode with the chosen scales:
 * per block, the RTN code, the codes offset by each of n_offsets offsets (clamped to [1, 0x7E]) and "max to 4"
 * (fp8(G * amax / 4)); the first of the smallest errors wins. importance: fp32 weights per input channel of one
 * row (k_blocks blocks), or NULL. */
VECTOR_CLONES int fp4kit_mse_encode_bf16(const uint16_t *x, const uint16_t *amax, int64_t n_blocks, float global_mul,
                                         const int32_t *offsets, int n_offsets, const float *importance,
                                         int64_t k_blocks, uint8_t *packed, uint8_t *block_scale) {
    Tables *t = malloc(sizeof *t);
    if (t == NULL) return -1;
    t->global_mul = global_mul;
    memset(t->scale_of_amax, SCALE_UNSET, sizeof t->scale_of_amax);
    memset(t->ready, 0, sizeof t->ready);
    float divisors[128];
    v16s (*wide)[NUM_THRESHOLDS] = aligned_alloc(sizeof(v16s), 128 * sizeof *wide); /* vectors want their own alignment */
    if (wide == NULL) {
        free(t);
        return -1;
    }
    uint8_t wide_ready[128] = {0};
    for (int code = 0; code < 128; code++) divisors[code] = e4m3_to_f32((uint8_t)code) / global_mul;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint16_t *block = x + b * BLOCK;
        v16s magnitude;
        v16f xf, weights;
        memcpy(&magnitude, block, sizeof magnitude);
        magnitude &= 0x7FFF;
        v16i widened = __builtin_convertvector(magnitude, v16i) << 16; /* bf16 bits -> fp32 bits */
        memcpy(&xf, &widened, sizeof xf);
        if (importance != NULL) memcpy(&weights, importance + (b % k_blocks) * BLOCK, sizeof weights);
        const v16f *w = importance == NULL ? NULL : &weights;
        uint8_t rtn = block_scale_code(t, amax[b]);
        uint8_t best = rtn;
        float best_error = block_error(magnitude, xf, wide_thresholds(t, wide, wide_ready, rtn), divisors[rtn], w);
        for (int k = 0; k <= n_offsets; k++) {
            int code;
            if (k < n_offsets) {
                code = (int)rtn + offsets[k];
                code = code < 1 ? 1 : (code > 0x7E ? 0x7E : code);
            } else {
                float max_to_4 = global_mul * (bf16_to_f32(amax[b]) / 4.0f);
                code = f32_to_e4m3(max_to_4 > 448.0f ? 448.0f : max_to_4);
                if (code == 0) code = 0x20;
            }
            float error = block_error(magnitude, xf, wide_thresholds(t, wide, wide_ready, (uint8_t)code),
                                      divisors[code], w);
            if (error < best_error) {
                best_error = error;
                best = (uint8_t)code;
            }
        }
        block_scale[b] = best;
        encode_block(block, thresholds_of(t, best), packed + b * (BLOCK / 2));
    }
    free(wide);
    free(t);
    return 0;
}

/* MXFP4 -> NVFP4 without rounding (fp4kit.nvfp4.cast_mxfp4_group): the codes stay as stored; per 32-block of E8M0
 * exponent byte e only the two E4M3 block-scale bytes of 2^(e - 127 + m) are written. A weight is [rows] rows of
 * `half` code bytes (K/2, a multiple of 8) at `packed_stride` bytes apart and ceil(K/32) exponent bytes at
 * `exps_stride`: row slices of a fused tensor are read in place. Whether a block holds a nonzero code (its nibbles'
 * magnitude bits, -0 is zero) is read only where it decides something: for the largest exponents, and for blocks
 * whose scale E4M3 cannot hold. */

#define MAGNITUDE_BITS 0x7777777777777777ull

static inline int nonzero16(const uint8_t *codes) { /* the 8 code bytes of a 16-block */
    uint64_t word;
    memcpy(&word, codes, sizeof word);
    return (word & MAGNITUDE_BITS) != 0;
}

static inline int nonzero32(const uint8_t *codes, int64_t bytes) { /* 16 bytes, or 8 for a last half block */
    return nonzero16(codes) || (bytes > 8 && nonzero16(codes + 8));
}

/* The largest exponent byte of a 32-block holding a nonzero code; -1 where every code is zero; -2 where any
 * exponent byte is 255 (NaN). */
VECTOR_CLONES int fp4kit_mxfp4_top(const uint8_t *exps, int64_t exps_stride, const uint8_t *packed,
                                   int64_t packed_stride, int64_t rows, int64_t half) {
    int64_t groups = (half + 15) / 16;
    uint8_t largest = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *e = exps + r * exps_stride;
        for (int64_t g = 0; g < groups; g++) largest = e[g] > largest ? e[g] : largest;
    }
    if (rows == 0 || groups == 0) return -1;
    if (largest == 255) return -2;
    /* the blocks at the largest exponent first: in any quantizer's output one of them holds a nonzero code */
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *e = exps + r * exps_stride, *codes = packed + r * packed_stride;
        for (int64_t g = 0; g < groups; g++)
            if (e[g] == largest && nonzero32(codes + g * 16, half - g * 16)) return largest;
    }
    int top = -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *e = exps + r * exps_stride, *codes = packed + r * packed_stride;
        for (int64_t g = 0; g < groups; g++)
            if ((int)e[g] > top && nonzero32(codes + g * 16, half - g * 16)) top = e[g];
    }
    return top;
}

/* E4M3 byte of 2^j clamped to 2^-9 .. 2^8: exponent field j + 7 for the normals (j >= -6), mantissa bit j + 9
 * below (1, 2, 4); no branches, so that the loops below vectorize */
static inline uint8_t e4m3_pow2(int16_t j) {
    int16_t c = j < -9 ? -9 : j;
    c = c > 8 ? 8 : c;
    int16_t normal = (int16_t)((c + 7) * 8), subnormal = (int16_t)(1 + (c > -9) + 2 * (c > -8));
    return (uint8_t)(c >= -6 ? normal : subnormal);
}

/* Scale bytes of n 32-blocks of exponents e into s[2n]; whether any was clamped. */
static inline uint8_t pow2_pairs(const uint8_t *e, int64_t n, int16_t offset, uint8_t *s) {
    uint8_t outside = 0;
    for (int64_t g = 0; g < n; g++) {
        int16_t j = (int16_t)(e[g] + offset);
        uint8_t byte = e4m3_pow2(j);
        s[2 * g] = byte;
        s[2 * g + 1] = byte;
        outside |= (uint8_t)((j < -9) | (j > 8));
    }
    return outside;
}

/* Block-scale bytes [rows, half / 8] of E4M3 2^(e - 127 + m), clamped to 2^-9 .. 2^8. A 16-block holding a nonzero
 * code whose scale was clamped is counted and, where redo is not NULL, marked 1 there (redo arrives zeroed). Returns
 * how many. */
VECTOR_CLONES int64_t fp4kit_mxfp4_cast_scales(const uint8_t *exps, int64_t exps_stride, const uint8_t *packed,
                                               int64_t packed_stride, int64_t rows, int64_t half, int m,
                                               uint8_t *scale, uint8_t *redo) {
    int64_t blocks = half / 8, count = 0;
    int16_t offset = (int16_t)(m - 127);
    /* exponents without gaps and whole 32-blocks: one loop over all rows, the rows' own loops only if needed */
    if (blocks % 2 == 0 && exps_stride == blocks / 2 && !pow2_pairs(exps, rows * (blocks / 2), offset, scale))
        return 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *e = exps + r * exps_stride;
        uint8_t *s = scale + r * blocks;
        uint8_t outside = pow2_pairs(e, blocks / 2, offset, s);
        if (blocks % 2) { /* a last 32-block of 16 inputs */
            int16_t j = (int16_t)(e[blocks / 2] + offset);
            s[blocks - 1] = e4m3_pow2(j);
            outside |= (uint8_t)((j < -9) | (j > 8));
        }
        if (!outside) continue;
        const uint8_t *codes = packed + r * packed_stride;
        for (int64_t b = 0; b < blocks; b++) {
            int16_t j = (int16_t)(e[b / 2] + offset);
            if ((j < -9 || j > 8) && nonzero16(codes + b * 8)) {
                if (redo != NULL) redo[r * blocks + b] = 1;
                count++;
            }
        }
    }
    return count;
}
