// The static decoder's CPU kernels, free of torch (native.cpp binds them to torch; tests/kernel_bits.cpp runs them
// alone, on any CPU a cross compiler targets): the linear y[r, o] = sum_k x[r, k] * w[o, k] (activations float32,
// weights float32, bfloat16 or float16, sums in float32) and attention over each row's own sequence.
//
// Why our own: at one row a decode step is a matrix-vector product that must stream every weight once at the
// memory's speed, and every (row, output) must run the same code on the same operands in the same order, so that a
// row's result does not depend on how many rows share the call (row-invariant by construction).
//
// The rule the bits rest on: every accumulation is written as a fused multiply-add BY NAME (fma() below: an
// intrinsic where the ISA has one, else __builtin_fmaf lane by lane) or as a separate multiply and add, and the
// library is built with -ffp-contract=off, so no compiler heuristic decides it. (-ffp-contract=fast only permits
// fusing; GCC's Zen 1-3 tuning, which a build for the host CPU brings there, left single-chain loops unfused, and a
// verify row came out 1 ulp off the one-token step.) The same sums in the same order at every ISA level: AVX-512 (16 lanes),
// x86-64-v3 (8 lanes) and the portable path (GCC vector extensions, no intrinsics: aarch64 or any x86-64) give the
// same bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// How a kernel splits its work over threads: native.cpp passes ATen's pool, a standalone caller runs it in one
#ifndef DFLASHKIT_PARALLEL_FOR
#define DFLASHKIT_PARALLEL_FOR(begin, end, grain, ...) (__VA_ARGS__)(begin, end)
#define DFLASHKIT_THREADS() 1
#endif

namespace dflashkit_kernels {

struct bf16 {  // the top half of a float32, as c10::BFloat16 stores it
  uint16_t x;
};

struct f16 {  // IEEE half precision, as GGUF's F16 tensors store it: every value exact in float32
  uint16_t x;
};

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t LANES = 64;  // a dot's 64 lanes: four chains of 16, or eight of 8, in the same memory order

// a * b + c rounded once, on every lane
template <typename V>
inline V fma_lanes(V a, V b, V c) {
  V r;
  for (unsigned i = 0; i < sizeof(V) / sizeof(float); ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(c)));
#else
  return fma_lanes(a, b, c);
#endif
}

inline f32x8 fma(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__)
  return reinterpret_cast<f32x8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(c)));
#else
  return fma_lanes(a, b, c);
#endif
}

template <typename V>
inline V splat(float x) {  // x - 0 is x, every bit of it (a lane-by-lane fill went through the stack)
  return x - V{};
}

template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float to_float(float v) { return v; }

inline float to_float(bf16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }

// bf16 widened: each 16-bit value zero-extended and shifted up (an intrinsic where there is one: GCC's generic
// 16-lane conversion split into 256-bit halves, five instructions where one does)
template <typename V>
inline V load(const bf16* p);

template <>
inline f32x16 load<f32x16>(const bf16* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<f32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return std::bit_cast<f32x16>(__builtin_convertvector(h, u32x16) << 16);
#endif
}

template <>
inline f32x8 load<f32x8>(const bf16* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f32x8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return std::bit_cast<f32x8>(__builtin_convertvector(h, u32x8) << 16);
#endif
}

// f16 widened: F16C's conversion where the level has it (v3, v4), else the same exact widening in integer steps
// (sign apart; exponent rebiased; a subnormal made normal by an exact float32 subtraction, so no step meets a
// denormal operand that a flush-to-zero mode would zero; infinities and NaNs keep an all-ones exponent)
typedef uint16_t u16x4 __attribute__((vector_size(8)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
template <typename V>
struct halves_of;  // (a vector size that depends on a template parameter is lost in GCC's templates)
template <>
struct halves_of<f32x4> { typedef u16x4 H; typedef u32x4 U; };
template <>
struct halves_of<f32x8> { typedef u16x8 H; typedef u32x8 U; };
template <>
struct halves_of<f32x16> { typedef u16x16 H; typedef u32x16 U; };

template <typename V>
inline V widen_halves(const uint16_t* p) {
  typedef typename halves_of<V>::U U;
  typename halves_of<V>::H h;
  std::memcpy(&h, p, sizeof h);
  const U u = __builtin_convertvector(h, U), sign = (u & 0x8000u) << 16;
  U o = (u & 0x7fffu) << 13;
  const U e = o & 0x0f800000u;
  o += 0x38000000u;  // the exponent's bias, 15 -> 127
  o = e == 0x0f800000u ? o + 0x38000000u : o;  // infinity or NaN: exponent 255
  o = e == 0 ? o + 0x00800000u : o;  // zero or subnormal: 2^-14 * (1 + m), then less 2^-14
  const V f = std::bit_cast<V>(o) - std::bit_cast<V>(reinterpret_cast<U>(e == 0) & 0x38800000u);
  return std::bit_cast<V>(std::bit_cast<U>(f) | sign);
}

template <typename V>
inline V load(const f16* p);

template <>
inline f32x16 load<f32x16>(const f16* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return widen_halves<f32x16>(reinterpret_cast<const uint16_t*>(p));
#endif
}

template <>
inline f32x8 load<f32x8>(const f16* p) {
#if defined(__F16C__)
  return reinterpret_cast<f32x8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return widen_halves<f32x8>(reinterpret_cast<const uint16_t*>(p));
#endif
}

inline float to_float(f16 v) {
  const uint16_t lanes[4] = {v.x};
  return widen_halves<f32x4>(lanes)[0];
}

// A k that is not a multiple of 64: its last products go to lanes 0.. of the 64 (in memory order) before the tree,
// each a fused multiply-add as a lane computes it
template <typename V, int N, typename W>
inline void add_tail(V (&acc)[N], const float* x, const W* w, int64_t tail) {
  static_assert(sizeof(acc) == LANES * sizeof(float), "a dot holds 64 lanes");
  float lanes[LANES];
  std::memcpy(lanes, acc, sizeof lanes);
  for (int64_t j = 0; j < tail; ++j) lanes[j] = __builtin_fmaf(x[j], to_float(w[j]), lanes[j]);
  std::memcpy(acc, lanes, sizeof lanes);
}

// 8 lanes halved three times: (0+4, 1+5, 2+6, 3+7), then (0+2) + (1+3)
inline float halve8(f32x8 h8) {
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

#if defined(__AVX512F__)
// ---- x86-64-v4: one register holds 16 lanes, so a dot keeps four chains of 16
typedef f32x16 lvec;
constexpr int CHAINS = 4, VL = 16;

// A dot's four chains in one register: chains (0+2) + (1+3)
inline f32x16 combine(const f32x16 (&acc)[4]) { return (acc[0] + acc[2]) + (acc[1] + acc[3]); }

inline float halve(f32x16 v) {
  return halve8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
#else
// ---- x86-64-v3 and the portable path: 8 lanes a register. The same 64 lanes are eight chains of 8: chain b lane
// j is lane 8b + j of the 64, the memory order of v4's four chains of 16, and the tree below is v4's tree.
// (Written with 16-lane vectors, GCC kept the accumulators on the stack on AVX2, far slower.)
typedef f32x8 lvec;
constexpr int CHAINS = 8, VL = 8;

// v4's (chain 0 + chain 2) + (chain 1 + chain 3): its low eight lanes plus its high eight
inline f32x8 combine(const f32x8 (&acc)[8]) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

inline float halve(f32x8 v) { return halve8(v); }
#endif

// The sum of a dot's chains in a fixed tree; a k that is not a multiple of 64 first adds its last products
template <typename W>
inline float finish(lvec (&acc)[CHAINS], const float* x, const W* w, int64_t tail) {
  if (tail) add_tail(acc, x, w, tail);
  return halve(combine(acc));
}

// A dot's chains over its first `full` inputs (a multiple of 64), interleaved: one pass over x and w
template <typename W>
inline void chains(const float* __restrict x, const W* __restrict w, int64_t full, lvec (&acc)[CHAINS]) {
  for (int64_t i = 0; i < full; i += LANES)
    for (int c = 0; c < CHAINS; ++c) acc[c] = fma(load<lvec>(x + i + VL * c), load<lvec>(w + i + VL * c), acc[c]);
}

// One row of x against one row of w in 64 lanes summed in a fixed tree (attention's scores: a query against a key)
template <typename W>
inline float dot(const float* __restrict x, const W* __restrict w, int64_t k) {
  lvec acc[CHAINS] = {};
  const int64_t full = k - k % LANES;
  chains(x, w, full, acc);
  return finish(acc, x + full, w + full, k - full);
}

// ---- the linear: weights in panels, outputs in a vector's lanes
// w in panel order (static.panel_order): each 16 outputs as one panel [k][16], the last outs % 16 outputs as [k][rest].
// y[r, o] is one chain of fused multiply-adds over k in passes of KC, each pass from zero and added to the passes
// before: the same bits whatever rows and outputs share a call and whatever the vector width (a lane and a scalar
// fuse alike, by name), so a verify row is the one-token step's and every level computes the same. A weight vector
// loaded serves every row of a block and a row's x[k] every output of it.
constexpr int64_t PANEL = 16, PV = PANEL / VL;  // outputs a panel, vectors a panel's row
constexpr int64_t KC = 128;  // inputs a pass: a block's panels stay in L1 while its rows run
#if defined(__AVX512F__)
constexpr int RB = 12, NPB = 2;  // a block of at most 12 rows x 2 panels: 24 sums in 32 registers
#else
constexpr int RB = 3, NPB = 2;  // 3 rows x 2 panels (2 registers each): 12 sums in 16 registers
#endif
constexpr int NP1 = 8 / PV;  // one row against 8 sums' worth of panels: enough chains to hide the FMA's latency

// The next weights to bring to L2 while a block computes from L1: `each` cache lines a step of k, `left` in all
struct Ahead {
  const char* line;
  int64_t left, each;
  inline void step() {
    for (int64_t l = 0; l < each && left > 0; ++l, --left, line += 64) __builtin_prefetch(line, 0, 2);
  }
};

// ---- GGUF's quantized weights, kept in their format and widened in registers (static.quant_order packs them).
// Each matrix in blocks of 32 inputs, as the file has them, repacked per panel: for each panel (16 outputs) and each
// block of 32 inputs, the 16 outputs' scales widened to float32 (d, then for q4_1 the mins m), then the quants
// [32 inputs][16 outputs] (q8_0: int8; q4_0, q4_1: a byte per output and pair of inputs, the even input's in the
// low nibble; q6_k: int8, with two scales, inputs 0-15's then 16-31's; q5_0: d, each output's fifth bits in a
// 32-bit word, then q4_0's nibbles). Other GGUF formats are unpacked into these (static.unpack: q4_K as q4_1 with
// m = -dmin * m', q6_K as q6_k). A weight is widened to the float32 value GGUF's reference dequantizer gives (d * q, for q4_1 then + m,
// each rounded; d * q is exact, a half's 11 bits by at most 8, so q4_1's is one fused multiply-add), and the sums
// run the float32 chain: the outputs are the float32 kernel's over a dequantized copy, bit for bit.
struct q8_0 { static constexpr int64_t SCALES = 1, QUANTS = 32 * PANEL; };
struct q4_0 { static constexpr int64_t SCALES = 1, QUANTS = 16 * PANEL; };
struct q4_1 { static constexpr int64_t SCALES = 2, QUANTS = 16 * PANEL; };
struct q6_k { static constexpr int64_t SCALES = 2, QUANTS = 32 * PANEL; };  // int8 quants, a scale per 16 inputs
struct q5_0 { static constexpr int64_t SCALES = 2, QUANTS = 16 * PANEL; };  // d, then the fifth bits, then nibbles
template <typename W>
constexpr bool quantized = std::is_same_v<W, q8_0> || std::is_same_v<W, q4_0> || std::is_same_v<W, q4_1> ||
                           std::is_same_v<W, q6_k> || std::is_same_v<W, q5_0>;
template <typename Q>
constexpr bool bytes8 = std::is_same_v<Q, q8_0> || std::is_same_v<Q, q6_k>;  // a byte a quant
template <typename Q>
constexpr int64_t BLOCK_BYTES = Q::SCALES * PANEL * 4 + Q::QUANTS;  // one panel's block of 32 inputs

// A panel's place in w: `p` panels of k inputs on (a quantized matrix counts bytes)
template <typename W>
inline const W* panel_at(const W* w, int64_t p, int64_t k) {
  if constexpr (quantized<W>)
    return reinterpret_cast<const W*>(reinterpret_cast<const uint8_t*>(w) + p * (k / 32) * BLOCK_BYTES<W>);
  else
    return w + p * PANEL * k;
}

template <typename W>
inline int64_t panel_bytes(int64_t k) {
  if constexpr (quantized<W>)
    return k / 32 * BLOCK_BYTES<W>;
  else
    return PANEL * k * static_cast<int64_t>(sizeof(W));
}

typedef int8_t i8xv __attribute__((vector_size(VL)));
typedef uint8_t u8xv __attribute__((vector_size(VL)));
typedef int32_t i32xv __attribute__((vector_size(4 * VL)));

// VL bytes widened to int32 lanes, unsigned or signed (an intrinsic where there is one: GCC's generic conversion
// went byte by byte through general registers)
template <bool SIGNED>
inline i32xv widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<i32xv>(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<i32xv>(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  if constexpr (SIGNED) {
    i8xv v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, i32xv);
  } else {
    u8xv v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, i32xv);
  }
#endif
}

// Vector v of a panel's weights at inputs i and i + 1 (i even), widened: w0, w1
template <typename Q>
inline void widen2(const uint8_t* panel, int64_t i, int v, lvec& w0, lvec& w1) {
  const uint8_t* b = panel + (i / 32) * BLOCK_BYTES<Q>;
  const int64_t j = i % 32;
  const int64_t half = std::is_same_v<Q, q6_k> && j >= 16 ? PANEL : 0;  // q6_k: inputs 16-31 have scales of their own
  const lvec d = load<lvec>(reinterpret_cast<const float*>(b) + half + v * VL);
  const uint8_t* q = b + Q::SCALES * PANEL * 4 + v * VL;
  if constexpr (bytes8<Q>) {
    w0 = __builtin_convertvector(widen_bytes<true>(q + j * PANEL), lvec) * d;
    w1 = __builtin_convertvector(widen_bytes<true>(q + (j + 1) * PANEL), lvec) * d;
  } else {
    const i32xv pair = widen_bytes<false>(q + j / 2 * PANEL);
    i32xv lo = pair & 15, hi = pair >> 4;
    if constexpr (std::is_same_v<Q, q4_0>) {
      w0 = d * __builtin_convertvector(lo - 8, lvec);
      w1 = d * __builtin_convertvector(hi - 8, lvec);
    } else if constexpr (std::is_same_v<Q, q5_0>) {  // each output's fifth bits in a word, input j's at bit j
      i32xv high;
      std::memcpy(&high, reinterpret_cast<const int32_t*>(b) + PANEL + v * VL, sizeof high);
      w0 = d * __builtin_convertvector((lo | ((high >> j) & 1) << 4) - 16, lvec);
      w1 = d * __builtin_convertvector((hi | ((high >> (j + 1)) & 1) << 4) - 16, lvec);
    } else {
      const lvec m = load<lvec>(reinterpret_cast<const float*>(b) + PANEL + v * VL);
      w0 = fma(d, __builtin_convertvector(lo, lvec), m);  // d * q is exact (11 by 4 bits): one rounding either way
      w1 = fma(d, __builtin_convertvector(hi, lvec), m);
    }
  }
}

// panel_block over quantized weights: the same chain per output (inputs in order, one fused multiply-add each),
// two inputs a step so that a byte of nibbles is read once
template <int R, int NP, typename Q>
inline void panel_block_quant(const float* __restrict x, int64_t k, const Q* w, float* __restrict y, int64_t outs,
                              int64_t k0, int64_t k1, Ahead& ahead) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w);
  const int64_t pb = panel_bytes<Q>(k);
  lvec acc[R][NP * PV] = {};
  for (int64_t i = k0; i < k1; i += 2) {
    ahead.step();
    ahead.step();
    lvec x0[R], x1[R];
    for (int r = 0; r < R; ++r) x0[r] = splat<lvec>(x[r * k + i]), x1[r] = splat<lvec>(x[r * k + i + 1]);
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < PV; ++v) {
        lvec w0, w1;
        widen2<Q>(base + p * pb, i, v, w0, w1);
        for (int r = 0; r < R; ++r) acc[r][p * PV + v] = fma(x1[r], w1, fma(x0[r], w0, acc[r][p * PV + v]));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP * PV; ++v) {
      float* out = y + r * outs + v * VL;
      const lvec sum = k0 ? load<lvec>(out) + acc[r][v] : acc[r][v];
      std::memcpy(out, &sum, sizeof sum);
    }
}

// R rows against NP panels over inputs [k0, k1): a chain of fused multiply-adds from zero, then added to the sums of
// the inputs before (y) or, at k0 = 0, written there
template <int R, int NP, typename W>
inline void panel_block(const float* __restrict x, int64_t k, const W* __restrict w, float* __restrict y,
                        int64_t outs, int64_t k0, int64_t k1, Ahead& ahead) {
  if constexpr (quantized<W>) {
    return panel_block_quant<R, NP>(x, k, w, y, outs, k0, k1, ahead);
  } else {
  lvec acc[R][NP * PV] = {};
  for (int64_t i = k0; i < k1; ++i) {
    ahead.step();
    lvec xb[R];
    for (int r = 0; r < R; ++r) xb[r] = splat<lvec>(x[r * k + i]);
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < PV; ++v) {
        const lvec wv = load<lvec>(w + p * PANEL * k + i * PANEL + v * VL);
        for (int r = 0; r < R; ++r) acc[r][p * PV + v] = fma(xb[r], wv, acc[r][p * PV + v]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP * PV; ++v) {
      float* out = y + r * outs + v * VL;
      const lvec sum = k0 ? load<lvec>(out) + acc[r][v] : acc[r][v];
      std::memcpy(out, &sum, sizeof sum);
    }
  }
}

// n rows (1..R) as one block
template <int R, int NP, typename W>
inline void rows_block(int64_t n, const float* x, int64_t k, const W* w, float* y, int64_t outs, int64_t k0,
                       int64_t k1, Ahead& ahead) {
  if constexpr (R > 0) {
    if (n == R) return panel_block<R, NP>(x, k, w, y, outs, k0, k1, ahead);
    rows_block<R - 1, NP>(n, x, k, w, y, outs, k0, k1, ahead);
  }
}

// Every row against NP panels, in blocks of as even a size as RB allows (8 rows: two of 4, not 6 and 2), inputs in
// passes of KC; meanwhile the next `lines` of weights from `next` come to L2 (only the first block of a pass reads
// its weights from memory: without it the memory sat idle while the others computed)
template <int NP, typename W>
inline void rows_against_panels(const float* x, const W* w, float* y, int64_t rows, int64_t outs, int64_t k,
                                const W* next, int64_t lines) {
  const int64_t blocks = (rows + RB - 1) / RB, steps = blocks * k;
  Ahead ahead{reinterpret_cast<const char*>(next), lines, (lines + steps - 1) / steps};
  for (int64_t k0 = 0; k0 < k; k0 += KC)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = rows * b / blocks, n = rows * (b + 1) / blocks - r;
      rows_block<RB, NP>(n, x + r * k, k, w, y + r * outs, outs, k0, std::min(k, k0 + KC), ahead);
    }
}

// Rows against NP quantized panels (a verify of at least two blocks of rows): each pass of KC inputs is widened once
// into float panels (in L1), then every block of rows runs the float32 panel_block over them, the float kernel's own
// sums over the dequantized values; the widening is paid once a pass, not once a block (3 rows on v3). Fewer rows
// widen in registers (panel_block_quant): the stores and reloads cost more than they save there
template <int NP, typename Q>
inline void rows_against_widened(const float* x, const Q* w, float* y, int64_t rows, int64_t outs, int64_t k) {
  thread_local std::vector<float> wide;  // panel p's input i at p * PANEL * k + i * PANEL: the float panels' order
  wide.resize(NP * PANEL * k);
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w);
  const int64_t blocks = (rows + RB - 1) / RB;
  Ahead none{nullptr, 0, 0};
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = std::min(k, k0 + KC);
    for (int p = 0; p < NP; ++p)
      for (int64_t i = k0; i < k1; i += 2)
        for (int v = 0; v < PV; ++v) {
          lvec w0, w1;
          widen2<Q>(base + p * panel_bytes<Q>(k), i, v, w0, w1);
          std::memcpy(&wide[p * PANEL * k + i * PANEL + v * VL], &w0, sizeof w0);
          std::memcpy(&wide[p * PANEL * k + (i + 1) * PANEL + v * VL], &w1, sizeof w1);
        }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = rows * b / blocks, n = rows * (b + 1) / blocks - r;
      rows_block<RB, NP>(n, x + r * k, k, static_cast<const float*>(wide.data()), y + r * outs, outs, k0, k1, none);
    }
  }
}

template <int NP, typename W>
inline void rows_against(const float* x, const W* w, float* y, int64_t rows, int64_t outs, int64_t k, const W* next,
                         int64_t lines) {
  if constexpr (quantized<W>)
    if (rows >= 2 * RB) return rows_against_widened<NP>(x, w, y, rows, outs, k);
  rows_against_panels<NP>(x, w, y, rows, outs, k, next, lines);
}

// x [rows, k] against w [outs, k] in panel order -> y [rows, outs]
template <typename W>
void linear(const float* x, const W* w, float* y, int64_t rows, int64_t outs, int64_t k) {
  const int64_t panels = outs / PANEL, rest = outs % PANEL;
  const int64_t group = rows == 1 ? NP1 : NPB;
  DFLASHKIT_PARALLEL_FOR(0, panels, group, [&](int64_t lo, int64_t hi) {
    int64_t p = lo;
    Ahead none{nullptr, 0, 0};
    if (rows == 1)  // one token: each weight read once, NP1 panels' chains in flight
      for (; p + NP1 <= hi; p += NP1) {
        // quantized panels are short streams (7 KB, q4_1 at 576 inputs): the next group's come to L2 meanwhile
        const int64_t lines = quantized<W> && p + 2 * NP1 <= hi ? NP1 * panel_bytes<W>(k) / 64 : 0;
        Ahead next{reinterpret_cast<const char*>(panel_at(w, p + NP1, k)), lines, (lines + k - 1) / k};
        for (int64_t k0 = 0; k0 < k; k0 += KC)
          panel_block<1, NP1>(x, k, panel_at(w, p, k), y + p * PANEL, outs, k0, std::min(k, k0 + KC), next);
      }
    else
      for (; p + NPB <= hi; p += NPB) {
        const int64_t lines = p + 2 * NPB <= hi ? NPB * panel_bytes<W>(k) / 64 : 0;
        rows_against<NPB>(x, panel_at(w, p, k), y + p * PANEL, rows, outs, k, panel_at(w, p + NPB, k), lines);
      }
    for (; p < hi; ++p) rows_against<1>(x, panel_at(w, p, k), y + p * PANEL, rows, outs, k, w, 0);
  });
  if constexpr (!quantized<W>) {  // (a quantized matrix has its outputs in 16s: the caller checks)
    const W* wr = w + panels * PANEL * k;  // the last outputs, [k][rest]: the same chain a lane runs, in scalars
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < rest; ++o) {
        float sum = 0.0f;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
          float acc = 0.0f;
          for (int64_t i = k0; i < std::min(k, k0 + KC); ++i) acc = __builtin_fmaf(x[r * k + i], to_float(wr[i * rest + o]), acc);
          sum = k0 ? sum + acc : acc;
        }
        y[r * outs + panels * PANEL + o] = sum;
      }
  }
}

// ---- integer dots: GGUF's quantized weights against activations quantized to 8 bits per block of 32 inputs, as
// llama.cpp quantizes its activations. Another model than the widened path above (a named choice: --weights
// <format>-int8), and why it pays: a multiply-add of bytes does four times the products of a float32 one, and sums
// of integers are exact in any order, so a row's result cannot depend on the rows, level or instruction that made it.
// A row's block of 32 inputs x: xd = max|x| / 127, xq = nearest(x * (127 / max|x|)) in -127..127 (quantize_rows,
// scalar code: every level rounds alike). Each (row, output) then runs, block by block in input order,
//   acc = fma(wd * xd, float(s), acc)   s = the block's integer dot (q4_0's nibbles less 8)
// and q4_1 next adds fma(wm, xd * float(sum of xq), acc): per lane the same operations at every vector width.
// Weights in int order (static.int_order): per panel of 16 outputs and block of 32 inputs, wd[16] (q4_1: then wm[16])
// in float32, then the quants: q8_0 [8 quads][16 outputs][4 inputs] (int8); q4_0, q4_1 [4 groups][16 outputs][4
// bytes], byte t of group g holding input 8g + t in its low nibble and input 8g + 4 + t in its high one.
struct Rows8 {  // activations quantized: xq [rows][k], and per row and block xd and xd * float(sum of xq)
  std::vector<int8_t> q;
  std::vector<float> d, m;
  std::vector<int32_t> s;  // the sum of xq (q4_0's offset)
};

inline void quantize_rows(const float* x, int64_t rows, int64_t k, Rows8& out) {
  const int64_t nb = k / 32;
  out.q.resize(rows * k), out.d.resize(rows * nb), out.m.resize(rows * nb), out.s.resize(rows * nb);
  for (int64_t b = 0; b < rows * nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>(std::clamp(std::nearbyint(xb[i] * inv), -127.0f, 127.0f));
      out.q[b * 32 + i] = static_cast<int8_t>(q);
      s += q;
    }
    out.d[b] = amax / 127.0f, out.s[b] = s, out.m[b] = out.d[b] * static_cast<float>(s);
  }
}

// 4 * VL bytes: VL lanes of four (one output's four inputs), and the products' sums within a lane
typedef uint8_t bvec __attribute__((vector_size(4 * VL)));

inline bvec load_bytes(const uint8_t* p) {
  bvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline bvec splat4(const int8_t* p) {  // four bytes in every lane
  uint32_t u;
  std::memcpy(&u, p, 4);
  typedef uint32_t u32xv __attribute__((vector_size(4 * VL)));
  return std::bit_cast<bvec>(u - u32xv{});
}

// The dots themselves (int8.h) at the level's own instructions, and on x86 once more with VNNI's vpdpbusd (four
// products summed into 32 bits in one instruction: AVX-512 VNNI at v4, AVX-VNNI at v3), compiled for those
// instructions alone and run only where the CPU has them (levels.vnni): the integer sums are exact, so the bits
// are the same either way
#define DFLASHKIT_VNNI 0
namespace level {  // (each variant in a namespace of its own: Rows8's namespace holds neither)
#include "int8.h"
}
using level::linear_int8;
#undef DFLASHKIT_VNNI
#if defined(__AVX512BW__)
#define DFLASHKIT_VNNI 512
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#elif defined(__AVX2__)
#define DFLASHKIT_VNNI 256
#pragma GCC push_options
#pragma GCC target("avxvnni")
#endif
#if defined(DFLASHKIT_VNNI)
namespace vnni {
#include "int8.h"
}
#pragma GCC pop_options
#endif

// ---- attention ------------------------------------------------------------------------------------------------
// One query row sees the cache slots 0..start-1, then the slots of its own path (its ancestors' and its own, in
// depth order): the keys plain decoding would see at that row's position, in the same order. Its scores, softmax
// and value sum are computed over that sequence alone, in a fixed order, and a key's value is added by the same
// fused multiply-add whether it is a committed slot or on the path, so a row of a chain or tree verify equals the
// one-token step at its position bit for bit, and only the slots in use are read.
#if defined(__AVX512F__)
constexpr int64_t VW = 16;
typedef f32x16 fvec;
typedef i32x16 ivec;
typedef u32x16 uvec;
#else
constexpr int64_t VW = 8;
typedef f32x8 fvec;
typedef i32x8 ivec;
typedef u32x8 uvec;
#endif

// e^x, x <= 0 (a score minus the row's maximum): 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (in two
// parts) and p the degree-6 Taylor polynomial in Horner form (relative error ~2e-7); every step named, so every
// lane and level computes the same
inline fvec expv(fvec x) {
  const fvec zero = {};
  const ivec lo = x < -87.0f;  // all ones where e^x is below float32's normal range
  x = lo ? zero - 87.0f : x;
  const fvec n = fma(x, splat<fvec>(1.44269504f), splat<fvec>(12582912.0f)) - 12582912.0f;  // round to nearest
  fvec r = fma(-n, splat<fvec>(0.693145752f), x);
  r = fma(-n, splat<fvec>(1.42860677e-6f), r);
  fvec p = splat<fvec>(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fma(p, r, splat<fvec>(c));
  const uvec bits = __builtin_convertvector(__builtin_convertvector(n, ivec) + 127, uvec) << 23;
  return lo ? zero : p * std::bit_cast<fvec>(bits);
}

// 16 lanes (held as 16 / VW vectors) halved four times, as finish() halves a dot
inline float sum16(const fvec (&t)[16 / VW]) {
#if defined(__AVX512F__)
  return halve(t[0]);
#else
  return halve8(t[0] + t[1]);
#endif
}

// VW keys' lane sums (a key's combined chains: dot() before its halvings) -> their VW scores, each halved as
// finish() halves one sum. With intrinsics the halvings of all the keys are done together, a shuffle and an add each
#if defined(__AVX512F__)
inline fvec halve_keys(const fvec (&sum)[VW]) {  // the lanes of two keys in one register, then four, eight, sixteen
  __m512 v[16], u[8], w[4], x[2];
  for (int t = 0; t < 16; ++t) v[t] = reinterpret_cast<__m512>(sum[t]);
  for (int p = 0; p < 8; ++p)  // lanes i + (i + 8): key 2p's eight in the low half, 2p + 1's in the high
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // lanes i + (i + 4): keys 4p .. 4p + 3, four lanes each
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // lanes 0 + 2 and 1 + 3 of each key
    x[p] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4m + l holds key 4l + m
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return reinterpret_cast<f32x16>(_mm512_permutexvar_ps(order, sums));
}
#elif defined(__AVX2__)
inline fvec halve_keys(const fvec (&sum)[VW]) {  // the lanes of two keys in one register, then four, eight
  __m256 v[8], u[4], x[2];
  for (int t = 0; t < 8; ++t) v[t] = reinterpret_cast<__m256>(sum[t]);
  for (int p = 0; p < 4; ++p)  // lanes i + (i + 4): key 2p's four in the low half, 2p + 1's in the high
    u[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  for (int p = 0; p < 2; ++p)  // lanes 0 + 2 and 1 + 3 of each key
    x[p] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4m + l holds key 2l + m
  return reinterpret_cast<f32x8>(_mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#else
inline fvec halve_keys(const fvec (&sum)[VW]) {  // the portable path: each key halved on its own, the same tree
  fvec out;
  for (int t = 0; t < VW; ++t) out[t] = halve(sum[t]);
  return out;
}
#endif

// VW keys' scores at once, each the sum dot() computes, bit for bit. head_dim a multiple of 64 (no tail)
inline fvec dots(const float* q, const float* const (&key)[VW], int64_t hd) {
  fvec sum[VW];
  for (int t = 0; t < VW; ++t) {
    lvec acc[CHAINS] = {};
    chains(q, key[t], hd, acc);
    sum[t] = combine(acc);
  }
  return halve_keys(sum);
}

// o_q = fma(s_q[j], v[j], o_q) for j in [from, to), in that order, for Q queries at once: their CH vectors each held
// in registers, each V vector loaded once for all Q
template <int Q, int CH>
inline void value_sums_of(const float* const* s, const float* v, int64_t hd, int64_t from, int64_t to,
                          float* const* o) {
  fvec acc[Q][CH];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < CH; ++c) acc[q][c] = load<fvec>(o[q] + VW * c);
  for (int64_t j = from; j < to; ++j)
    for (int c = 0; c < CH; ++c) {
      const fvec vj = load<fvec>(v + j * hd + VW * c);
      for (int q = 0; q < Q; ++q) acc[q][c] = fma(splat<fvec>(s[q][j]), vj, acc[q][c]);
    }
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < CH; ++c) std::memcpy(o[q] + VW * c, &acc[q][c], sizeof acc[q][c]);
}

// The value sums of n queries over keys [from, to): two at a time where two queries' sums fit in the registers
template <int CH>
inline void value_sums_by(const float* const* s, const float* v, int64_t hd, int64_t from, int64_t to,
                          float* const* o, int64_t n) {
  int64_t i = 0;
  if constexpr (4 * CH <= (VW == 16 ? 32 : 16))  // two queries' sums in half the registers (32 on AVX-512, 16 on AVX2)
    for (; i + 2 <= n; i += 2) value_sums_of<2, CH>(s + i, v, hd, from, to, o + i);
  for (; i < n; ++i) value_sums_of<1, CH>(s + i, v, hd, from, to, o + i);
}

inline void value_sums(const float* const* s, const float* v, int64_t hd, int64_t from, int64_t to,
                       float* const* o, int64_t n) {
  switch (hd / VW) {  // head_dim is a multiple of 16 up to 128
    case 1: return value_sums_by<1>(s, v, hd, from, to, o, n);
    case 2: return value_sums_by<2>(s, v, hd, from, to, o, n);
    case 3: return value_sums_by<3>(s, v, hd, from, to, o, n);
    case 4: return value_sums_by<4>(s, v, hd, from, to, o, n);
    case 5: return value_sums_by<5>(s, v, hd, from, to, o, n);
    case 6: return value_sums_by<6>(s, v, hd, from, to, o, n);
    case 7: return value_sums_by<7>(s, v, hd, from, to, o, n);
    case 8: return value_sums_by<8>(s, v, hd, from, to, o, n);
    case 10: return value_sums_by<10>(s, v, hd, from, to, o, n);
    case 12: return value_sums_by<12>(s, v, hd, from, to, o, n);
    case 14: return value_sums_by<14>(s, v, hd, from, to, o, n);
    case 16: return value_sums_by<16>(s, v, hd, from, to, o, n);
  }
}

constexpr int64_t TASK = 8;  // the most queries a task of attend holds

// One query of attend: its head's row, the cache slots of its own path after the committed ones, and its output
struct Query {
  const float* q;
  const int64_t* own;
  int64_t depth;
  float* out;
};

// A task's queries, all of one KV head (its group's query heads x rows). Each query's scores, softmax and value sum
// are the one-row computation (the same sums in the same order: keys in sequence order, the committed slots, then
// its path), but the committed keys run outer in blocks of 16 with every query inside, so each block of K and V
// comes from L2 once per task while every query reads it from L1.
inline void attend_queries(const Query* qs, int64_t nq, const float* k, const float* v, int64_t hd, int64_t first,
                           std::vector<float>& buf) {
  int64_t most = 0;
  for (int64_t i = 0; i < nq; ++i) most = std::max(most, qs[i].depth);
  const int64_t padded = (first + most + 15) / 16 * 16, chunks = hd / VW;
  buf.resize(nq * (padded + hd + 1));
  float *scores = buf.data(), *sums = scores + nq * padded, *norms = sums + nq * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t j = 0;
  if (hd % LANES == 0)
    for (; j + VW <= first; j += VW) {
      const float* key[VW];
      for (int t = 0; t < VW; ++t) key[t] = k + (j + t) * hd;
      for (int64_t i = 0; i < nq; ++i) {
        const fvec d = dots(qs[i].q, key, hd) * scale;
        std::memcpy(scores + i * padded + j, &d, sizeof d);
      }
    }
  for (int64_t i = 0; i < nq; ++i) {  // the rest of each query's scores, then its softmax
    const Query& Q = qs[i];
    float* s = scores + i * padded;
    const int64_t seen = first + Q.depth, end = (seen + 15) / 16 * 16;
    for (int64_t jj = j; jj < seen; ++jj) s[jj] = dot(Q.q, k + (jj < first ? jj : Q.own[jj - first]) * hd, hd) * scale;
    fvec tops = splat<fvec>(-INFINITY);  // the largest score (any order finds it): lane-wise, then across the lanes
    for (int64_t jj = 0; jj + VW <= seen; jj += VW) {
      const fvec x = load<fvec>(s + jj);
      tops = x > tops ? x : tops;
    }
    float top = -INFINITY;
    for (int l = 0; l < VW; ++l) top = std::max(top, tops[l]);
    for (int64_t jj = seen / VW * VW; jj < seen; ++jj) top = std::max(top, s[jj]);
    fvec total[16 / VW] = {};  // lane l sums the exponentials of positions 16i + l
    for (int64_t jj = 0; jj < end; jj += VW) {
      fvec e = expv(load<fvec>(s + jj) - top);
      for (int64_t t = std::max<int64_t>(0, seen - jj); t < VW; ++t) e[t] = 0.0f;  // past the sequence
      std::memcpy(s + jj, &e, sizeof e);
      total[(jj / VW) % (16 / VW)] += e;
    }
    norms[i] = sum16(total);
    std::fill(sums + i * hd, sums + (i + 1) * hd, 0.0f);
  }
  const float* rows_s[TASK];
  float* rows_o[TASK];
  for (int64_t i = 0; i < nq; ++i) rows_s[i] = scores + i * padded, rows_o[i] = sums + i * hd;
  for (int64_t jb = 0; jb < first; jb += 16) {  // the committed values, 16 at a time for every query
    const int64_t je = std::min(first, jb + 16);
    value_sums(rows_s, v, hd, jb, je, rows_o, nq);
  }
  for (int64_t i = 0; i < nq; ++i) {  // each query's own path (the same fused multiply-add), then the division
    const Query& Q = qs[i];
    const float* s = scores + i * padded;
    for (int64_t c = 0; c < chunks; ++c) {
      fvec acc = load<fvec>(sums + i * hd + VW * c);
      for (int64_t d = 0; d < Q.depth; ++d) acc = fma(splat<fvec>(s[first + d]), load<fvec>(v + Q.own[d] * hd + VW * c), acc);
      acc = acc / norms[i];
      std::memcpy(Q.out + VW * c, &acc, sizeof acc);
    }
  }
}

// q [heads, n, hd], k and v one cache [kv_heads, slots, hd] (float32), `first`: the committed slots every row sees,
// path [n, width]: each row's own slots after them, -1 past its depth -> out [heads, n, hd]. Inputs checked by the
// caller (native.cpp).
inline void attend(const float* q, const float* k, const float* v, float* out, int64_t heads, int64_t n, int64_t hd,
                   int64_t kvh, int64_t slots, int64_t first, const int64_t* path, int64_t width) {
  const int64_t group = heads / kvh, per_head = group * n;
  std::vector<Query> queries;  // by KV head: its group's query heads, each head's rows
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t* own = path + r * width;
      int64_t depth = 0;
      while (depth < width && own[depth] >= 0) ++depth;
      queries.push_back({q + (h * n + r) * hd, own, depth, out + (h * n + r) * hd});
    }
  // tasks of up to 8 queries of one KV head, at least two a thread where there are enough queries
  const int64_t size = std::clamp<int64_t>(heads * n / (2 * DFLASHKIT_THREADS()), 1, TASK);
  const int64_t per_kv = (per_head + size - 1) / size;
  DFLASHKIT_PARALLEL_FOR(0, kvh * per_kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t g = task / per_kv, from = (task % per_kv) * size, to = std::min(per_head, from + size);
      const int64_t off = g * slots * hd;
      attend_queries(queries.data() + g * per_head + from, to - from, k + off, v + off, hd, first, buf);
    }
  });
}

}  // namespace dflashkit_kernels
