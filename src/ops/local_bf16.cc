// The `local` level's bf16 products (ops/local.h): oneDNN's matmul primitive
// with bf16 operands and fp32 accumulation and output, what PyTorch's CPU
// autocast calls, summing in the library's own order (its kernel, blocking
// and threads decide it). The operands are rounded to bf16 here (ls::to_bf16,
// round to nearest even) into this thread's scratch, as autocast's casts do.
#include "ops/local.h"

#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#ifdef LOCKSTEP_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "common/parallel.h"
#include "contract.h"
#include "ops/bf16_store.h"
#include "ops/gemm_bf16.h"

namespace ls::ops::local {
namespace {

std::atomic<int64_t> bf16_calls{0};

}  // namespace

int64_t gemm_bf16_calls() { return bf16_calls.load(std::memory_order_relaxed); }

#ifdef LOCKSTEP_HAVE_DNNL
namespace {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A (rows x cols) in bf16, the strides oneDNN reads it with.
struct Bf16View {
  const uint16_t* p;
  memory::dims strides;
};

// Rounds m (rows x cols) into buf, keeping its orientation where one stride
// is 1 (the transposed operands of the weight and input gradients), so that
// the copy reads memory in order.
Bf16View round_operand(ConstMat m, int64_t rows, int64_t cols, std::vector<uint16_t>& buf) {
  buf.resize((size_t)(rows * cols));
  uint16_t* out = buf.data();
  if (m.rs == 1 && m.cs != 1) {  // column-major: copy each column whole
    for (int64_t c = 0; c < cols; ++c) to_bf16_n(m.p + c * m.cs, out + c * rows, rows);
    return {out, {1, rows}};
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (m.cs == 1) {
      to_bf16_n(m.p + r * m.rs, out + r * cols, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = ls::to_bf16(m.p[r * m.rs + c * m.cs]);
    }
  }
  return {out, {cols, 1}};
}

dnnl::matmul::primitive_desc matmul_for(const memory::desc& a, const memory::desc& b, const memory::desc& c,
                                        bool accumulate) {
  dnnl::primitive_attr attr;
  if (accumulate) {  // C += A·B
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
}

// A primitive's shape (-1: given at run time), layout and thread count.
struct Key {
  int64_t m, n, k, ldc;
  int layout, threads;  // layout: A column-major, B column-major, accumulate (bits 2, 1, 0)
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, ldc, layout, threads) < std::tie(o.m, o.n, o.k, o.ldc, o.layout, o.threads);
  }
};

// The primitive for this product. One made for its shape runs oneDNN's
// fastest kernel (brgemm, on AMX where the CPU has it) but is compiled for
// that shape, which costs more than a small product takes, and the experts'
// row counts change every step. So a product whose every dimension is a
// multiple of 32 (the model's own widths and token counts) gets its own
// primitive, and any other (an expert's rows) runs the layout's primitive
// with every dimension given at run time (oneDNN's gemm kernels, made once).
// The choice is a function of the shape alone, never of which thread saw it
// first, so a run's bits stay those of its thread count.
const dnnl::matmul& matmul_for_shape(const memory::desc& a, const memory::desc& b, const memory::desc& c,
                                     int64_t ldc, int layout) {
  thread_local std::map<Key, dnnl::matmul> made;
  if (made.size() > 4096) made.clear();  // bounded; oneDNN's own cache still holds the compiled kernels
  const int64_t m = a.dims()[0], k = a.dims()[1], n = b.dims()[1];
  const bool own = m % 32 == 0 && n % 32 == 0 && k % 32 == 0;
  const Key key = own ? Key{m, n, k, ldc, layout, omp_get_max_threads()}
                      : Key{-1, -1, -1, -1, layout, omp_get_max_threads()};
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  const bool accumulate = layout & 1;
  if (own) return made[key] = dnnl::matmul(matmul_for(a, b, c, accumulate));
  constexpr memory::dim rt = DNNL_RUNTIME_DIM_VAL;
  auto strides = [](bool cols) { return cols ? memory::dims{1, rt} : memory::dims{rt, 1}; };
  return made[key] = dnnl::matmul(matmul_for({{rt, rt}, memory::data_type::bf16, strides(layout & 4)},
                                             {{rt, rt}, memory::data_type::bf16, strides(layout & 2)},
                                             {{rt, rt}, memory::data_type::f32, strides(false)}, accumulate));
}

}  // namespace

bool have_gemm_bf16() { return true; }

std::string gemm_bf16_library() {
  const dnnl_version_t* v = dnnl_version();
  // The kernels oneDNN picks on this CPU: for a shape of multiples of 32 (1024 x 256 x 256), and for the
  // others (run-time dimensions).
  const memory::desc a({1024, 256}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc b({256, 256}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc c({1024, 256}, memory::data_type::f32, memory::format_tag::ab);
  constexpr memory::dim rt = DNNL_RUNTIME_DIM_VAL;
  const memory::desc any({rt, rt}, memory::data_type::bf16, memory::dims{rt, 1});
  const memory::desc any_c({rt, rt}, memory::data_type::f32, memory::dims{rt, 1});
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " bf16 matmul (" + matmul_for(a, b, c, false).impl_info_str() + "; other shapes " +
         matmul_for(any, any, any_c, false).impl_info_str() + ")";
}

void gemm_bf16(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
    return;
  }
  bf16_calls.fetch_add(1, std::memory_order_relaxed);
  thread_local std::vector<uint16_t> a_buf, b_buf;
  const Bf16View a = round_operand(A, M, K, a_buf), b = round_operand(B, K, N, b_buf);
  dnnl::engine& eng = cpu_engine();
  const memory::desc a_md({M, K}, memory::data_type::bf16, a.strides), b_md({K, N}, memory::data_type::bf16, b.strides);
  const memory::desc c_md({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
  // Inside the engine's own parallel work the library must stay on this
  // thread, as local::gemm's BLAS does (before the primitive is made: its
  // kernel is planned for the thread count).
  struct OneThread {  // restored however the call ends
    const int saved = omp_get_max_threads();
    const bool nested = in_pool_job() || omp_in_parallel();
    OneThread() { if (nested) omp_set_num_threads(1); }
    ~OneThread() { if (nested) omp_set_num_threads(saved); }
  } one_thread;
  const int layout = (a.strides[0] == 1 ? 4 : 0) + (b.strides[0] == 1 ? 2 : 0) + (accumulate ? 1 : 0);
  const dnnl::matmul& mm = matmul_for_shape(a_md, b_md, c_md, ldc, layout);
  thread_local dnnl::stream stream(eng);
  mm.execute(stream, {{DNNL_ARG_SRC, memory(a_md, eng, const_cast<uint16_t*>(a.p))},
                      {DNNL_ARG_WEIGHTS, memory(b_md, eng, const_cast<uint16_t*>(b.p))},
                      {DNNL_ARG_DST, memory(c_md, eng, C)}});
  stream.wait();
  internal::amx_tiles_clobbered();  // its AMX kernels leave the tiles released (the contract's reload them)
}

#else  // a build without oneDNN: execution_target refuses local at bf16 (have_gemm_bf16)

bool have_gemm_bf16() { return false; }
std::string gemm_bf16_library() { return ""; }
void gemm_bf16(int64_t, int64_t, int64_t, ConstMat, ConstMat, float*, int64_t, bool) {
  throw std::logic_error("local::gemm_bf16: this build has no oneDNN");
}

#endif

void weight_grad_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                      float* dW, bool accumulate) {
  // As weight_grad: A = X^T, a column-major view of X.
  gemm_bf16(in, out, rows, ConstMat{X, 1, ldx}, ConstMat{dY, ldy, 1}, dW, out, accumulate);
}

}  // namespace ls::ops::local
