// The integer dots of linear_int8, included by kernels.h inside its namespace: once at the level's own instructions
// (DFLASHKIT_VNNI 0), and on x86 once more in namespace vnni, compiled for VNNI (DFLASHKIT_VNNI 512: AVX-512 VNNI
// over 64 bytes; 256: AVX-VNNI over 32). Every sum here is of integers within bounds that cannot overflow, so each
// variant gives the same integers, and the float steps after them are the same named operations.

#if DFLASHKIT_VNNI
typedef i32xv pvec;  // vpdpbusd sums a lane's four products into its 32 bits at once
constexpr bool MADDUBS = false;
#elif defined(__AVX512BW__) || defined(__AVX2__)
typedef int16_t pvec __attribute__((vector_size(4 * VL)));  // sums of pairs (maddubs), exact for our bounds
constexpr bool MADDUBS = true;
#else
constexpr bool MADDUBS = false;
typedef i32xv pvec;  // the portable path sums each lane's four products at once, in int32
#endif

// acc plus the products of unsigned u and signed s: with maddubs by pairs in 16 bits (u at most 15 here and s at
// most 127 in size: at most 3810 a pair, so eight such sums add in 16 bits exactly; or u at most 128, once: 32512)
inline pvec add_pairs(pvec acc, bvec u, bvec s) {
#if DFLASHKIT_VNNI == 512
  return reinterpret_cast<pvec>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(u),
                                                    reinterpret_cast<__m512i>(s)));
#elif DFLASHKIT_VNNI == 256
  return reinterpret_cast<pvec>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(u),
                                                        reinterpret_cast<__m256i>(s)));
#elif defined(__AVX512BW__)
  return acc + reinterpret_cast<pvec>(_mm512_maddubs_epi16(reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)));
#elif defined(__AVX2__)
  return acc + reinterpret_cast<pvec>(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
#else
  const i32xv a = std::bit_cast<i32xv>(u), b = std::bit_cast<i32xv>(s);
  for (int t = 0; t < 4; ++t) acc += ((a >> (8 * t)) & 255) * ((b << (24 - 8 * t)) >> 24);
  return acc;
#endif
}

inline i32xv lanes(pvec p) {  // each lane's sum
#if DFLASHKIT_VNNI
  return p;
#elif defined(__AVX512BW__)
  return reinterpret_cast<i32xv>(_mm512_madd_epi16(reinterpret_cast<__m512i>(p), _mm512_set1_epi16(1)));
#elif defined(__AVX2__)
  return reinterpret_cast<i32xv>(_mm256_madd_epi16(reinterpret_cast<__m256i>(p), _mm256_set1_epi16(1)));
#else
  return p;
#endif
}

// acc plus each lane's dot of signed w and signed x (at most 127 in size): |w| times x with w's sign
inline i32xv add_signed(i32xv acc, bvec w, bvec x) {
#if defined(__AVX512BW__)
  const __m512i wi = reinterpret_cast<__m512i>(w), xi = reinterpret_cast<__m512i>(x);
  const __m512i sx = _mm512_mask_sub_epi8(xi, _mm512_movepi8_mask(wi), _mm512_setzero_si512(), xi);
  const bvec u = reinterpret_cast<bvec>(_mm512_abs_epi8(wi)), s = reinterpret_cast<bvec>(sx);
#elif defined(__AVX2__)
  const __m256i wi = reinterpret_cast<__m256i>(w), xi = reinterpret_cast<__m256i>(x);
  const bvec u = reinterpret_cast<bvec>(_mm256_abs_epi8(wi)), s = reinterpret_cast<bvec>(_mm256_sign_epi8(xi, wi));
#else
  const i32xv a = std::bit_cast<i32xv>(w), b = std::bit_cast<i32xv>(x);
  for (int t = 0; t < 4; ++t) acc += ((a << (24 - 8 * t)) >> 24) * ((b << (24 - 8 * t)) >> 24);
  return acc;
#endif
#if DFLASHKIT_VNNI
  return add_pairs(acc, u, s);
#elif defined(__AVX512BW__) || defined(__AVX2__)
  return acc + lanes(add_pairs(pvec{}, u, s));
#endif
}

// R rows' integer dots with one panel's block of 32 inputs: s[r][v] for the panel's vector v of outputs (q6_k: s
// over inputs 0-15, h over 16-31)
template <typename Q, int R>
inline void block_dots(const int8_t* xq, int64_t k, const uint8_t* q, i32xv (&s)[R][PV], i32xv (&h)[R][PV]) {
  if constexpr (bytes8<Q>) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < PV; ++v) s[r][v] = h[r][v] = i32xv{};
    for (int g = 0; g < 8; ++g) {
      bvec x[R];
      for (int r = 0; r < R; ++r) x[r] = splat4(xq + r * k + 4 * g);
      auto& sum = std::is_same_v<Q, q6_k> && g >= 4 ? h : s;
      for (int v = 0; v < PV; ++v) {
        const bvec w = load_bytes(q + g * 64 + v * 4 * VL);
        for (int r = 0; r < R; ++r) sum[r][v] = add_signed(sum[r][v], w, x[r]);
      }
    }
  } else {  // nibbles (q5_0: and a fifth bit, byte t of a lane's word holding input 8g + t's at bit 2g and input
    // 8g + 4 + t's at bit 2g + 1); with maddubs a 5-bit pair sum is at most 7874, so four add in 16 bits
    constexpr bool five = std::is_same_v<Q, q5_0>;
    constexpr int flush = five && MADDUBS ? 2 : 4;
    pvec p[R][PV] = {};
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < PV; ++v) s[r][v] = i32xv{};
    for (int g = 0; g < 4; ++g) {
      bvec xa[R], xb[R];  // the rows' inputs 8g..8g+3 and 8g+4..8g+7, in every lane
      for (int r = 0; r < R; ++r) xa[r] = splat4(xq + r * k + 8 * g), xb[r] = splat4(xq + r * k + 8 * g + 4);
      for (int v = 0; v < PV; ++v) {
        const bvec w = load_bytes(q + g * 64 + v * 4 * VL);
        bvec lo = w & 15, hi = w >> 4;
        if constexpr (five) {
          const bvec high = load_bytes(q - PANEL * 4 + v * 4 * VL);
          lo |= ((high >> (2 * g)) & 1) << 4, hi |= ((high >> (2 * g + 1)) & 1) << 4;
        }
        for (int r = 0; r < R; ++r) p[r][v] = add_pairs(add_pairs(p[r][v], lo, xa[r]), hi, xb[r]);
      }
      if ((g + 1) % flush == 0)
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < PV; ++v) s[r][v] += lanes(p[r][v]), p[r][v] = pvec{};
    }
  }
}

// R rows (from row r0) against one panel, every block in order -> y
template <typename Q, int R>
inline void int_panel(const Rows8& x, int64_t r0, int64_t k, const uint8_t* panel, float* y, int64_t outs) {
  const int64_t nb = k / 32;
  lvec acc[R][PV] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * BLOCK_BYTES<Q>;
    i32xv s[R][PV], h[R][PV];
    block_dots<Q, R>(x.q.data() + r0 * k + b * 32, k, blk + Q::SCALES * PANEL * 4, s, h);
    for (int v = 0; v < PV; ++v) {
      const lvec wd = load<lvec>(reinterpret_cast<const float*>(blk) + v * VL);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        if constexpr (std::is_same_v<Q, q4_0>) s[r][v] -= 8 * x.s[at];
        if constexpr (std::is_same_v<Q, q5_0>) s[r][v] -= 16 * x.s[at];
        acc[r][v] = fma(wd * splat<lvec>(x.d[at]), __builtin_convertvector(s[r][v], lvec), acc[r][v]);
        if constexpr (std::is_same_v<Q, q6_k>)
          acc[r][v] = fma(load<lvec>(reinterpret_cast<const float*>(blk) + PANEL + v * VL) * splat<lvec>(x.d[at]),
                          __builtin_convertvector(h[r][v], lvec), acc[r][v]);
        if constexpr (std::is_same_v<Q, q4_1>)
          acc[r][v] = fma(load<lvec>(reinterpret_cast<const float*>(blk) + PANEL + v * VL), splat<lvec>(x.m[at]),
                          acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < PV; ++v) std::memcpy(y + r * outs + v * VL, &acc[r][v], sizeof acc[r][v]);
}

#if defined(__AVX512F__)
constexpr int RI = 8;  // rows a call of int_panel: the accumulators of 8 rows (16 registers) and the weights fit
#else
constexpr int RI = 2;
#endif

template <typename Q, int R>
inline void int_rows(int64_t n, const Rows8& x, int64_t r0, int64_t k, const uint8_t* panel, float* y, int64_t outs) {
  if constexpr (R > 0) {
    if (n == R) return int_panel<Q, R>(x, r0, k, panel, y, outs);
    int_rows<Q, R - 1>(n, x, r0, k, panel, y, outs);
  }
}

// x [rows, k] (float32, quantized here) against w [outs, k] in int order -> y [rows, outs]
template <typename Q>
void linear_int8(const float* x, const Q* w, float* y, int64_t rows, int64_t outs, int64_t k) {
  thread_local Rows8 xq;
  quantize_rows(x, rows, k, xq);
  const Rows8& xs = xq;  // the threads below read the caller's (each thread has its own thread_local)
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w);
  const int64_t blocks = (rows + RI - 1) / RI;
  DFLASHKIT_PARALLEL_FOR(0, outs / PANEL, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t b = 0; b < blocks; ++b) {  // rows in blocks of as even a size as RI allows
        const int64_t r = rows * b / blocks, n = rows * (b + 1) / blocks - r;
        int_rows<Q, RI>(n, xs, r, k, base + p * panel_bytes<Q>(k), y + r * outs + p * PANEL, outs);
      }
  });
}
