// The static decoder's kernels (kernels.h) as torch operators, plus the AMX tile linear (x86-64-v4 builds only).
// One library per ISA level (dflashkit/levels.py, decode/native.py), each registering its operators under a
// namespace of its own (DFLASHKIT_OPS, e.g. dflashkit_v3), so one process can load and compare several levels.
// Built with -ffp-contract=off: every fused multiply-add the bits rest on is written by name (kernels.h).
#include <torch/library.h>
#include <ATen/Parallel.h>

#define DFLASHKIT_PARALLEL_FOR(begin, end, grain, ...) at::parallel_for(begin, end, grain, __VA_ARGS__)
#define DFLASHKIT_THREADS() at::get_num_threads()
#include "kernels.h"

#if defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef DFLASHKIT_OPS
#error "build with -DDFLASHKIT_OPS=<namespace> (decode/native.py does)"
#endif

namespace {

namespace K = dflashkit_kernels;

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dflashkit::linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dflashkit::linear: w must be a contiguous [out, in] matrix in "
              "panel order (static.panel_order)");
  TORCH_CHECK(x.size(-1) == w.size(1), "dflashkit::linear: x has ", x.size(-1), " inputs, w ", w.size(1));
  auto xc = x.contiguous();
  const int64_t k = w.size(1), outs = w.size(0), rows = xc.numel() / k;
  auto sizes = x.sizes().vec();
  sizes.back() = outs;
  auto y = xc.new_empty(sizes);  // (new_empty: at::empty's header slows every build)
  if (w.scalar_type() == at::kBFloat16)
    K::linear(xc.data_ptr<float>(), reinterpret_cast<const K::bf16*>(w.data_ptr<c10::BFloat16>()),
              y.data_ptr<float>(), rows, outs, k);
  else if (w.scalar_type() == at::kFloat)
    K::linear(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, outs, k);
  else
    TORCH_CHECK(false, "dflashkit::linear: weights in ", w.scalar_type(), "; use bfloat16 or float32");
  return y;
}

// x against a matrix of `outs` outputs kept in a GGUF file's format (0 q8_0, 1 q4_0, 2 q4_1, 3 q6_k, 4 q5_0; and
// 16- or 32-bit floats: 5 f16, 6 bf16, 7 f32), packed into the bytes w by static.quant_order: the quantized ones for
// linear_quant (widened to float32) or with dots=True for linear_int8 and linear_vnni (integer dots); the floats in
// panel order, for linear_quant alone (they have no integer dots: the float kernel runs them)
enum class Dots { widened, int8, vnni };

template <Dots DOTS>
at::Tensor quantized(const char* name, const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t outs) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), name, ": w must be contiguous bytes");
  const int64_t k = x.size(-1);
  static constexpr int64_t block[] = {K::BLOCK_BYTES<K::q8_0>, K::BLOCK_BYTES<K::q4_0>, K::BLOCK_BYTES<K::q4_1>,
                                      K::BLOCK_BYTES<K::q6_k>, K::BLOCK_BYTES<K::q5_0>, 32 * 16 * 2, 32 * 16 * 2,
                                      32 * 16 * 4};
  TORCH_CHECK(0 <= format && format < 8, name, ": format ", format,
              " is not 0 (q8_0), 1 (q4_0), 2 (q4_1), 3 (q6_k), 4 (q5_0), 5 (f16), 6 (bf16) or 7 (f32)");
  TORCH_CHECK(DOTS == Dots::widened || format < 5, name, ": format ", format,
              " is a float one, with no integer dots; run it through linear_quant");
  TORCH_CHECK(k % 32 == 0 && outs % 16 == 0 && w.numel() == outs / 16 * (k / 32) * block[format], name, ": ",
              w.numel(), " bytes are not a packed ", outs, "x", k, " matrix");
  auto xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  auto sizes = x.sizes().vec();
  sizes.back() = outs;
  auto y = xc.new_empty(sizes);
  const float* xd = xc.data_ptr<float>();
  const uint8_t* wd = w.data_ptr<uint8_t>();
  float* yd = y.data_ptr<float>();
  auto run = [&](auto* q) {
    if constexpr (DOTS == Dots::int8)
      K::linear_int8(xd, q, yd, rows, outs, k);
#if defined(DFLASHKIT_VNNI)
    else if constexpr (DOTS == Dots::vnni)
      K::vnni::linear_int8(xd, q, yd, rows, outs, k);
#endif
    else
      K::linear(xd, q, yd, rows, outs, k);
  };
  if (format == 0) run(reinterpret_cast<const K::q8_0*>(wd));
  if (format == 1) run(reinterpret_cast<const K::q4_0*>(wd));
  if (format == 2) run(reinterpret_cast<const K::q4_1*>(wd));
  if (format == 3) run(reinterpret_cast<const K::q6_k*>(wd));
  if (format == 4) run(reinterpret_cast<const K::q5_0*>(wd));
  if constexpr (DOTS == Dots::widened) {
    if (format == 5) K::linear(xd, reinterpret_cast<const K::f16*>(wd), yd, rows, outs, k);
    if (format == 6) K::linear(xd, reinterpret_cast<const K::bf16*>(wd), yd, rows, outs, k);
    if (format == 7) K::linear(xd, reinterpret_cast<const float*>(wd), yd, rows, outs, k);
  }
  return y;
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t outs) {
  return quantized<Dots::widened>("dflashkit::linear_quant", x, w, format, outs);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t outs) {
  return quantized<Dots::int8>("dflashkit::linear_int8", x, w, format, outs);
}

// linear_int8 through vpdpbusd: the same bits; for a CPU with avx512_vnni (v4 builds) or avx_vnni (v3 builds)
at::Tensor linear_vnni(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t outs) {
#if defined(DFLASHKIT_VNNI)
  static const bool here = DFLASHKIT_VNNI == 512 ? __builtin_cpu_supports("avx512vnni")
                                                 : __builtin_cpu_supports("avxvnni");
  TORCH_CHECK(here, "dflashkit::linear_vnni: this CPU has no ", DFLASHKIT_VNNI == 512 ? "avx512_vnni" : "avx_vnni",
              "; use linear_int8 (the same bits)");
  return quantized<Dots::vnni>("dflashkit::linear_vnni", x, w, format, outs);
#else
  TORCH_CHECK(false, "dflashkit::linear_vnni: this build has no VNNI (x86-64 levels only); use linear_int8");
  return x;
#endif
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
  auto out = qc.new_empty(qc.sizes());
  K::attend(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), heads, n, hd, kvh,
            slots, first, pp, width);
  return out;
}

#if defined(__AVX512F__)
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
// (a tile load from memory waits on its lines: prefetching raises the bandwidth a core reads)
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
  auto y = xc.new_empty(sizes);
  const auto* wd = w.data_ptr<c10::BFloat16>();
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, outs / 16, 8, [&](int64_t lo, int64_t hi) {
    tiles_block(pd, rows * k, wd, yd, rows, outs, k, lo, hi);
  });
  return y;
}

#else
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(false, "dflashkit::linear_tiles: this build has no AMX tiles (they come with level v4 on a CPU with "
              "amx_bf16); use kernels='native'");
  return x;
}
#endif

}  // namespace

// TORCH_LIBRARY pastes its namespace into names: the macro's value must be expanded first
#define DFLASHKIT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define DFLASHKIT_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

DFLASHKIT_LIBRARY(DFLASHKIT_OPS, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor w) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor w, int format, int outs) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, int format, int outs) -> Tensor");
  m.def("linear_vnni(Tensor x, Tensor w, int format, int outs) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor start, Tensor path) -> Tensor");
}

DFLASHKIT_LIBRARY_IMPL(DFLASHKIT_OPS, m) {
  m.impl("linear", &linear);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("linear_quant", &linear_quant);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_vnni", &linear_vnni);
  m.impl("attend", &attend);
}
