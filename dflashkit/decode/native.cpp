// The static decoder's CPU kernels (dflashkit/decode/native.py): the linear y[r, o] = sum_k x[r, k] * w[o, k]
// (activations float32, weights in their own dtype, bfloat16 or float32, sums in float32) and attention.
//
// Why our own: at one row a decode step is a matrix-vector product that must stream every weight once at the
// memory's speed. inductor's fused reduction keeps one accumulator chain per output (latency-bound, about 60% of
// the bandwidth), and mm rounds the activations to bf16. Here every (r, o) runs the same code on the same operands
// in the same order, so a row's result does not depend on how many rows share the call (row-invariant by
// construction), and a call with n rows reads each weight from memory once (the other rows find it in L1).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// GCC vector types: one register of 16 floats on AVX-512, two on AVX2, from the same source
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t LANES = 64;  // four vectors of 16: four independent chains of sums per dot

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bf16 is the top half of a float32: a vector of them widened is each 16-bit value zero-extended and shifted up.
// Written with intrinsics: GCC's generic 16-lane conversion split into 256-bit halves (five instructions where one
// does), and the bf16 linears streamed 16 against 18 GB/s (SmolLM2 bf16, one row, 2-core Xeon, side by side)
#if defined(__AVX512F__)
inline f32x16 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<f32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

inline float to_float(float v) { return v; }

inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A k that is not a multiple of 64: its last products go to lanes 0.. of the 64 (in memory order) before the tree
template <typename V, int N, typename W>
inline void add_tail(V (&acc)[N], const float* x, const W* w, int64_t tail) {
  static_assert(sizeof(acc) == LANES * sizeof(float), "a dot holds 64 lanes");
  float lanes[LANES];
  std::memcpy(lanes, acc, sizeof lanes);
  for (int64_t j = 0; j < tail; ++j) lanes[j] += x[j] * to_float(w[j]);
  std::memcpy(acc, lanes, sizeof lanes);
}

#if defined(__AVX512F__)
// ---- AVX-512: one register holds 16 lanes, so a dot keeps four chains of 16

// A dot's four chains in one register: chains (0+2) + (1+3)
inline f32x16 combine(const f32x16 (&acc)[4]) { return (acc[0] + acc[2]) + (acc[1] + acc[3]); }

// The sum of a dot's four chains in a fixed tree: combined, then the 16 lanes halved four times; a k that is not a
// multiple of 64 first adds its last products to lanes 0.. of the chains in order
template <typename W>
inline float finish(f32x16 (&acc)[4], const float* x, const W* w, int64_t tail) {
  if (tail) add_tail(acc, x, w, tail);
  const f32x16 v = combine(acc);
  f32x8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

typedef f32x16 lvec;
constexpr int CHAINS = 4, VL = 16;
inline lvec loadl(const float* p) { return load16(p); }
inline lvec loadl(const c10::BFloat16* p) { return load16(p); }

#else
// ---- AVX2 (and narrower): a register holds 8 lanes. Written with 16-lane vectors, GCC kept the accumulators on
// the stack (12 GB/s against 28 on AVX-512, SmolLM2 float32's linears, same machine). Here the same 64 lanes are
// eight chains of 8: chain b lane j is lane 8b + j of the 64, the memory order of the AVX-512 path's four chains
// of 16, and the tree below is that path's tree, so the two builds sum every dot in the same order.

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x8 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f32x8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The AVX-512 path's (chain 0 + chain 2) + (chain 1 + chain 3): its low eight lanes plus its high eight
inline f32x8 combine(const f32x8 (&acc)[8]) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

template <typename W>
inline float finish(f32x8 (&acc)[8], const float* x, const W* w, int64_t tail) {
  if (tail) add_tail(acc, x, w, tail);
  const f32x8 h8 = combine(acc);
  f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

typedef f32x8 lvec;
constexpr int CHAINS = 8, VL = 8;
inline lvec loadl(const float* p) { return load8(p); }
inline lvec loadl(const c10::BFloat16* p) { return load8(p); }

#endif

// A dot's chains over its first `full` inputs (a multiple of 64), interleaved: one pass over x and w
template <typename W>
inline void chains(const float* __restrict x, const W* __restrict w, int64_t full, lvec (&acc)[CHAINS]) {
  for (int64_t i = 0; i < full; i += LANES)
    for (int c = 0; c < CHAINS; ++c) acc[c] += loadl(x + i + VL * c) * loadl(w + i + VL * c);
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
// y[r, o] is one chain of fused multiply-adds over k in order, from zero: the same bits whatever rows and outputs
// share a call and whatever the vector width (a lane or a scalar fuses alike), so a verify row is the one-token
// step's and the AVX2 build equals the AVX-512 one. A weight vector loaded serves every row of a block and a row's
// x[k] every output of it (the dot per (row, output) it replaced loaded an x vector per product): SmolLM2's float32
// linears at 16 rows cost 1.65x one row where it took 1.76x, and one row on AVX2 0.84x its time (2-core Xeon,
// benchmarks/native_linear.py).
constexpr int64_t PANEL = 16, PV = PANEL / VL;  // outputs a panel, vectors a panel's row
constexpr int64_t KC = 128;  // inputs a pass: a block's panels stay in L1 while its rows run; each pass's sums from zero
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
    for (int64_t l = 0; l < each && left > 0; ++l, --left, line += 64) _mm_prefetch(line, _MM_HINT_T1);
  }
};

// R rows against NP panels over inputs [k0, k1): a chain of fused multiply-adds from zero, then added to the sums of
// the inputs before (y) or, at k0 = 0, written there
template <int R, int NP, typename W>
inline void panel_block(const float* __restrict x, int64_t k, const W* __restrict w, float* __restrict y,
                        int64_t outs, int64_t k0, int64_t k1, Ahead& ahead) {
  lvec acc[R][NP * PV] = {};
  for (int64_t i = k0; i < k1; ++i) {
    ahead.step();
    lvec xb[R];
    for (int r = 0; r < R; ++r) xb[r] = lvec{} + x[r * k + i];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < PV; ++v) {
        const lvec wv = loadl(w + p * PANEL * k + i * PANEL + v * VL);
        for (int r = 0; r < R; ++r) acc[r][p * PV + v] += xb[r] * wv;
      }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP * PV; ++v) {
      float* out = y + r * outs + v * VL;
      const lvec sum = k0 ? loadl(out) + acc[r][v] : acc[r][v];
      std::memcpy(out, &sum, sizeof sum);
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

template <typename W>
void linear_rows(const float* x, const W* w, float* y, int64_t rows, int64_t outs, int64_t k) {
  const int64_t panels = outs / PANEL, rest = outs % PANEL;
  const int64_t group = rows == 1 ? NP1 : NPB;
  at::parallel_for(0, panels, group, [&](int64_t lo, int64_t hi) {
    int64_t p = lo;
    Ahead none{nullptr, 0, 0};
    if (rows == 1)  // one token: each weight read once, NP1 panels' chains in flight
      for (; p + NP1 <= hi; p += NP1)
        for (int64_t k0 = 0; k0 < k; k0 += KC)
          panel_block<1, NP1>(x, k, w + p * PANEL * k, y + p * PANEL, outs, k0, std::min(k, k0 + KC), none);
    else
      for (; p + NPB <= hi; p += NPB) {
        const int64_t lines = p + 2 * NPB <= hi ? NPB * PANEL * k * static_cast<int64_t>(sizeof(W)) / 64 : 0;
        rows_against_panels<NPB>(x, w + p * PANEL * k, y + p * PANEL, rows, outs, k, w + (p + NPB) * PANEL * k, lines);
      }
    for (; p < hi; ++p) rows_against_panels<1>(x, w + p * PANEL * k, y + p * PANEL, rows, outs, k, w, 0);
  });
  const W* wr = w + panels * PANEL * k;  // the last outputs, [k][rest]: the same chain a lane runs, in scalars
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < rest; ++o) {
      float sum = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += KC) {
        float acc = 0.0f;
        for (int64_t i = k0; i < std::min(k, k0 + KC); ++i)  // fused by name: left to GCC, a Zen 4 build and the
          acc = __builtin_fmaf(x[r * k + i], to_float(wr[i * rest + o]), acc);  // AVX2 one rounded bf16 tails apart
        sum = k0 ? sum + acc : acc;
      }
      y[r * outs + panels * PANEL + o] = sum;
    }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dflashkit::linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dflashkit::linear: w must be a contiguous [out, in] matrix in "
              "panel order (static.panel_order)");
  TORCH_CHECK(x.size(-1) == w.size(1), "dflashkit::linear: x has ", x.size(-1), " inputs, w ", w.size(1));
  auto xc = x.contiguous();
  const int64_t k = w.size(1), outs = w.size(0), rows = xc.numel() / k;
  auto sizes = x.sizes().vec();
  sizes.back() = outs;
  auto y = at::empty(sizes, x.options());
  if (w.scalar_type() == at::kBFloat16)
    linear_rows(xc.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), rows, outs, k);
  else if (w.scalar_type() == at::kFloat)
    linear_rows(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, outs, k);
  else
    TORCH_CHECK(false, "dflashkit::linear: weights in ", w.scalar_type(), "; use bfloat16 or float32");
  return y;
}


// ---- attention ------------------------------------------------------------------------------------------------
// One query row sees the cache slots 0..start-1, then the slots of its own path (its ancestors' and its own, in
// depth order): the keys plain decoding would see at that row's position, in the same order. Its scores, softmax
// and value sum are computed over that sequence alone, in a fixed order, so a row of a chain or tree verify equals
// the one-token step at its position bit for bit, and only the slots in use are read.

// The attention's vectors are one register wide: 16 lanes on AVX-512, 8 on AVX2 (16-lane vectors there went
// through the stack, as the linear's did). Every lane runs the same operations either way, and the sums across
// lanes take the same tree, so both builds compute the same bits.
#if defined(__AVX512F__)
constexpr int64_t VW = 16;
typedef f32x16 fvec;
typedef i32x16 ivec;
typedef u32x16 uvec;
#else
constexpr int64_t VW = 8;
typedef f32x8 fvec;
typedef int32_t ivec __attribute__((vector_size(32)));
typedef u32x8 uvec;
#endif

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// e^x, x <= 0 (a score minus the row's maximum): 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 and p the
// degree-6 Taylor polynomial (relative error ~2e-7); the same operations on every lane
inline fvec expv(fvec x) {
  const fvec zero = {};
  const ivec lo = x < -87.0f;  // all ones where e^x is below float32's normal range
  x = lo ? zero - 87.0f : x;
  const fvec n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const fvec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  fvec p = zero + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uvec bits = __builtin_convertvector(__builtin_convertvector(n, ivec) + 127, uvec) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return lo ? zero : p * scale;
}

// 16 lanes (held as 16 / VW vectors) halved four times, as finish() does
inline float sum16(const fvec (&t)[16 / VW]) {
#if defined(__AVX512F__)
  const f32x16 v = t[0];
  f32x8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  f32x8 h8 = t[0] + t[1];
#endif
  f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// VW keys' lane sums, one register each (a key's combined chains: dot() before its halvings) -> their VW scores,
// each halved as finish() halves one sum: the halvings, a shuffle and an add each, done for all the keys together
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
#else
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

// o_q += s_q[j] * v[j] for j in [from, to), in that order, for Q queries at once: their CH vectors each held in
// registers, each V vector loaded once for all Q (a query's sum is CH chains of fused multiply-adds over j; one
// query's four chains at head_dim 64 waited on the multiply-add's latency)
template <int Q, int CH>
inline void value_sums_of(const float* const* s, const float* v, int64_t hd, int64_t from, int64_t to,
                          float* const* o) {
  fvec acc[Q][CH];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < CH; ++c) acc[q][c] = loadv(o[q] + VW * c);
  for (int64_t j = from; j < to; ++j)
    for (int c = 0; c < CH; ++c) {
      const fvec vj = loadv(v + j * hd + VW * c);
      for (int q = 0; q < Q; ++q) acc[q][c] += s[q][j] * vj;
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
    case 2: return value_sums_by<2>(s, v, hd, from, to, o, n);
    case 4: return value_sums_by<4>(s, v, hd, from, to, o, n);
    case 6: return value_sums_by<6>(s, v, hd, from, to, o, n);
    case 8: return value_sums_by<8>(s, v, hd, from, to, o, n);
    case 10: return value_sums_by<10>(s, v, hd, from, to, o, n);
    case 12: return value_sums_by<12>(s, v, hd, from, to, o, n);
    case 14: return value_sums_by<14>(s, v, hd, from, to, o, n);
    case 16: return value_sums_by<16>(s, v, hd, from, to, o, n);
    case 1: return value_sums_by<1>(s, v, hd, from, to, o, n);
    case 3: return value_sums_by<3>(s, v, hd, from, to, o, n);
    case 5: return value_sums_by<5>(s, v, hd, from, to, o, n);
    case 7: return value_sums_by<7>(s, v, hd, from, to, o, n);
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
// (4 KB at head_dim 64) comes from L2 once per task while every query reads it from L1, where a query at a time
// read the whole cache from L2 (a 16-row verify's attention cost 15x one row's; SmolLM2, 400 slots).
void attend_queries(const Query* qs, int64_t nq, const float* k, const float* v, int64_t hd, int64_t first,
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
    fvec tops = fvec{} - INFINITY;  // the largest score (any order finds it): lane-wise, then across the lanes
    for (int64_t jj = 0; jj + VW <= seen; jj += VW) {
      const fvec x = loadv(s + jj);
      tops = x > tops ? x : tops;
    }
    float top = -INFINITY;
    for (int l = 0; l < VW; ++l) top = std::max(top, tops[l]);
    for (int64_t jj = seen / VW * VW; jj < seen; ++jj) top = std::max(top, s[jj]);
    fvec total[16 / VW] = {};  // lane l sums the exponentials of positions 16i + l
    for (int64_t jj = 0; jj < end; jj += VW) {
      fvec e = expv(loadv(s + jj) - top);
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
  for (int64_t i = 0; i < nq; ++i) {  // each query's own path, then the division
    const Query& Q = qs[i];
    const float* s = scores + i * padded;
    for (int64_t c = 0; c < chunks; ++c) {
      fvec acc = loadv(sums + i * hd + VW * c);
      for (int64_t d = 0; d < Q.depth; ++d) acc += s[first + d] * loadv(v + Q.own[d] * hd + VW * c);
      acc = acc / norms[i];
      std::memcpy(Q.out + VW * c, &acc, sizeof acc);
    }
  }
}

// q [1, heads, n, hd], k and v the cache [1, kv_heads, slots, hd] (float32), start [1]: the committed slots every
// row sees, path [n, W]: each row's own slots after them, -1 past its depth -> [1, heads, n, hd]
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& start,
                  const at::Tensor& path) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == 1,
                "dflashkit::attend: q, k and v must be float32 [1, heads, rows, head_dim]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "dflashkit::attend: the cache must be contiguous");
  const int64_t heads = q.size(1), n = q.size(2), hd = q.size(3), kvh = k.size(1), slots = k.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= 128, "dflashkit::attend: head_dim ", hd, " is not a multiple of 16 up to 128");
  TORCH_CHECK(heads % kvh == 0 && k.size(3) == hd, "dflashkit::attend: q and the cache disagree on heads");
  TORCH_CHECK(path.scalar_type() == at::kLong && path.dim() == 2 && path.size(0) == n,
              "dflashkit::attend: path must be long [rows, W]");
  auto qc = q.contiguous();
  auto pc = path.contiguous();
  const int64_t first = start.item<int64_t>(), width = pc.size(1);
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * width; ++i)
    TORCH_CHECK(pp[i] < slots && (pp[i] >= 0 || i % width > 0), "dflashkit::attend: path slot ", pp[i],
                " outside the cache's ", slots);
  TORCH_CHECK(0 <= first && first <= slots, "dflashkit::attend: start ", first, " outside the cache");
  auto out = at::empty_like(qc);
  const float *qd = qc.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t group = heads / kvh, per_head = group * n;
  std::vector<Query> queries;  // by KV head: its group's query heads, each head's rows
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t* own = pp + r * width;
      int64_t depth = 0;
      while (depth < width && own[depth] >= 0) ++depth;
      queries.push_back({qd + (h * n + r) * hd, own, depth, od + (h * n + r) * hd});
    }
  // tasks of up to 8 queries of one KV head, at least two a thread where there are enough queries
  const int64_t size = std::clamp<int64_t>(heads * n / (2 * at::get_num_threads()), 1, TASK);
  const int64_t per_kv = (per_head + size - 1) / size;
  at::parallel_for(0, kvh * per_kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t g = task / per_kv, from = (task % per_kv) * size, to = std::min(per_head, from + size);
      const int64_t off = g * slots * hd;
      attend_queries(queries.data() + g * per_head + from, to - from, kd + off, vd + off, hd, first, buf);
    }
  });
  return out;
}

// ---- AMX tiles: bf16 weights on CPUs with amx_bf16 (linear_tiles) ----------------------------------------------
// A tile product multiplies bf16 by bf16 and sums in float32, 16 rows of x against 16 outputs at once, far more
// work a cycle than the dot above: a verify of 16 rows then costs about what one row does (the weights' reading).
// x is split into two bf16 parts (its mantissa's top 8 bits and the next 8: 16 significant bits, an error below
// 2^-14 of each input where bf16 alone leaves 2^-8), each product of a part and a weight is exact in float32, and
// both tile products are summed in float32: a third part (float32's last 8 bits) cost 10-20% of a step for digits
// far below the 1e-3 bench holds the step to against transformers' float32 forward. Every element of a tile product
// depends on its own row alone, so a row's result is the same whatever rows share the call.
// The weights are in tile order: [outs / 16][k / 32][16 pairs of k][16 outputs][2] (static.tile_order).

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_allowed() {  // the OS hands a process the tile registers' state only when asked (once)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// x's two bf16 parts, each [rows][k]: the top 16 bits of a float32 are a bf16 and leave an exact remainder
inline float top_half(float v) { return std::bit_cast<float>(std::bit_cast<uint32_t>(v) & 0xFFFF0000u); }

void split_rows(const float* x, int64_t rows, int64_t k, std::vector<uint16_t>& parts) {
  const int64_t n = rows * k;
  if (parts.size() < static_cast<size_t>(2 * n)) parts.resize(2 * n);
  uint16_t *top = parts.data(), *low = top + n;
  for (int64_t i = 0; i < n; ++i) {  // straight-line, so that it vectorizes
    const float h = top_half(x[i]);
    top[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(h) >> 16);
    low[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(x[i] - h) >> 16);
  }
}

// Two blocks of 16 outputs at a time share x's tiles; the weights' next tiles are prefetched 4 steps of k ahead
// (a tile load from memory waits on its lines: 5 -> 10 GB/s a core on a 2-core Sapphire Rapids VM)
constexpr int64_t AHEAD = 4;

template <int OB>
__attribute__((target("amx-tile,amx-bf16"))) inline void tiles_outputs(const uint16_t* xs, int64_t part,
                                                                      const c10::BFloat16* wb, int64_t k,
                                                                      float (*c)[16][16]) {
  _tile_zero(0);
  if (OB > 1) _tile_zero(1);
  const int64_t steps = k / 32;
  for (int64_t kb = 0; kb < steps; ++kb) {
    for (int ob = 0; ob < OB; ++ob)
      for (int line = 0; line < 16 && kb + AHEAD < steps; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wb + ob * 16 * k + (kb + AHEAD) * 512) + 64 * line, _MM_HINT_T0);
    const uint16_t* xa = xs + kb * 32;
    _tile_loadd(2, xa + part, k * 2);  // the low part first: the small terms are summed before the large
    _tile_loadd(3, xa, k * 2);
    _tile_loadd(4, wb + kb * 512, 64);
    if (OB > 1) _tile_loadd(5, wb + 16 * k + kb * 512, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (OB > 1) _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(0, 3, 4);
    if (OB > 1) _tile_dpbf16ps(1, 3, 5);
  }
  _tile_stored(0, c[0], 64);
  if (OB > 1) _tile_stored(1, c[1], 64);
}

// Rows in blocks of 16, a block's tiles configured to its own rows (one row of x is one row of work)
__attribute__((target("amx-tile,amx-bf16")))
void tiles_block(const uint16_t* parts, int64_t part, const c10::BFloat16* w, float* y, int64_t rows, int64_t outs,
                 int64_t k, int64_t lo, int64_t hi) {
  alignas(64) float c[2][16][16];
  for (int64_t b = 0; b * 16 < rows; ++b) {
    TileConfig cfg;  // tmm0-1 sums and 2-3 x's parts (the block's rows), 4-5 weights (16 pairs of k)
    const auto n = static_cast<uint8_t>(std::min<int64_t>(16, rows - b * 16));
    for (int t = 0; t < 6; ++t) cfg.rows[t] = t < 4 ? n : 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t ob = lo; ob < hi; ob += 2) {
      const int two = ob + 1 < hi;
      if (two)
        tiles_outputs<2>(parts + b * 16 * k, part, w + ob * 16 * k, k, c);
      else
        tiles_outputs<1>(parts + b * 16 * k, part, w + ob * 16 * k, k, c);
      for (int64_t r = b * 16; r < std::min(rows, b * 16 + 16); ++r)
        for (int j = 0; j <= two; ++j) std::memcpy(y + r * outs + (ob + j) * 16, c[j][r - b * 16], 64);
    }
  }
  _tile_release();
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dflashkit::linear_tiles: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "dflashkit::linear_tiles: w must be a contiguous bf16 [out, in] matrix in tile order");
  const int64_t k = w.size(1), outs = w.size(0);
  TORCH_CHECK(x.size(-1) == k, "dflashkit::linear_tiles: x has ", x.size(-1), " inputs, w ", k);
  TORCH_CHECK(k % 32 == 0 && outs % 16 == 0, "dflashkit::linear_tiles: w is ", outs, "x", k,
              "; tiles need outputs in 16s and inputs in 32s");
  TORCH_CHECK(tiles_allowed(), "dflashkit::linear_tiles: the OS refused the AMX tile state (arch_prctl)");
  auto xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  thread_local std::vector<uint16_t> parts;
  split_rows(xc.data_ptr<float>(), rows, k, parts);
  const uint16_t* pd = parts.data();  // the lambda's threads would each see their own thread_local
  auto sizes = x.sizes().vec();
  sizes.back() = outs;
  auto y = at::empty(sizes, x.options());
  const auto* wd = w.data_ptr<c10::BFloat16>();
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, outs / 16, 8, [&](int64_t lo, int64_t hi) {
    tiles_block(pd, rows * k, wd, yd, rows, outs, k, lo, hi);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dflashkit, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor w) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor start, Tensor path) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflashkit, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("attend", &attend);
}
