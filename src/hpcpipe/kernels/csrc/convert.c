/* Scalar widening of 16-bit floats to float32 (the portable paths and the checks; the vector paths widen in
 * registers): bfloat16 is a float32's high half, float16 is rebuilt from its sign, exponent and mantissa. */
#include <string.h>

#include "hp.h"

float hp_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float hp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);                  /* inf, nan */
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {                                               /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
