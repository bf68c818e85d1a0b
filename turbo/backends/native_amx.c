/* bf16 matrices (wtype 6) by AMX tiles where the CPU has AMX-BF16 (TURBO_ISA=amx, or its
 * default there): whether they are on (bf16_products, asked from Python) and the tiles' loop over
 * a range of panels (amx_panels), which amx_products (native_products.c: the inputs rounded to
 * bf16 rows, the threads' split) calls. Apart from the other products since it is another
 * register file, with its own numbers (the inputs rounded to bf16); without AMX-BF16 it is
 * bf16_products answering 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

#if AMX_BF16
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ---- bf16 matrices by AMX (wtype 6's panels, TDPBF16PS) ----
 * Where the CPU has AMX-BF16 (and the kernel grants the tile data), a bf16 matrix whose width k
 * is a multiple of 32 is multiplied by the tiles, for every row count alike: the inputs rounded
 * to bf16 (to nearest even, as bf16_pairs), 16 rows to a tile (the last rows zero), each output
 * one accumulator tile walked over k in steps of 32 inputs in order. Row m of a product is made
 * from row m of the inputs alone by the same instructions whatever the other rows hold (zeros,
 * other prompts' rows, a prefill's): row-stable, but no longer the fp32 function (as a bf16
 * model in transformers, the activations are bf16 at each product). The panel_pairs layout is
 * already the tiles' "B" layout: panel p's pairs j..j+15 are one 1 KB tile, 64 bytes a pair row.
 * bf16_products(0) keeps the exact fp32 walk instead (TURBO_BF16_PRODUCTS=exact). */

#ifndef AMX_AHEAD
#define AMX_AHEAD 0 /* bytes ahead in a panel's stream to prefetch (0: none; 1-8 KB measured no faster) */
#endif

static int amx_state = -1; /* -1 not asked yet, 0 off (absent, refused or turned off), 1 on */

/* bf16 matrices through AMX: want 1 on where the CPU and the kernel allow, 0 off (the exact fp32
 * walk), -1 only ask; returns whether they are on. Set once, before the first product. */
int bf16_products(int want) {
#if AMX_BF16
    if (amx_state < 0 || want >= 0) {
        int ok = 0;
        unsigned a, b, c, d; /* CPUID 7.0 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE */
        if (want != 0 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1))
            ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        amx_state = ok;
    }
    return amx_state;
#else
    (void)want;
    amx_state = 0;
    return 0;
#endif
}

#if AMX_BF16
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* One accumulator tile (16 rows x 16 outputs) into y: rows r.., outputs o0.. (those below R, n). */
#define AMX_STORE(T, r, o0)                                                                  \
    if ((r) + 16 <= R && (o0) + 16 <= n) {                                                   \
        _tile_stored(T, y + (size_t)(r) * n + (o0), (long)n * 4);                            \
    } else {                                                                                 \
        _tile_stored(T, buf, 64);                                                            \
        for (int b = 0; b < 16 && (r) + b < R; b++)                                          \
            for (int l = 0; l < 16 && (o0) + l < n; l++) y[(size_t)((r) + b) * n + (o0) + l] = buf[16 * b + l]; \
    }

/* Panels [p0, p1) of a wtype 6 matrix, all Rp rows (xb from amx_rows; kp = k / 2, a multiple of
 * 16): two panels by 32 rows at a time (four accumulator tiles), panels outer so that each panel
 * is read from memory once and the rows from the caches. */
INTERNAL void amx_panels(const uint16_t *xb, int R, int Rp, int kp, const uint8_t *P, int n, float *y, int p0,
                         int p1, long xs) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    float buf[256] __attribute__((aligned(64)));
    int p = p0;
    if (Rp == 16) /* a decode step or a short verify: bound by reading the weights, four panels
                   * (four streams) at a time */
        for (; p + 4 <= p1; p += 4) {
            const uint8_t *B = P + (size_t)p * kp * 64;
            size_t ps = (size_t)kp * 64;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            /* the B tiles' registers in turn (5, 6, 7, 5; 6, 7, 5, 6; 7, 5, 6, 7): a load waits on the
             * product three before it, not the one just issued */
#define AMX_STEP(J, T0, T1, T2, T3)                                                            \
    {                                                                                          \
        _tile_loadd(4, xb + 2 * (J), xs);                                                      \
        _tile_loadd(T0, B + 64 * (J), 64);                                                     \
        _tile_dpbf16ps(0, 4, T0);                                                              \
        _tile_loadd(T1, B + ps + 64 * (J), 64);                                                \
        _tile_dpbf16ps(1, 4, T1);                                                              \
        _tile_loadd(T2, B + 2 * ps + 64 * (J), 64);                                            \
        _tile_dpbf16ps(2, 4, T2);                                                              \
        _tile_loadd(T3, B + 3 * ps + 64 * (J), 64);                                            \
        _tile_dpbf16ps(3, 4, T3);                                                              \
    }
            int j = 0;
            for (; j + 48 <= kp; j += 48) {
                AMX_STEP(j, 5, 6, 7, 5)
                AMX_STEP(j + 16, 6, 7, 5, 6)
                AMX_STEP(j + 32, 7, 5, 6, 7)
            }
            for (; j < kp; j += 16) AMX_STEP(j, 5, 6, 7, 5)
#undef AMX_STEP
            AMX_STORE(0, 0, p * 16)
            AMX_STORE(1, 0, p * 16 + 16)
            AMX_STORE(2, 0, p * 16 + 32)
            AMX_STORE(3, 0, p * 16 + 48)
        }
    for (; p < p1; p += 2) {
        int two = p + 1 < p1;
        const uint8_t *B0 = P + (size_t)p * kp * 64, *B1 = B0 + (size_t)kp * 64;
        for (int r = 0; r < Rp; r += 32) {
            int tall = r + 16 < Rp;
            const uint8_t *A0 = (const uint8_t *)(xb + (size_t)r * kp * 2), *A1 = A0 + (size_t)16 * xs;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (two && tall)
                for (int j = 0; j < kp; j += 16) {
                    _tile_loadd(4, A0 + 4 * j, xs);
                    _tile_loadd(6, B0 + 64 * j, 64);
                    _tile_loadd(5, A1 + 4 * j, xs);
                    _tile_loadd(7, B1 + 64 * j, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            else
                for (int j = 0; j < kp; j += 16) {
#if AMX_AHEAD
                    for (int c = 0; c < 1024; c += 64) {
                        __builtin_prefetch(B0 + 64 * j + AMX_AHEAD + c);
                        if (two) __builtin_prefetch(B1 + 64 * j + AMX_AHEAD + c);
                    }
#endif
                    _tile_loadd(4, A0 + 4 * j, xs);
                    _tile_loadd(6, B0 + 64 * j, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, B1 + 64 * j, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (tall) {
                        _tile_loadd(5, A1 + 4 * j, xs);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
            AMX_STORE(0, r, p * 16)
            if (two) AMX_STORE(1, r, p * 16 + 16)
            if (tall) {
                AMX_STORE(2, r + 16, p * 16)
                if (two) AMX_STORE(3, r + 16, p * 16 + 16)
            }
        }
    }
    _tile_release();
}
#endif
