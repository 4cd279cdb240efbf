// Torch operators `attn_backends_native::rope_logn_` (the packed QKV buffer) and `rope_logn_qk_`
// (separate Q and K tensors): check the tensors, fill the launch arguments and run the kernel of
// rope_logn.cu on the current stream.
//
// Registered with TORCH_LIBRARY (no Python module): the schema marks `qkv` as mutated, and a
// no-op Meta kernel lets tracing (torch.compile, fake tensors) pass through it.
//
// Only c10 CUDA headers are used (not ATen/cuda/CUDAContext.h), so a toolkit without the
// cuBLAS/cuSPARSE headers still builds it.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "rope_logn.h"

namespace attn_backends {
namespace {

ScalarKind scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ScalarKind::kFloat32;
    case at::kHalf:
      return ScalarKind::kFloat16;
    case at::kBFloat16:
      return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "rope_logn_: qkv must be float32, float16 or bfloat16, got ",
                  t.scalar_type(), " (FP8 input goes through the torch path)");
  }
  return ScalarKind::kFloat32;  // not reached: TORCH_CHECK(false, ...) throws
}

// Checks of what both operators share (scalars, cu_seqlens), then the launch on q's device.
void launch_checked(const at::Tensor& q, int64_t q_row_stride, void* k_ptr, int64_t k_row_stride,
                    int64_t rows, const at::Tensor& cu_seqlens, int64_t tokens,
                    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t rotary_dim, bool interleaved, double theta, double logn_base,
                    int64_t unroll, int64_t target_threads_per_sm) {
  TORCH_CHECK(tokens >= 0 && tokens <= rows, "rope_logn_: tokens (", tokens,
              ") must be in [0, rows = ", rows, "]");
  TORCH_CHECK(cu_seqlens.device() == q.device(),
              "rope_logn_: cu_seqlens must be on the device of the rotated tensors");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 &&
                  cu_seqlens.is_contiguous() && cu_seqlens.numel() >= 2,
              "rope_logn_: cu_seqlens must be a contiguous 1-D int32 tensor of batch + 1 >= 2 "
              "entries");
  TORCH_CHECK(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim &&
                  rotary_dim / 2 <= kMaxRotaryHalf,
              "rope_logn_: rotary_dim must be even, <= head_dim and <= ", 2 * kMaxRotaryHalf,
              ", got ", rotary_dim);
  TORCH_CHECK(rotary_dim == 0 || (std::isfinite(theta) && theta > 1.0),
              "rope_logn_: theta must be a finite number > 1");
  TORCH_CHECK(logn_base == 0.0 || (std::isfinite(logn_base) && logn_base >= 2.0),
              "rope_logn_: logn_base must be 0 (off) or >= 2");
  TORCH_CHECK(unroll == 0 || unroll == 1 || unroll == 2 || unroll == 4,
              "rope_logn_: unroll must be 0 (default), 1, 2 or 4");
  TORCH_CHECK(target_threads_per_sm >= 0 && target_threads_per_sm <= (1 << 20),
              "rope_logn_: target_threads_per_sm must be in [0, 2^20]");
  if (tokens == 0 || (rotary_dim == 0 && logn_base == 0.0)) return;

  const c10::cuda::CUDAGuard guard(q.device());
  RopeLognArgs args{};
  args.q = q.data_ptr();
  args.q_row_stride = q_row_stride;
  args.k = k_ptr;
  args.k_row_stride = k_row_stride;
  args.tokens = tokens;
  args.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  args.batch = static_cast<int32_t>(cu_seqlens.numel() - 1);
  args.num_q_heads = static_cast<int32_t>(num_q_heads);
  args.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  args.head_dim = static_cast<int32_t>(head_dim);
  args.rotary_dim = static_cast<int32_t>(rotary_dim);
  args.num_sms = 0;  // the launcher asks the device
  args.unroll = static_cast<int32_t>(unroll);
  args.target_threads_per_sm = static_cast<int32_t>(target_threads_per_sm);
  args.interleaved = interleaved;
  args.use_logn = logn_base != 0.0;
  args.inv_log_logn_base = args.use_logn ? static_cast<float>(1.0 / std::log(logn_base)) : 0.0f;
  args.dtype = scalar_kind(q);
  // Same formula as the torch path (_rope.py): theta ** -(i * 2 / rotary_dim), in double.
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    args.inv_freq[i] = std::pow(theta, -(static_cast<double>(i) * 2.0 / rotary_dim));
  }
  const char* error =
      launch_rope_logn(args, static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(error == nullptr, "rope_logn_: kernel launch failed: ", error);
}

void check_heads(int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(num_q_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "rope_logn_: head counts and head_dim must be positive");
  TORCH_CHECK(num_q_heads + 2 * num_kv_heads <= INT32_MAX / head_dim,
              "rope_logn_: row width does not fit in 32 bits");
}

// A 2-D [rows, width] operand: dense columns, rows that do not overlap.
void check_rows(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.is_cuda(), "rope_logn_: ", name, " must be on a CUDA/ROCm device");
  TORCH_CHECK(t.dim() == 2, "rope_logn_: ", name, " must be 2-D [rows, heads * D], got ",
              t.dim(), "-D");
  TORCH_CHECK(t.size(1) == width, "rope_logn_: ", name, " has ", t.size(1),
              " columns, the heads need ", width);
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "rope_logn_: ", name,
              " columns must be dense (stride 1); rows may be strided");
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= width, "rope_logn_: ", name,
              " rows overlap (row stride ", t.stride(0), " < width ", width, ")");
}

void rope_logn_cuda(at::Tensor& qkv, const at::Tensor& cu_seqlens, int64_t tokens,
                    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t rotary_dim, bool interleaved, double theta, double logn_base,
                    int64_t unroll, int64_t target_threads_per_sm) {
  check_heads(num_q_heads, num_kv_heads, head_dim);
  check_rows(qkv, "qkv", (num_q_heads + 2 * num_kv_heads) * head_dim);
  const int64_t stride = qkv.size(0) > 1 ? qkv.stride(0) : qkv.size(1);
  // K heads are the columns after the Q heads, in the same rows.
  void* k = static_cast<char*>(qkv.data_ptr()) + num_q_heads * head_dim * qkv.element_size();
  launch_checked(qkv, stride, k, stride, qkv.size(0), cu_seqlens, tokens, num_q_heads,
                 num_kv_heads, head_dim, rotary_dim, interleaved, theta, logn_base, unroll,
                 target_threads_per_sm);
}

void rope_logn_qk_cuda(at::Tensor& q, at::Tensor& k, const at::Tensor& cu_seqlens,
                       int64_t tokens, int64_t num_q_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t rotary_dim, bool interleaved, double theta,
                       double logn_base, int64_t unroll, int64_t target_threads_per_sm) {
  check_heads(num_q_heads, num_kv_heads, head_dim);
  check_rows(q, "q", num_q_heads * head_dim);
  check_rows(k, "k", num_kv_heads * head_dim);
  TORCH_CHECK(k.device() == q.device(), "rope_logn_: q and k must be on one device");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rope_logn_: q and k must share a dtype");
  TORCH_CHECK(k.size(0) == q.size(0), "rope_logn_: q has ", q.size(0), " rows, k ", k.size(0));
  const int64_t q_stride = q.size(0) > 1 ? q.stride(0) : q.size(1);
  const int64_t k_stride = k.size(0) > 1 ? k.stride(0) : k.size(1);
  launch_checked(q, q_stride, k.data_ptr(), k_stride, q.size(0), cu_seqlens, tokens,
                 num_q_heads, num_kv_heads, head_dim, rotary_dim, interleaved, theta, logn_base,
                 unroll, target_threads_per_sm);
}

void rope_logn_meta(at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t,
                    bool, double, double, int64_t, int64_t) {}

void rope_logn_qk_meta(at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                       int64_t, int64_t, bool, double, double, int64_t, int64_t) {}

}  // namespace
}  // namespace attn_backends

TORCH_LIBRARY(attn_backends_native, m) {
  m.def(
      "rope_logn_(Tensor(a!) qkv, Tensor cu_seqlens, int tokens, int num_q_heads, "
      "int num_kv_heads, int head_dim, int rotary_dim, bool interleaved, float theta, "
      "float logn_base, int unroll=0, int target_threads_per_sm=0) -> ()");
  m.def(
      "rope_logn_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cu_seqlens, int tokens, "
      "int num_q_heads, int num_kv_heads, int head_dim, int rotary_dim, bool interleaved, "
      "float theta, float logn_base, int unroll=0, int target_threads_per_sm=0) -> ()");
}

TORCH_LIBRARY_IMPL(attn_backends_native, CUDA, m) {
  m.impl("rope_logn_", &attn_backends::rope_logn_cuda);
  m.impl("rope_logn_qk_", &attn_backends::rope_logn_qk_cuda);
}

TORCH_LIBRARY_IMPL(attn_backends_native, Meta, m) {
  m.impl("rope_logn_", &attn_backends::rope_logn_meta);
  m.impl("rope_logn_qk_", &attn_backends::rope_logn_qk_meta);
}
