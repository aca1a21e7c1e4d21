// The static decoder's CPU linear (dflashkit/decode/native.py): y[r, o] = sum_k x[r, k] * w[o, k], activations
// float32, weights in their own dtype (bfloat16 or float32), sums in float32.
//
// Why our own: at one row a decode step is a matrix-vector product that must stream every weight once at the
// memory's speed. inductor's fused reduction keeps one accumulator chain per output (latency-bound, about 60% of
// the bandwidth), and mm rounds the activations to bf16. Here each dot product keeps 64 independent lanes,
// combined in a fixed tree, so
//   - a row's result does not depend on how many rows share the call (row-invariant by construction: every
//     (r, o) runs the same code on the same operands in the same order), and
//   - a call with n rows reads each weight row from memory once (the other rows find it in L1).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

// GCC vector types: one register of 16 floats on AVX-512, two on AVX2, from the same source
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t LANES = 64;  // four vectors of 16: four independent chains of sums per dot

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float to_float(float v) { return v; }

inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The sum of a dot's four chains in a fixed tree: chains (0+2) + (1+3), then the 16 lanes halved four times; a
// k that is not a multiple of 64 first adds its last products to lanes 0.. of the chains in order
template <typename W>
inline float finish(f32x16 (&acc)[4], const float* x, const W* w, int64_t tail) {
  if (tail) {
    float lanes[LANES];
    std::memcpy(lanes, acc, sizeof lanes);
    for (int64_t j = 0; j < tail; ++j) lanes[j] += x[j] * to_float(w[j]);
    std::memcpy(acc, lanes, sizeof lanes);
  }
  f32x16 v = (acc[0] + acc[2]) + (acc[1] + acc[3]);
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// R rows of x against one row of w: each weight vector is loaded once for all R rows, and every row's sums run
// in the same order whatever R is (lane j of chain c sums x[i + 16c + j] * w[i + 16c + j] over i, then a fixed tree)
template <int R, typename W>
inline void dot_rows(const float* __restrict x, const W* __restrict w, int64_t k, float* __restrict y,
                     int64_t x_stride, int64_t y_stride) {
  f32x16 acc[R][4] = {};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES)
    for (int c = 0; c < 4; ++c) {
      const f32x16 wv = load16(w + i + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][c] += load16(x + r * x_stride + i + 16 * c) * wv;
    }
  for (int r = 0; r < R; ++r) y[r * y_stride] = finish(acc[r], x + r * x_stride + i, w + i, k - i);
}

template <typename W>
void linear_rows(const float* x, const W* w, float* y, int64_t rows, int64_t outs, int64_t k) {
  // outputs split between threads in blocks of 16 rows of w; the rows of x four at a time
  at::parallel_for(0, outs, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; ++o) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) dot_rows<4>(x + r * k, w + o * k, k, y + r * outs + o, k, outs);
      for (; r < rows; ++r) dot_rows<1>(x + r * k, w + o * k, k, y + r * outs + o, k, outs);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dflashkit::linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dflashkit::linear: w must be a contiguous [out, in] matrix");
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

}  // namespace

TORCH_LIBRARY(dflashkit, m) { m.def("linear(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(dflashkit, CPU, m) { m.impl("linear", &linear); }
