/* The text model's CPU kernels that torch runs as many small ops: decode attention (one query
 * row per sequence and query head over that sequence's K/V rows), RMSNorm, RMSNorm with
 * rotate-half RoPE, and the MLP's silu(gate) * up. Each exists for float32 (`_f32`) and
 * bfloat16 (`_bf16`): cpu_kernels_body.h is compiled once per element type. Built and called
 * by common/models/native_kernels.py, which says why and how. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
 * Taylor polynomial, 2^n put in the exponent bits. Written so that the compiler vectorizes
 * the loops calling it (no libm call). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f; /* e^-87 ~ 1.6e-38: vanishes in any sum with 1 */
    float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f; /* ln 2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
              + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(g) = g / (1 + e^-g), from e^-|g| so that the exponential never overflows. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g > 0.0f ? -g : g);
    return g * (g > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

/* bfloat16 is the top half of a float32; rounding to it is to nearest, ties to even, as
 * torch rounds (a NaN stays a NaN). */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(base) CAT(base, SUFFIX)

/* float32: values as they are. LOAD reads an element as float; STORE writes one; ROUND is
 * the rounding torch applies between two ops of that dtype (none in float32). */
#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define ROUND(x) (x)
#include "cpu_kernels_body.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef ROUND

/* bfloat16: computed in float32, rounded where torch's bfloat16 ops round. */
#define T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_f32(x)
#define STORE(x) f32_to_bf16(x)
#define ROUND(x) bf16_round(x)
#include "cpu_kernels_body.h"
