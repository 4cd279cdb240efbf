// In-place RoPE and logn scaling on the Q and K heads (the columns of a packed QKV buffer, or two
// separate tensors): the interface between the pure
// CUDA/HIP kernel (rope_logn.cu) and the torch binding (rope_logn_binding.cpp).
//
// This header names no CUDA or HIP type, so both files include it unchanged on either platform.
#pragma once

#include <cstdint>

namespace attn_backends {

// Rotated pairs per head the kernel serves (rotary_dim <= 512); larger heads use the torch path.
constexpr int kMaxRotaryHalf = 256;

enum class ScalarKind : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct RopeLognArgs {
  void* q;                    // row 0 of the Q heads: [rows, Hq * D], heads dense in a row
  int64_t q_row_stride;       // elements between Q rows; the last dim is dense
  void* k;                    // row 0 of the K heads: [rows, Hkv * D] (in a packed buffer, the
                              // columns after Q of the same rows)
  int64_t k_row_stride;       // elements between K rows
  int64_t tokens;             // valid rows; rows past this are padding and never touched
  const int32_t* cu_seqlens;  // [batch + 1] prefix sums on the device; rows at or past
                              // min(tokens, cu_seqlens[batch]) are never touched
  int32_t batch;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t rotary_dim;         // 0: no RoPE
  int32_t num_sms;            // multiprocessors, to size the grid; 0: ask the current device
  int32_t unroll;             // heads whose loads are issued together: 0 (default), 1, 2 or 4
  int32_t target_threads_per_sm;  // grid sizing target; 0: default (two waves)
  bool interleaved;           // false: pairs (i, i + r/2); true: pairs (2i, 2i + 1)
  bool use_logn;              // scale Q by max(1, ln(p + 1) / ln(base))
  float inv_log_logn_base;    // 1 / ln(base)
  ScalarKind dtype;
  // theta^(-2i / rotary_dim) in double, i < rotary_dim / 2: the same numbers the torch path
  // uses; angles are reduced in double so that long positions keep float32 accuracy.
  double inv_freq[kMaxRotaryHalf];
};

// Launches the kernel on `stream` (a cudaStream_t / hipStream_t). Returns nullptr on success,
// else a message naming what went wrong (a static string: do not free).
const char* launch_rope_logn(const RopeLognArgs& args, void* stream);

}  // namespace attn_backends
