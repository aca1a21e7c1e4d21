// The kernels of dflashkit/decode/kernels.h alone, without torch, on fixed inputs: built by tests/test_levels.py
// for every ISA level this machine runs, with Zen's tuning planted, and for aarch64 (run under qemu-user), so the
// builds' bits can be compared where the CPUs they stand for are absent.
// Writes every output's float32 bits to argv[1]; prints one line per exactness check: "NAME equal" or "NAME differs",
// and where this CPU runs the build's VNNI variant of the integer dots, one "vnni NAME same" (or "differs") per call.
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels.h"

namespace K = dflashkit_kernels;

static uint64_t state = 88172645463325252ull;

static float uniform() {  // xorshift64: the same numbers on every machine
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return static_cast<float>(static_cast<int64_t>(state >> 40) - (1 << 23)) / (1 << 23);
}

static std::vector<float> randoms(size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = uniform();
  return v;
}

// w [outs, k] in panel order (static.panel_order): each 16 outputs as [k][16], the rest as [k][rest]
template <typename W>
static std::vector<W> panels(const std::vector<float>& w, int64_t outs, int64_t k, W (*cast)(float)) {
  std::vector<W> out;
  const int64_t full = outs / 16 * 16;
  for (int64_t p = 0; p < full; p += 16)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t o = p; o < p + 16; ++o) out.push_back(cast(w[o * k + i]));
  for (int64_t i = 0; i < k; ++i)
    for (int64_t o = full; o < outs; ++o) out.push_back(cast(w[o * k + i]));
  return out;
}

static float as_float(float x) { return x; }
static K::bf16 as_bf16(float x) { return K::bf16{static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16)}; }
// a half from a random float's middle bits: every exponent but the all-ones one (subnormals and zeros included)
static K::f16 as_f16(float x) {
  const uint16_t h = static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 7);
  return K::f16{static_cast<uint16_t>((h & 0x7c00) == 0x7c00 ? h & 0xbfff : h)};
}

static std::vector<float> all;
static int differ = 0;

static void keep(const std::vector<float>& v) { all.insert(all.end(), v.begin(), v.end()); }

static void check(const char* name, const float* a, const float* b, int64_t n) {
  const bool same = std::memcmp(a, b, n * sizeof(float)) == 0;
  differ += !same;
  std::printf("%s %s\n", name, same ? "equal" : "differs");
}

template <typename W>
static void linears(W (*cast)(float), const char* name) {
  for (auto [k, outs] : {std::pair<int64_t, int64_t>{40, 37}, {200, 48}, {576, 200}}) {
    const int64_t rows = 7;
    const auto x = randoms(rows * k), w = panels(randoms(outs * k), outs, k, cast);
    std::vector<float> y(rows * outs), one(outs);
    K::linear(x.data(), w.data(), y.data(), rows, outs, k);
    keep(y);
    for (int64_t r = 0; r < rows; ++r) {  // a row of a call with many is that row alone
      K::linear(x.data() + r * k, w.data(), one.data(), 1, outs, k);
      char label[64];
      std::snprintf(label, sizeof label, "linear-%s-%lld-row%lld", name, static_cast<long long>(k), static_cast<long long>(r));
      check(label, one.data(), y.data() + r * outs, outs);
    }
  }
}

// A quantized matrix [outs, k] in linear_quant's order (static.quant_order) with random scales and quants, and its
// dequantized copy in panel order, each weight widened as GGUF's reference does (a multiply, for q4_1 then an add)
template <typename Q>
static void quantized(int64_t outs, int64_t k, std::vector<uint8_t>& packed, std::vector<float>& copy) {
  const int64_t nb = k / 32, scales = Q::SCALES;
  std::vector<float> dense(outs * k);
  for (int64_t p = 0; p < outs / 16; ++p)
    for (int64_t b = 0; b < nb; ++b) {
      float sc[2][16];  // d, m: multiples of 2^-12 below 1/16, as a half holds them
      for (int64_t s = 0; s < scales; ++s)
        for (auto& x : sc[s]) x = std::round(uniform() * 256) / 4096;
      const auto* bytes = reinterpret_cast<const uint8_t*>(sc);
      for (int64_t s = 0; s < scales; ++s) packed.insert(packed.end(), bytes + 64 * s, bytes + 64 * (s + 1));
      for (int64_t i = 0; i < Q::QUANTS; ++i) packed.push_back(static_cast<uint8_t>(uniform() * 128 + 128));
      const uint8_t* q = packed.data() + packed.size() - Q::QUANTS;
      for (int64_t j = 0; j < 32; ++j)
        for (int64_t o = 0; o < 16; ++o) {
          float w;
          if constexpr (std::is_same_v<Q, K::q8_0> || std::is_same_v<Q, K::q6_k>) {  // q6_k: a scale per 16
            w = static_cast<float>(static_cast<int8_t>(q[j * 16 + o])) * sc[std::is_same_v<Q, K::q6_k> && j >= 16][o];
          } else {
            const int nib = j % 2 ? q[j / 2 * 16 + o] >> 4 : q[j / 2 * 16 + o] & 15;
            w = std::is_same_v<Q, K::q4_0> ? sc[0][o] * static_cast<float>(nib - 8) : sc[0][o] * static_cast<float>(nib);
            if constexpr (std::is_same_v<Q, K::q4_1>) w = w + sc[1][o];
            if constexpr (std::is_same_v<Q, K::q5_0>)  // the second slot's bits: each output's fifth bits
              w = sc[0][o] * static_cast<float>((nib | static_cast<int>(std::bit_cast<uint32_t>(sc[1][o]) >> j & 1) << 4) - 16);
          }
          dense[(p * 16 + o) * k + b * 32 + j] = w;
        }
    }
  copy = panels(dense, outs, k, as_float);
}

// Each quantized format against the float32 kernel over its dequantized copy (bit for bit), and each row of a call
// with many against that row alone
template <typename Q>
static void quantized_linears(const char* name) {
  for (auto [k, outs] : {std::pair<int64_t, int64_t>{64, 48}, {576, 160}}) {
    const int64_t rows = 7;
    std::vector<uint8_t> packed;
    std::vector<float> copy;
    quantized<Q>(outs, k, packed, copy);
    const auto x = randoms(rows * k);
    std::vector<float> y(rows * outs), ref(rows * outs), one(outs);
    const auto* w = reinterpret_cast<const Q*>(packed.data());
    K::linear(x.data(), w, y.data(), rows, outs, k);
    K::linear(x.data(), copy.data(), ref.data(), rows, outs, k);
    keep(y);
    char label[64];
    std::snprintf(label, sizeof label, "linear-%s-%lld-dequantized", name, static_cast<long long>(k));
    check(label, y.data(), ref.data(), rows * outs);
    for (int64_t r = 0; r < rows; r += 3) {
      K::linear(x.data() + r * k, w, one.data(), 1, outs, k);
      std::snprintf(label, sizeof label, "linear-%s-%lld-row%lld", name, static_cast<long long>(k), static_cast<long long>(r));
      check(label, one.data(), y.data() + r * outs, outs);
    }
  }
}

// Integer dots (linear_int8) over random bytes in int order: every level (and aarch64) must give the same bits, since
// the sums are integers and each lane's float steps are named; and each row of a call is that row alone
template <typename Q>
static void integer_dots(const char* name) {
  for (auto [k, outs] : {std::pair<int64_t, int64_t>{64, 48}, {576, 160}}) {
    const int64_t rows = 11;
    std::vector<uint8_t> packed;
    for (int64_t p = 0; p < outs / 16 * (k / 32); ++p) {
      float sc[32];
      for (auto& x : sc) x = std::round(uniform() * 256) / 4096;
      const auto* bytes = reinterpret_cast<const uint8_t*>(sc);
      packed.insert(packed.end(), bytes, bytes + 64 * Q::SCALES);
      for (int64_t i = 0; i < Q::QUANTS; ++i) packed.push_back(static_cast<uint8_t>(uniform() * 128 + 128));
    }
    auto x = randoms(rows * k);
    for (int64_t i = 0; i < k; ++i) x[2 * k + i] *= 1000, x[4 * k + i] = 0;  // a large row and a zero one
    std::vector<float> y(rows * outs), one(outs);
    const auto* w = reinterpret_cast<const Q*>(packed.data());
    K::linear_int8(x.data(), w, y.data(), rows, outs, k);
    keep(y);
#if defined(DFLASHKIT_VNNI)
    if (DFLASHKIT_VNNI == 512 ? __builtin_cpu_supports("avx512vnni") : __builtin_cpu_supports("avxvnni")) {
      std::vector<float> v(rows * outs);
      K::vnni::linear_int8(x.data(), w, v.data(), rows, outs, k);
      const bool same = std::memcmp(v.data(), y.data(), y.size() * sizeof(float)) == 0;
      differ += !same;
      std::printf("vnni int8-%s-%lld %s\n", name, static_cast<long long>(k), same ? "same" : "differs");
    }
#endif
    for (int64_t r = 0; r < rows; r += 2) {
      K::linear_int8(x.data() + r * k, w, one.data(), 1, outs, k);
      char label[64];
      std::snprintf(label, sizeof label, "int8-%s-%lld-row%lld", name, static_cast<long long>(k), static_cast<long long>(r));
      check(label, one.data(), y.data() + r * outs, outs);
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  linears(as_float, "f32");
  linears(as_bf16, "bf16");
  linears(as_f16, "f16");
  quantized_linears<K::q8_0>("q8_0");
  quantized_linears<K::q4_0>("q4_0");
  quantized_linears<K::q4_1>("q4_1");
  quantized_linears<K::q6_k>("q6_k");
  quantized_linears<K::q5_0>("q5_0");
  integer_dots<K::q8_0>("q8_0");
  integer_dots<K::q4_0>("q4_0");
  integer_dots<K::q4_1>("q4_1");
  integer_dots<K::q6_k>("q6_k");
  integer_dots<K::q5_0>("q5_0");
  // attention: a verify of a 4-token chain at slots 20..23 against one-token steps at each position, where the
  // chain's earlier keys are committed slots; 6 query heads over 2 KV heads, head_dim 64 (batched scores) and 48
  for (int64_t hd : {64, 48}) {
    const int64_t heads = 6, kvh = 2, slots = 40, first = 20, n = 4;
    const auto q = randoms(heads * n * hd), k = randoms(kvh * slots * hd), v = randoms(kvh * slots * hd);
    std::vector<int64_t> path(n * n, -1);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d <= r; ++d) path[r * n + d] = first + d;
    std::vector<float> verify(heads * n * hd);
    K::attend(q.data(), k.data(), v.data(), verify.data(), heads, n, hd, kvh, slots, first, path.data(), n);
    keep(verify);
    for (int64_t r = 0; r < n; ++r) {
      std::vector<float> qr(heads * hd), step(heads * hd);
      for (int64_t h = 0; h < heads; ++h) std::memcpy(&qr[h * hd], &q[(h * n + r) * hd], hd * sizeof(float));
      const int64_t own = first + r;
      K::attend(qr.data(), k.data(), v.data(), step.data(), heads, 1, hd, kvh, slots, first + r, &own, 1);
      for (int64_t h = 0; h < heads; ++h) {
        char label[64];
        std::snprintf(label, sizeof label, "attend-%lld-row%lld-head%lld", static_cast<long long>(hd),
                      static_cast<long long>(r), static_cast<long long>(h));
        check(label, &step[h * hd], &verify[(h * n + r) * hd], hd);
      }
    }
  }
  FILE* f = std::fopen(argv[1], "wb");
  if (!f || std::fwrite(all.data(), sizeof(float), all.size(), f) != all.size() || std::fclose(f) != 0) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 2;
  }
  return differ ? 1 : 0;
}
