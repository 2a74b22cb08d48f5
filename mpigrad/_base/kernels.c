/* mpigrad's half-precision kernels in C: compiled on this machine at the first
 * large cast (mpigrad/_base/native.py, -O3 -march=native), so that the compiler
 * vectorises them at the CPU's own width (AVX-512 here, SSE2 anywhere).
 *
 * The formulas are halfcast_kernels.py's, branch-free bit arithmetic, so the
 * bits are the same: numpy's for float16 (round to nearest even, subnormals,
 * NaN payloads kept), ml_dtypes' for bfloat16 (NaN quieted). Only float adds
 * and multiplies in IEEE single precision (no -ffast-math: every sum rounds as
 * numpy's does, in the same order).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float16 bits -> float32 bits, exactly */
static inline uint32_t half_up(uint32_t h) {
    /* |h| moved to float32's bit positions is |x| * 2**-112 exactly */
    uint32_t a = (h & 0x7FFFu) << 13;
    uint32_t f = as_bits(as_float(a) * 5.192296858534828e33f);   /* 2**112 */
    f = ((h & 0x7C00u) == 0x7C00u) ? (a | 0x7F800000u) : f;     /* inf, NaN */
    return f | ((h & 0x8000u) << 16);
}

/* all ones where c, else zero: selects without branches, which vectorise */
static inline uint32_t mask(int c) { return (uint32_t)0 - (uint32_t)(c != 0); }
static inline uint32_t select(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

/* float32 bits -> float16 bits, rounded to nearest even as numpy rounds */
static inline uint16_t half_down(uint32_t f) {
    uint32_t sign = (f >> 16) & 0x8000u;
    uint32_t a = f & 0x7FFFFFFFu;
    uint32_t h = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    /* below 2**-14: the float adder rounds |x| + 0.5 to a multiple of 2**-24 */
    uint32_t sub = as_bits(as_float(a) + 0.5f) - 0x3F000000u;
    h = select(mask(a < 0x38800000u), sub, h);
    h = select(mask(a >= 0x47800000u), 0x7C00u, h);
    /* NaN: numpy keeps the payload's top 10 bits, and at least one set */
    uint32_t payload = (a >> 13) & 0x3FFu;
    uint32_t nan = 0x7C00u | payload | (mask(payload == 0) & 1u);
    return (uint16_t)(sign | select(mask(a > 0x7F800000u), nan, h));
}

/* float32 bits -> bfloat16 bits, rounded to nearest even as ml_dtypes rounds */
static inline uint16_t bfloat16_down(uint32_t f) {
    uint32_t rounded = (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16;
    return (uint16_t)(((f & 0x7FFFFFFFu) > 0x7F800000u) ? ((f >> 16) | 0x40u) : rounded);
}

/* a + b as numpy's np.add(a, b) gives it, NaN payloads too: where both are NaN,
 * a's, quieted (the hardware's rule for its first operand, which the compiler,
 * taking addition as commutative, may swap) */
static inline float add(float a, float b) {
    uint32_t sum = as_bits(a + b), x = as_bits(a);
    return as_float(select(mask((x & 0x7FFFFFFFu) > 0x7F800000u), x | 0x400000u, sum));
}

#if defined(__F16C__) && defined(__AVX2__)
/* The vector units' own conversions (F16C: exact up; down rounded to nearest
 * even, subnormals included), with numpy's NaNs put back in the lanes that hold
 * one: the hardware quiets a NaN, numpy keeps its payload as it is. */

#define SET(x) _mm256_set1_epi32((int)(x))

static inline __m256i is_nan(__m256i magnitude, uint32_t inf) {    /* all ones where NaN */
    /* magnitude > inf, both below 2**31: a signed compare is right */
    return _mm256_cmpgt_epi32(magnitude, SET(inf));
}

/* 8 halves up, exactly, numpy's NaNs kept */
static inline __m256i up8(const uint16_t *src) {
    __m128i packed = _mm_loadu_si128((const __m128i *)src);
    __m256i h = _mm256_cvtepu16_epi32(packed);
    __m256i nan = is_nan(_mm256_and_si256(h, SET(0x7FFF)), 0x7C00);
    __m256i kept = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(h, SET(0x8000)), 16),
                   _mm256_or_si256(SET(0x7F800000),
                                   _mm256_slli_epi32(_mm256_and_si256(h, SET(0x3FF)), 13)));
    __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(packed));
    return _mm256_blendv_epi8(f, kept, nan);
}

void f16_to_f32(const uint16_t *restrict src, uint32_t *restrict dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_si256((__m256i *)(dst + i), up8(src + i));
    for (; i < n; i++) dst[i] = half_up(src[i]);
}

/* acc += 8 halves, with add()'s NaN rule */
static inline void add8(float *acc, const uint16_t *src) {
    __m256 a = _mm256_loadu_ps(acc);
    __m256 sum = _mm256_add_ps(a, _mm256_castsi256_ps(up8(src)));
    __m256i bits = _mm256_castps_si256(a);
    __m256i nan = is_nan(_mm256_and_si256(bits, SET(0x7FFFFFFF)), 0x7F800000);
    __m256i quiet = _mm256_or_si256(bits, SET(0x400000));
    _mm256_storeu_ps(acc, _mm256_castsi256_ps(
        _mm256_blendv_epi8(_mm256_castps_si256(sum), quiet, nan)));
}
#define VECTOR_ADD 8

/* bfloat16_down's rounding of 8 lanes of float32 bits without NaN, in their top halves
 * (the low halves not cleared) */
static inline __m256i bf16_rounded_high(__m256i f) {
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(f, 16), SET(1));
    return _mm256_add_epi32(_mm256_add_epi32(f, SET(0x7FFF)), odd);
}

/* the same in the low halves */
static inline __m256i bf16_round_bits(__m256i f) {
    return _mm256_srli_epi32(bf16_rounded_high(f), 16);
}

/* bfloat16_down of 8 lanes, NaNs quieted as ml_dtypes does */
static inline __m256i bf16_down8(const uint32_t *src) {
    __m256i f = _mm256_loadu_si256((const __m256i *)src);
    __m256i nan = is_nan(_mm256_and_si256(f, SET(0x7FFFFFFF)), 0x7F800000);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(f, 16), SET(0x40));
    return _mm256_blendv_epi8(bf16_round_bits(f), quiet, nan);
}

void f32_to_bf16(const uint32_t *restrict src, uint16_t *restrict dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {      /* packed per 128-bit lane: put back in order */
        __m256i packed = _mm256_packus_epi32(bf16_down8(src + i), bf16_down8(src + i + 8));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permute4x64_epi64(packed, 0xD8));
    }
    for (; i < n; i++) dst[i] = bfloat16_down(src[i]);
}

void f32_to_f16(const uint32_t *restrict src, uint16_t *restrict dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i f = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i nan = is_nan(_mm256_and_si256(f, SET(0x7FFFFFFF)), 0x7F800000);
        __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(f),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (!_mm256_testz_si256(nan, nan)) {     /* rare: numpy's NaN bits, lane by lane */
            uint16_t lanes[8];
            _mm_storeu_si128((__m128i *)lanes, h);
            for (int k = 0; k < 8; k++) lanes[k] = half_down(src[i + k]);
            h = _mm_loadu_si128((const __m128i *)lanes);
        }
        _mm_storeu_si128((__m128i *)(dst + i), h);
    }
    for (; i < n; i++) dst[i] = half_down(src[i]);
}
#else
void f16_to_f32(const uint16_t *restrict src, uint32_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = half_up(src[i]);
}

void f32_to_f16(const uint32_t *restrict src, uint16_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = half_down(src[i]);
}

void f32_to_bf16(const uint32_t *restrict src, uint16_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = bfloat16_down(src[i]);
}
#endif

void bf16_to_f32(const uint16_t *restrict src, uint32_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
}

/* acc += src cast to float32: a half addend summed without a float32 copy */
void add_f16(float *restrict acc, const uint16_t *restrict src, size_t n) {
    size_t i = 0;
#ifdef VECTOR_ADD
    for (; i + VECTOR_ADD <= n; i += VECTOR_ADD) add8(acc + i, src + i);
#endif
    for (; i < n; i++) acc[i] = add(acc[i], as_float(half_up(src[i])));
}

void add_bf16(float *restrict acc, const uint16_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) acc[i] = add(acc[i], as_float((uint32_t)src[i] << 16));
}

/* The node sum's kernel: dst = the k addends srcs[0], ..., srcs[k - 1] (kind: HALF16
 * float16, BF16 bfloat16 bits, F32 float32) summed in float32 in that order (add()'s NaN
 * rule), times factor where scaled, then rounded once into dst (float16 or bfloat16
 * bits), or with wide (always for F32) kept in float32: one pass, the sums in registers
 * or L1. Returns 0 where check and a result is NaN or not below limit in magnitude
 * (settle.py's finite check, on the float32 values), else 1. dst may be one of the
 * addends (in place). With stream, dst is written past the cache (non-temporal stores:
 * no read of its lines first), for a dst that nothing reads soon: a reduce-scatter's
 * shard, written once, larger than the cache (a copy into the peers would read it
 * back from memory instead). */
enum { HALF16 = 0, BF16 = 1, F32 = 2 };

static inline float up_one(const void *src, size_t i, int kind) {
    if (kind == F32) return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    return as_float(kind == BF16 ? (uint32_t)h << 16 : half_up(h));
}

/* one element of fused_sum, by the formulas above (any value) ; 1 where check finds it bad */
static inline uint32_t sum_one(const void *const *srcs, size_t k, size_t i, void *dst,
                               int kind, int wide, int64_t scaled, float factor,
                               int64_t check, float limit) {
    float acc = up_one(srcs[0], i, kind);
    for (size_t r = 1; r < k; r++) acc = add(acc, up_one(srcs[r], i, kind));
    if (scaled) acc *= factor;     /* x * 1 would quiet a signalling NaN: a sum is not scaled */
    if (wide) ((float *)dst)[i] = acc;
    else ((uint16_t *)dst)[i] = kind == BF16 ? bfloat16_down(as_bits(acc))
                                             : half_down(as_bits(acc));
    return check && !(__builtin_fabsf(acc) < limit);
}

#if defined(__F16C__) && defined(__AVX2__)
/* 16 lanes at a time, through the vector units' own conversions, adds and rounding:
 * their bits are the formulas' wherever the result is neither NaN nor beyond the check's
 * limit (x * 1 is x there: unscaled sums are multiplied by 1). The results of 64 lanes
 * are tested at once; where any is (rare: an infinity, a NaN or an overflow among
 * them) all 64 are redone by sum_one before anything is stored (dst may be an
 * addend). One copy of the loop per kind and output, the flags known to the compiler. */

/* 16 addends up, as float32: float32 and float16 in two halves of 8 in order; bfloat16
 * as their float32 bits in the 32-bit lanes they are loaded into (the even elements
 * shifted up, low; the odd ones with the even ones masked out, high: no shuffles), an
 * order that down16 undoes */
static inline void up16(const void *src, size_t i, int kind, __m256 *low, __m256 *high) {
    if (kind == F32) {
        *low = _mm256_loadu_ps((const float *)src + i);
        *high = _mm256_loadu_ps((const float *)src + i + 8);
    } else if (kind == BF16) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
        *low = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        *high = _mm256_castsi256_ps(_mm256_and_si256(bits, SET(0xFFFF0000)));
    } else {
        *low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
        *high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i + 8)));
    }
}

/* up16's 16 sums (no NaN among them) stored in order: rounded, or float32 with wide;
 * with stream, past the cache (dst + i aligned to 32 bytes: sum_lanes sees to it) */
static inline void down16(void *dst, size_t i, __m256 low, __m256 high, int kind, int wide,
                          int stream) {
    if (wide) {
        if (kind == BF16) {     /* even and odd interleaved: 0-3 8-11, 4-7 12-15, in order */
            __m256 front = _mm256_unpacklo_ps(low, high), back = _mm256_unpackhi_ps(low, high);
            low = _mm256_permute2f128_ps(front, back, 0x20);
            high = _mm256_permute2f128_ps(front, back, 0x31);
        }
        if (stream) {
            _mm256_stream_ps((float *)dst + i, low);
            _mm256_stream_ps((float *)dst + i + 8, high);
        } else {
            _mm256_storeu_ps((float *)dst + i, low);
            _mm256_storeu_ps((float *)dst + i + 8, high);
        }
        return;
    }
    __m256i both;
    if (kind == BF16) {
        /* (lanes without NaN) the even elements' roundings low, the odd ones' high */
        both = _mm256_or_si256(bf16_round_bits(_mm256_castps_si256(low)),
                               _mm256_and_si256(bf16_rounded_high(_mm256_castps_si256(high)),
                                                SET(0xFFFF0000)));
    } else {
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        both = _mm256_set_m128i(_mm256_cvtps_ph(high, round), _mm256_cvtps_ph(low, round));
    }
    if (stream) _mm256_stream_si256((__m256i *)((uint16_t *)dst + i), both);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), both);
}

/* the 16 lanes at i of the k addends summed in float32 in their order, then scaled */
static inline __attribute__((always_inline)) void sum16(
        const void *const *p, size_t k, size_t i, int kind, __m256 scale, __m256 *low,
        __m256 *high) {
    __m256 more_low, more_high;
    up16(p[0], i, kind, low, high);
    for (size_t r = 1; r < k; r++) {
        up16(p[r], i, kind, &more_low, &more_high);
        *low = _mm256_add_ps(*low, more_low);
        *high = _mm256_add_ps(*high, more_high);
    }
    *low = _mm256_mul_ps(*low, scale);
    *high = _mm256_mul_ps(*high, scale);
}

/* the lanes' largest magnitude so far, with low's and high's: its bits as an integer,
 * which orders magnitudes as their values do (and a NaN's above infinity's) */
static inline __m256i largest(__m256i most, __m256 low, __m256 high) {
    const __m256 magnitude = _mm256_castsi256_ps(SET(0x7FFFFFFF));
    most = _mm256_max_epu32(most, _mm256_castps_si256(_mm256_and_ps(low, magnitude)));
    return _mm256_max_epu32(most, _mm256_castps_si256(_mm256_and_ps(high, magnitude)));
}

static inline int passes(__m256i most, __m256i reach) {
    __m256i past = _mm256_cmpgt_epi32(most, reach);
    return !_mm256_testz_si256(past, past);
}

static inline __attribute__((always_inline)) int64_t sum_lanes(
        const void *const *srcs, const size_t k, size_t n, void *dst, const int kind,
        const int wide, int64_t scaled, float factor, int64_t check, float limit,
        int64_t stream) {
    const void *p[k];               /* local: stores into dst cannot move them */
    for (size_t r = 0; r < k; r++) p[r] = srcs[r];
    const __m256 scale = _mm256_set1_ps(scaled ? factor : 1.0f);
    /* a lane is redone where its magnitude's bits pass reach's: the check's limit's
     * (every lane where the limit is not above 0 or is NaN), else past FLT_MAX's; a
     * NaN passes either */
    const __m256i reach = SET(check ? (limit > 0 ? as_bits(limit) - 1 : 0xFFFFFFFF)
                                    : as_bits(3.4028234663852886e38f) - 1);
    uint32_t bad = 0;
    size_t i = 0;
    const size_t width = wide ? 4 : 2;      /* bytes of a stored element */
    if (stream)                              /* elements one by one up to a 32-byte line */
        for (; i < n && ((uintptr_t)dst + i * width) % 32 != 0; i++)
            bad |= sum_one(p, k, i, dst, kind, wide, scaled, factor, check, limit);
    for (; i + 64 <= n; i += 64) {
        __m256 low[4], high[4];
        __m256i most = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            sum16(p, k, i + 16 * q, kind, scale, &low[q], &high[q]);
            most = largest(most, low[q], high[q]);
        }
        if (__builtin_expect(passes(most, reach), 0)) {
            for (size_t j = i; j < i + 64; j++)
                bad |= sum_one(p, k, j, dst, kind, wide, scaled, factor, check, limit);
            continue;
        }
        for (int q = 0; q < 4; q++)
            down16(dst, i + 16 * q, low[q], high[q], kind, wide, (int)stream);
    }
    for (; i + 16 <= n; i += 16) {
        __m256 low, high;
        sum16(p, k, i, kind, scale, &low, &high);
        if (__builtin_expect(passes(largest(_mm256_setzero_si256(), low, high), reach), 0)) {
            for (size_t j = i; j < i + 16; j++)
                bad |= sum_one(p, k, j, dst, kind, wide, scaled, factor, check, limit);
        } else {
            down16(dst, i, low, high, kind, wide, (int)stream);
        }
    }
    if (stream) _mm_sfence();      /* the streamed stores ordered before what follows */
    for (; i < n; i++)
        bad |= sum_one(p, k, i, dst, kind, wide, scaled, factor, check, limit);
    return bad == 0;
}

/* the loop for two addends (a pair of ranks), and for any number */
#define SUM_LANES(K, W) (k == 2 ? sum_lanes(srcs, 2, n, dst, K, W, scaled, factor, check, limit, \
                                            stream) \
                                : sum_lanes(srcs, k, n, dst, K, W, scaled, factor, check, limit, \
                                            stream))

int64_t fused_sum(const void *const *srcs, size_t k, size_t n, void *dst, int64_t kind,
                  int64_t wide, int64_t scaled, float factor, int64_t check, float limit,
                  int64_t stream) {
    if (kind == F32) return SUM_LANES(F32, 1);
    if (kind == BF16) return wide ? SUM_LANES(BF16, 1) : SUM_LANES(BF16, 0);
    return wide ? SUM_LANES(HALF16, 1) : SUM_LANES(HALF16, 0);
}
#else
enum { BLOCK = 512 };   /* elements summed at a time: the float32 sums stay in L1 */

int64_t fused_sum(const void *const *srcs, size_t k, size_t n, void *dst, int64_t kind,
                  int64_t wide, int64_t scaled, float factor, int64_t check, float limit,
                  int64_t stream) {     /* (stream: a hint, not taken here) */
    float acc[BLOCK];
    uint32_t bad = 0;
    for (size_t lo = 0; lo < n; lo += BLOCK) {
        size_t m = n - lo < BLOCK ? n - lo : BLOCK;
        if (kind == F32) memcpy(acc, (const float *)srcs[0] + lo, m * sizeof(float));
        else if (kind == BF16) bf16_to_f32((const uint16_t *)srcs[0] + lo, (uint32_t *)acc, m);
        else f16_to_f32((const uint16_t *)srcs[0] + lo, (uint32_t *)acc, m);
        for (size_t r = 1; r < k; r++) {
            if (kind == F32) {
                const float *src = (const float *)srcs[r] + lo;
                for (size_t i = 0; i < m; i++) acc[i] = add(acc[i], src[i]);
            } else if (kind == BF16) {
                add_bf16(acc, (const uint16_t *)srcs[r] + lo, m);
            } else {
                add_f16(acc, (const uint16_t *)srcs[r] + lo, m);
            }
        }
        if (scaled)     /* x * 1 would quiet a signalling NaN: a sum is not scaled */
            for (size_t i = 0; i < m; i++) acc[i] *= factor;
        if (check)
            for (size_t i = 0; i < m; i++) bad |= !(__builtin_fabsf(acc[i]) < limit);
        if (wide || kind == F32) memcpy((float *)dst + lo, acc, m * sizeof(float));
        else if (kind == BF16) f32_to_bf16((const uint32_t *)acc, (uint16_t *)dst + lo, m);
        else f32_to_f16((const uint32_t *)acc, (uint16_t *)dst + lo, m);
    }
    return bad == 0;
}
#endif

/* ---- exact sums of float32 values (mpigrad/_base/exact.py has the method) ----
 * Elements come in `count` strided blocks: element i belongs to block i % count,
 * whose pair of agreed exponents is pairs[2b] (top) and pairs[2b + 1] (the
 * lowest bit, negated). */

enum { ZERO = -32768, SPECIAL = 32767, LIMB_BITS = 48, SCALE_ZERO = 1100 };

/* the exact kernels neither read denormal inputs as zero nor flush denormal results
 * to zero, whatever the calling thread's mode (torch.set_flush_denormal sets both):
 * gradual_underflow() clears both for a kernel, restore_mode(its result) after */
static inline unsigned gradual_underflow(void) {
#if defined(__SSE__)
    const unsigned mode = _mm_getcsr();
    _mm_setcsr(mode & ~0x8040u);                /* FTZ (bit 15) and DAZ (bit 6) off */
    return mode;
#else
    return 0;
#endif
}

static inline void restore_mode(unsigned mode) {
#if defined(__SSE__)
    _mm_setcsr(mode);
#else
    (void)mode;
#endif
}

/* the same for Python's own work between kernels (exact.py: gradual_underflow) */
int64_t exact_mode_enter(void) { return (int64_t)gradual_underflow(); }
void exact_mode_leave(int64_t mode) { restore_mode((unsigned)mode); }

/* a block's pair from the largest of its magnitudes' bits and the smallest less one
 * (zeros wrap past every value): its top bit and its lowest bit, negated */
static inline void exponent_pair(uint32_t high, uint32_t low, int16_t *out) {
    int32_t binade = (int32_t)(high >> 23);
    int32_t lowest = (int32_t)((low + 1u) >> 23);
    int16_t top = (int16_t)((binade > 1 ? binade : 1) - 127);
    int16_t bottom = (int16_t)(150 - (lowest > 1 ? lowest : 1));
    if (high == 0) top = bottom = ZERO;
    if (binade == 0xFF) { top = SPECIAL; bottom = ZERO; }
    out[0] = top;
    out[1] = bottom;
}

/* per block: the maxima of its values' top bits and of their lowest bits, negated */
void exact_exponents_f32(const uint32_t *restrict values, size_t n, size_t count,
                         int16_t *restrict out) {
    enum { CHUNK = 1024 };
    uint32_t high[CHUNK], low[CHUNK];
    for (size_t lo = 0; lo < count; lo += CHUNK) {
        size_t m = count - lo < CHUNK ? count - lo : CHUNK;
        for (size_t j = 0; j < m; j++) { high[j] = 0; low[j] = 0xFFFFFFFFu; }
        for (size_t row = 0; row * count + lo < n; row++) {
            const uint32_t *v = values + row * count + lo;
            size_t k = n - (row * count + lo) < m ? n - (row * count + lo) : m;
            for (size_t j = 0; j < k; j++) {
                uint32_t a = v[j] & 0x7FFFFFFFu;
                high[j] = a > high[j] ? a : high[j];
                uint32_t below = a - 1u;                /* zeros wrap past every value */
                low[j] = below < low[j] ? below : low[j];
            }
        }
        for (size_t j = 0; j < m; j++) exponent_pair(high[j], low[j], out + 2 * (lo + j));
    }
}

/* limbs[i] = values[i] in units of its block's lowest bit (0 where the block's
 * pair is ZERO or the value is not finite) */
static inline int64_t limb_one(uint32_t u, int64_t bottom) {
    int64_t e = (int64_t)((u >> 23) & 0xFFu);
    int64_t m = (int64_t)(u & 0x7FFFFFu) | (e ? 0x800000 : 0);
    int64_t shift = (e > 1 ? e : 1) - 150 + bottom;
    int64_t ok = shift >= 0 && shift < LIMB_BITS && e != 0xFF;
    int64_t x = ok ? (m << (shift & 63)) : 0;
    return (u >> 31) ? -x : x;
}

#if defined(__AVX2__)
/* Four lanes at a time. AVX2 converts no int64 to or from double: an integer of
 * magnitude below 2**51 is the low bits of 1.5 * 2**52 plus it, exactly (the
 * magic number's binade has a unit of 1), so both ways are an add and a subtract. */
#define MAGIC 0x4338000000000000LL      /* 1.5 * 2**52 */

static inline __m256d int64_to_double(__m256i v) {     /* |v| < 2**51: exact */
    const __m256i magic = _mm256_set1_epi64x(MAGIC);
    return _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(v, magic)),
                         _mm256_castsi256_pd(magic));
}

static inline __m256i integer_to_int64(__m256d x) {    /* an integer, |x| < 2**51: exact */
    const __m256i magic = _mm256_set1_epi64x(MAGIC);
    return _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(x, _mm256_castsi256_pd(magic))),
                            magic);
}

/* the lowest bits (each pair's second int16) of the 4 pairs at p, as 4 int32 */
static inline __m128i four_bottoms(const int16_t *p) {
    const __m128i odd = _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm_cvtepi16_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), odd));
}

/* limb_one of 4 values at once: each value times 2**bottom in float64 (exact: 24
 * bits, a power of two), converted; 0 if the lanes are not all of the common case
 * (returns 0: then limb_one, lane by lane): shifts of 27 or less, which every
 * consistent call's are (a value's limb in a block that fits one is below 2**48),
 * and no subnormal value (a thread that flushes denormals, torch.set_flush_denormal,
 * would read it as 0 in float64; limb_one reads its bits) */
static inline int limbs4(const uint32_t *v, const int16_t *p, int64_t *out) {
    __m128i u = _mm_loadu_si128((const __m128i *)v);
    __m128i bottom = four_bottoms(p);
    __m128i e = _mm_and_si128(_mm_srli_epi32(u, 23), _mm_set1_epi32(0xFF));
    __m128i shift = _mm_add_epi32(_mm_sub_epi32(_mm_max_epi32(e, _mm_set1_epi32(1)),
                                                _mm_set1_epi32(150)), bottom);
    __m128i ok = _mm_andnot_si128(
        _mm_or_si128(_mm_cmpgt_epi32(_mm_setzero_si128(), shift),
                     _mm_cmpgt_epi32(shift, _mm_set1_epi32(LIMB_BITS - 1))),
        _mm_xor_si128(_mm_cmpeq_epi32(e, _mm_set1_epi32(0xFF)), _mm_set1_epi32(-1)));
    __m128i subnormal = _mm_andnot_si128(
        _mm_cmpeq_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7FFFFF)), _mm_setzero_si128()),
        _mm_cmpeq_epi32(e, _mm_setzero_si128()));
    __m128i other = _mm_or_si128(subnormal,
                                 _mm_and_si128(ok, _mm_cmpgt_epi32(shift, _mm_set1_epi32(27))));
    if (!_mm_testz_si128(other, other)) return 0;
    /* 2**bottom where the lane is ok (bottom in [-104, 176] there), else anything */
    __m256i power = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(bottom),
                                                       _mm256_set1_epi64x(1023)), 52);
    __m256d x = _mm256_mul_pd(_mm256_cvtps_pd(_mm_castsi128_ps(u)), _mm256_castsi256_pd(power));
    __m256i limb = _mm256_and_si256(integer_to_int64(x), _mm256_cvtepi32_epi64(ok));
    _mm256_storeu_si256((__m256i *)out, limb);
    return 1;
}
#endif

void exact_limbs_f32(const uint32_t *restrict values, size_t n, size_t count,
                     const int16_t *restrict pairs, int64_t *restrict limbs) {
    for (size_t start = 0; start < n; start += count) {
        size_t k = n - start < count ? n - start : count;
        const uint32_t *v = values + start;
        int64_t *out = limbs + start;
        size_t j = 0;
#if defined(__AVX2__)
        for (; j + 4 <= k; j += 4)
            if (!limbs4(v + j, pairs + 2 * j, out + j))
                for (size_t t = j; t < j + 4; t++) out[t] = limb_one(v[t], pairs[2 * t + 1]);
#endif
        for (; j < k; j++) out[j] = limb_one(v[j], pairs[2 * j + 1]);
    }
}

static inline int top_bit64(uint64_t a) { return 63 - __builtin_clzll(a); }

/* float32 of d rounded to odd: the neighbour toward zero with its last bit set
 * where d falls between two (a later rounding to nearest at 2 or more bits fewer,
 * float16 or bfloat16, is then the exact value's one rounding) */
static inline float to_odd_f32(double d) {
    float f = (float)d;
    if ((double)f != d) {
        uint32_t b;
        memcpy(&b, &f, sizeof b);
        if (__builtin_fabs((double)f) > __builtin_fabs(d)) b -= 1u;      /* toward zero (inf: to FLT_MAX) */
        b |= 1u;
        memcpy(&f, &b, sizeof f);
    }
    return f;
}

/* out[i] = the summed limbs[i] over ``divisor`` in units of its block's lowest bit:
 * rounded to odd at 53 bits, times the units' power of two (exact), then cast
 * to float32 (one rounding, as the exact value's; with ``odd``, rounded to odd
 * for a half-precision result's one rounding after); elements [first, first + n)
 * of the piece. A divisor that is not a power of two divides the sum in float64:
 * below 2**53 units, its quotient is never a float32 value (nor a tie) unless the
 * exact one is (see the one-pass sums below), so the cast (or to_odd_f32) still
 * rounds once;
 * a run with a wider sum returns 0 (some elements unwritten: the caller's long
 * division), else 1. A run of one pass over the blocks at a time: where none of its
 * sums is 2**53 or wider (every call under 32 ranks) no element branches (a
 * branch on the sign, mispredicted half the time on gradients, cost 5 ns an
 * element) */
#if defined(__AVX2__)
/* to_odd_f32 of 4 lanes: f, d's cast to float32 */
static inline __m128 to_odd4(__m256d d, __m128 f) {
    const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
    const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    __m256d back = _mm256_cvtps_pd(f);
    __m256d inexact = _mm256_cmp_pd(back, d, _CMP_NEQ_UQ);
    __m256d away = _mm256_and_pd(inexact, _mm256_cmp_pd(_mm256_and_pd(back, magnitude),
                                                         _mm256_and_pd(d, magnitude), _CMP_GT_OQ));
    __m128i inexact32 = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(_mm256_castpd_si256(inexact), low_halves));
    __m128i away32 = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(_mm256_castpd_si256(away), low_halves));
    __m128i bits = _mm_add_epi32(_mm_castps_si128(f), away32);           /* -1: toward zero */
    return _mm_castsi128_ps(_mm_or_si128(bits, _mm_and_si128(inexact32, _mm_set1_epi32(1))));
}
#endif

/* one element of exact_round_odd_f32 (v: its limbs, the same sums; bottom: its block's) */
static inline float round_one(int64_t v, int wide, int64_t bottom, int64_t shift,
                              double divisor, const double *scales, int64_t odd) {
    if (wide) {
        uint64_t a = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
        if (a >= (1ull << 53)) {
            int s = top_bit64(a) - 52;
            a = ((a >> s) | (uint64_t)((a & ((1ull << s) - 1)) != 0)) << s;
            v = v < 0 ? -(int64_t)a : (int64_t)a;
        }
    }
    int64_t e = bottom + shift + SCALE_ZERO;
    double d = (double)v * scales[e > 0 ? e : 0];
    if (divisor != 1.0) d /= divisor;
    return odd ? to_odd_f32(d) : (float)d;
}

int64_t exact_round_odd_f32(const int64_t *restrict limbs, size_t first, size_t n,
                            size_t count, const int16_t *restrict pairs, int64_t divisor,
                            const double *restrict scales, int64_t odd, float *restrict out) {
    const int power = (divisor & (divisor - 1)) == 0;
    const int64_t shift = power ? 63 - __builtin_clzll((uint64_t)divisor) : 0;
    const double over = power ? 1.0 : (double)divisor;          /* divided after, if not 1 */
    const unsigned mode = gradual_underflow();
    size_t j = first % count;
    for (size_t i = 0; i < n; ) {
        size_t k = count - j < n - i ? count - j : n - i;
        const int64_t *l = limbs + i;
        const int16_t *p = pairs + 2 * j;
        float *o = out + i;
        uint64_t magnitudes = 0;
        for (size_t t = 0; t < k; t++) {
            uint64_t sign = (uint64_t)(l[t] >> 63);
            magnitudes |= ((uint64_t)l[t] ^ sign) - sign;
        }
        int wide = (magnitudes >> 53) != 0;
        if (wide && !power) {
            restore_mode(mode);
            return 0;
        }
        size_t t = 0;
#if defined(__AVX2__)
        if ((magnitudes >> 51) == 0) {         /* every sum of fewer than 8 ranks */
            const __m128i offset = _mm_set1_epi32((int)(shift + SCALE_ZERO));
            const __m256d dv = _mm256_set1_pd(over);
            for (; t + 4 <= k; t += 4) {
                __m128i e = _mm_max_epi32(_mm_add_epi32(four_bottoms(p + 2 * t), offset),
                                          _mm_setzero_si128());
                __m256d d = _mm256_mul_pd(
                    int64_to_double(_mm256_loadu_si256((const __m256i *)(l + t))),
                    _mm256_i32gather_pd(scales, e, 8));
                if (!power) d = _mm256_div_pd(d, dv);
                __m128 f = _mm256_cvtpd_ps(d);
                _mm_storeu_ps(o + t, odd ? to_odd4(d, f) : f);
            }
        }
#endif
        for (; t < k; t++)
            o[t] = round_one(l[t], wide, p[2 * t + 1], shift, over, scales, odd);
        i += k;
        j = 0;
    }
    restore_mode(mode);
    return 1;
}

/* ---- exact sums in one pass, on one node (exact.py: sum_in_one_pass) ----
 * The local ranks' addends of an element are all read by the rank that sums it: it
 * checks each run of EXACT_RUN elements itself. A run whose values fit one limb (their
 * pair from exponent_pair: every value a multiple of the lowest bit u, below
 * 2**LIMB_BITS u) among at most EXACT_TERMS = 2**(53 - LIMB_BITS) addends has every
 * partial sum a multiple of u below 2**53 u: its float64 sum is exact. Its quotient by
 * d < 2**29 rounded to 53 bits is never a float32 value (nor a tie) unless the exact
 * quotient is one (it lies at least min(u, a float32 half unit) / d from any, farther
 * than half a float64 unit), so one cast is the exact mean's one rounding (to nearest,
 * or to odd for a half precision's after): the same bits as the limbs' path. The other
 * runs (a wider span, an infinity or a NaN) are left to the caller, which sums them
 * element by element. */
enum { EXACT_TERMS = 32, EXACT_RUN = 32 };

/* whether the run [i, i + m) of the k addends (float32 bits) fits one limb */
static inline int run_fits(const uint32_t *const *srcs, size_t k, size_t i, size_t m) {
    uint32_t high = 0, low = 0xFFFFFFFFu;
    for (size_t r = 0; r < k; r++) {
        const uint32_t *v = srcs[r] + i;
        if (m == EXACT_RUN) {                       /* a constant count: one vector pass */
            for (size_t j = 0; j < EXACT_RUN; j++) {
                uint32_t a = v[j] & 0x7FFFFFFFu;
                high = a > high ? a : high;
                low = a - 1u < low ? a - 1u : low;
            }
        } else {
            for (size_t j = 0; j < m; j++) {
                uint32_t a = v[j] & 0x7FFFFFFFu;
                high = a > high ? a : high;
                low = a - 1u < low ? a - 1u : low;
            }
        }
    }
    int16_t pair[2];
    exponent_pair(high, low, pair);
    return pair[0] != SPECIAL && (pair[0] == ZERO || pair[0] + pair[1] < LIMB_BITS);
}

#if defined(__F16C__) && defined(__AVX2__)
/* 8 halves' float32 values, exactly (a NaN quieted) */
static inline __m256 half8_up(const uint16_t *p, int kind) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return kind == BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                        : _mm256_cvtph_ps(h);
}

/* to_odd_f32 of 4 lanes of float32's normal range (or 0): the double's significand cut
 * to float32's 24 bits (toward zero), its last bit set where anything was cut. Below
 * 2**-126 the cast then rounds to float32's subnormals (2**-149 apart): a float16 sum
 * over a divisor below 2**14 is never there (2**-38 or more, or 0), and a bfloat16 one,
 * a multiple of 2**-133 over such a divisor, lies 2**-148 or more from any bfloat16
 * tie unless on it: that rounding cannot reach one, and the half's is still the one
 * rounding of the exact value. */
static inline __m128 odd4_normal(__m256d d) {
    const __m256i below = _mm256_set1_epi64x((1LL << 29) - 1);
    __m256i bits = _mm256_castpd_si256(d);
    __m256i cut = _mm256_andnot_si256(_mm256_cmpeq_epi64(_mm256_and_si256(bits, below),
                                                         _mm256_setzero_si256()),
                                      _mm256_set1_epi64x(1LL << 29));
    bits = _mm256_or_si256(_mm256_andnot_si256(below, bits), cut);
    return _mm256_cvtpd_ps(_mm256_castsi256_pd(bits));
}
#endif

/* the largest of 8 unsigned lanes */
#if defined(__AVX2__)
static inline uint32_t lanes_max(__m256i v) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}

static inline uint32_t lanes_min(__m256i v) {
    __m128i x = _mm_min_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}
#endif

/* out = the exact sum of the k addends (kind: F32 float32 bits, HALF16 float16,
 * BF16 bfloat16 bits) over ``divisor``, rounded once into their dtype, a run of
 * EXACT_RUN elements at a time: each addend's run read once, into the float64 sums
 * and the run's largest magnitude and least (run_fits), in registers; a run that fits
 * one limb stored, the start of one that does not put in ``apart`` (its count
 * returned; the run left unwritten). ``out`` may be srcs[r]. */
static inline __attribute__((always_inline)) int64_t exact_runs(
        const void *const *srcs, size_t k, size_t n, int64_t divisor, const int kind,
        void *out, int64_t *apart) {
    const double d = (double)divisor, factor = 1.0 / d;
    const int power = (divisor & (divisor - 1)) == 0;   /* times 1 / d: exact, and faster */
    int64_t count = 0;
    size_t lo = 0;
#if defined(__F16C__) && defined(__AVX2__)
    const __m256d dv = _mm256_set1_pd(d), scale = _mm256_set1_pd(factor);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), one = _mm256_set1_epi32(1);
    for (; lo + 32 <= n; lo += 32) {
        __m256d acc[8];
        for (int g = 0; g < 8; g++) acc[g] = _mm256_setzero_pd();      /* -0 + +0: +0 */
        __m256i high = _mm256_setzero_si256(), low = _mm256_set1_epi32(-1);
        for (size_t r = 0; r < k; r++) {
            for (int g = 0; g < 4; g++) {
                size_t at = lo + 8 * (size_t)g;
                __m256 x = kind == F32 ? _mm256_loadu_ps((const float *)srcs[r] + at)
                                       : half8_up((const uint16_t *)srcs[r] + at, kind);
                __m256i a = _mm256_and_si256(_mm256_castps_si256(x), magnitude);
                high = _mm256_max_epu32(high, a);
                low = _mm256_min_epu32(low, _mm256_sub_epi32(a, one));   /* 0 wraps past */
                acc[2 * g] = _mm256_add_pd(acc[2 * g], _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
                acc[2 * g + 1] = _mm256_add_pd(acc[2 * g + 1],
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            }
        }
        int16_t pair[2];
        exponent_pair(lanes_max(high), lanes_min(low), pair);
        if (pair[0] == SPECIAL || (pair[0] != ZERO && pair[0] + pair[1] >= LIMB_BITS)) {
            apart[count++] = (int64_t)lo;
            continue;
        }
        for (int g = 0; g < 4; g++) {
            __m256d first = power ? _mm256_mul_pd(acc[2 * g], scale) : _mm256_div_pd(acc[2 * g], dv);
            __m256d second = power ? _mm256_mul_pd(acc[2 * g + 1], scale)
                                   : _mm256_div_pd(acc[2 * g + 1], dv);
            size_t at = lo + 8 * (size_t)g;
            if (kind == F32) {
                _mm256_storeu_ps((float *)out + at, _mm256_set_m128(_mm256_cvtpd_ps(second),
                                                                     _mm256_cvtpd_ps(first)));
                continue;
            }
            __m256 f = _mm256_set_m128(odd4_normal(second), odd4_normal(first));
            if (kind == BF16) {
                __m256i packed = _mm256_packus_epi32(bf16_round_bits(_mm256_castps_si256(f)),
                                                     _mm256_setzero_si256());
                _mm_storeu_si128((__m128i *)((uint16_t *)out + at), _mm256_castsi256_si128(
                    _mm256_permute4x64_epi64(packed, 0xD8)));
            } else {
                _mm_storeu_si128((__m128i *)((uint16_t *)out + at), _mm256_cvtps_ph(
                    f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
    }
#endif
    /* the last run, shorter (everything, without the vector units): element by element */
    for (; lo < n; lo += EXACT_RUN) {
        size_t m = n - lo < EXACT_RUN ? n - lo : EXACT_RUN;
        uint32_t up[EXACT_TERMS][EXACT_RUN];
        const uint32_t *ups[EXACT_TERMS];
        for (size_t r = 0; r < k; r++) {
            for (size_t j = 0; j < m; j++) up[r][j] = as_bits(up_one(srcs[r], lo + j, kind));
            ups[r] = up[r];
        }
        if (!run_fits(ups, k, 0, m)) {
            apart[count++] = (int64_t)lo;
            continue;
        }
        for (size_t j = 0; j < m; j++) {
            double acc = 0.0;
            for (size_t r = 0; r < k; r++) acc += (double)as_float(up[r][j]);
            acc = power ? acc * factor : acc / d;
            if (kind == F32) ((float *)out)[lo + j] = (float)acc;
            else {
                float f = to_odd_f32(acc);
                ((uint16_t *)out)[lo + j] = kind == BF16 ? bfloat16_down(as_bits(f))
                                                         : half_down(as_bits(f));
            }
        }
    }
    return count;
}

/* out = the exact sum of the k float32 addends (srcs: their bits) over ``divisor``,
 * rounded once, run by run; the starts of the runs that do not fit one limb (left
 * unwritten) go to ``apart``, their count returned (-1: more than EXACT_TERMS addends,
 * nothing written) */
int64_t exact_sum_f32(const uint32_t *const *srcs, size_t k, size_t n, int64_t divisor,
                      float *out, int64_t *apart) {
    if (k > EXACT_TERMS) return -1;
    const unsigned mode = gradual_underflow();
    int64_t count = exact_runs((const void *const *)srcs, k, n, divisor, F32, out, apart);
    restore_mode(mode);
    return count;
}

/* exact_sum_f32 of float16 (kind HALF16) or bfloat16 (BF16) addends into their dtype:
 * cast up exactly, summed in float64, divided, rounded to odd at float32, then to
 * nearest in the half precision (the exact value's one rounding) */
int64_t exact_sum_half(const uint16_t *const *srcs, size_t k, size_t n, int64_t divisor,
                       int64_t kind, uint16_t *out, int64_t *apart) {
    if (k > EXACT_TERMS) return -1;
    const unsigned mode = gradual_underflow();
    const void *const *addends = (const void *const *)srcs;
    int64_t count = kind == BF16 ? exact_runs(addends, k, n, divisor, BF16, out, apart)
                                 : exact_runs(addends, k, n, divisor, HALF16, out, apart);
    restore_mode(mode);
    return count;
}
