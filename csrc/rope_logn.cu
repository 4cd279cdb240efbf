// One pass over the Q and K heads of the valid rows (the columns of a packed QKV buffer, or two
// separate tensors with their own row strides): RoPE (rotate-half or interleaved, partial
// rotary_dim) on Q and K, logn scaling on Q, in place.
//
// Positions come from cu_seqlens (a binary search per token), so no positions tensor exists.
// V columns, padding rows and bytes outside the Q|K columns are never read or written.
//
// Work split. A head's rotated part is cut into "slots" of VEC elements (rotate-half: VEC pairs
// (i, i + r/2), i.e. one vector in each half; interleaved: one vector of VEC/2 adjacent pairs).
// When logn is on and the head is not fully rotated, Q heads also get "tail" slots that are only
// scaled. A thread owns one slot of one token and loops over a group of heads, so its angles
// (one sincos per pair, shared by every head) are computed once; loads for UNROLL heads are
// issued before any store to keep enough bytes in flight. Short batches split the heads into
// more groups so that the grid still fills the device.
//
// Portable CUDA only (no inline PTX, no warp intrinsics): torch's hipify turns this file into
// HIP unchanged.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "rope_logn.h"

namespace attn_backends {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kDefaultUnroll = 2;
constexpr int kDefaultThreadsPerSm = 4096;
constexpr double kInvPi = 0.3183098861837907;

struct Float32 {
  using Storage = float;
  static __device__ __forceinline__ float load(Storage x) { return x; }
  static __device__ __forceinline__ Storage store(float x) { return x; }
};

struct Float16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(Storage x) {
    return __half2float(__ushort_as_half(x));
  }
  static __device__ __forceinline__ Storage store(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

struct BFloat16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(Storage x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  // Round to nearest even; NaN stays a (quiet) NaN.
  static __device__ __forceinline__ Storage store(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<Storage>((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<Storage>(u >> 16);
  }
};

template <typename S, int N>
struct alignas(sizeof(S) * N) Pack {
  S v[N];
};

// ALIGNED: one vector access (the caller checked alignment); otherwise element by element, with
// at most `count` elements (the tail of an odd head_dim).
template <bool ALIGNED, typename S, int N>
__device__ __forceinline__ void load_pack(Pack<S, N>& out, const S* p, int count) {
  if constexpr (ALIGNED) {
    out = *reinterpret_cast<const Pack<S, N>*>(p);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) out.v[e] = p[e];
    }
  }
}

template <bool ALIGNED, typename S, int N>
__device__ __forceinline__ void store_pack(S* p, const Pack<S, N>& in, int count) {
  if constexpr (ALIGNED) {
    *reinterpret_cast<Pack<S, N>*>(p) = in;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < count) p[e] = in.v[e];
    }
  }
}

// How the launch splits the work; computed on the host (see make_shape).
struct Shape {
  int vec;               // elements per slot (VEC)
  int rot_slots;         // slots covering the rotated dims of one head
  int tail_slots;        // Q-only slots covering dims [rotary_dim, head_dim) when logn is on
  int active_heads;      // Hq + Hkv with RoPE, Hq for logn alone
  int slot_threads;      // threads per (token, head group); they stride over the slots
  int head_groups;
  int heads_per_group;
  int tokens_per_block;
};

template <typename Cvt, int VEC, int UNROLL, bool ALIGNED, bool INTERLEAVED>
__global__ void __launch_bounds__(kMaxThreads)
    rope_logn_kernel(const RopeLognArgs args, const Shape shape) {
  using S = typename Cvt::Storage;
  constexpr int kAngles = INTERLEAVED ? VEC / 2 : VEC;
  __shared__ double inv_freq[kMaxRotaryHalf];

  const int half = args.rotary_dim / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) inv_freq[i] = args.inv_freq[i];
  __syncthreads();

  const int lane = threadIdx.x % shape.slot_threads;
  const int rest = threadIdx.x / shape.slot_threads;
  const int group = rest % shape.head_groups;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * shape.tokens_per_block + rest / shape.head_groups;
  // The device-side total bounds the launch too: a CUDA graph launches over a bucket's rows,
  // and only cu_seqlens (updated in place per batch) knows how many of them are tokens.
  if (token >= args.tokens || token >= args.cu_seqlens[args.batch]) return;

  // The sequence holding `token`: cu[lo] <= token < cu[lo + 1] (empty sequences are skipped).
  int lo = 0;
  int hi = args.batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(args.cu_seqlens[mid]) <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t pos = token - args.cu_seqlens[lo];
  const float q_scale =
      args.use_logn
          ? fmaxf(1.0f, logf(static_cast<float>(pos) + 1.0f) * args.inv_log_logn_base)
          : 1.0f;

  S* const q_row = reinterpret_cast<S*>(args.q) + token * args.q_row_stride;
  S* const k_row = reinterpret_cast<S*>(args.k) + token * args.k_row_stride;
  const int head_dim = args.head_dim;
  const int num_q = args.num_q_heads;
  // Head h of the token: Q heads first, then K heads (each in its own rows).
  auto head_at = [&](int h) -> S* {
    return h < num_q ? q_row + h * head_dim : k_row + (h - num_q) * head_dim;
  };
  const int h_begin = group * shape.heads_per_group;
  const int h_end = min(shape.active_heads, h_begin + shape.heads_per_group);
  const int total_slots = shape.rot_slots + shape.tail_slots;

  for (int slot = lane; slot < total_slots; slot += shape.slot_threads) {
    if (slot < shape.rot_slots) {
      // Angles of this slot's pairs: the product and its reduction to [-pi, pi] in double, so
      // that long positions keep float32 accuracy, then sincospif (exact reduction, 1 ulp).
      float cos_a[kAngles];
      float sin_a[kAngles];
      const int first = INTERLEAVED ? slot * (VEC / 2) : slot * VEC;
#pragma unroll
      for (int a = 0; a < kAngles; ++a) {
        const double angle = static_cast<double>(pos) * inv_freq[first + a];
        const double half_turns = angle * kInvPi;
        const float t = static_cast<float>(half_turns - 2.0 * rint(0.5 * half_turns));
        sincospif(t, &sin_a[a], &cos_a[a]);
      }
      const int off1 = slot * VEC;
      const int off2 = INTERLEAVED ? off1 : off1 + half;
      for (int h0 = h_begin; h0 < h_end; h0 += UNROLL) {
        Pack<S, VEC> x1[UNROLL];
        Pack<S, VEC> x2[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (h0 + u < h_end) {
            const S* head = head_at(h0 + u);
            load_pack<ALIGNED>(x1[u], head + off1, VEC);
            if constexpr (!INTERLEAVED) load_pack<ALIGNED>(x2[u], head + off2, VEC);
          }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (h0 + u < h_end) {
            S* head = head_at(h0 + u);
            const float scale = (h0 + u < num_q) ? q_scale : 1.0f;
            Pack<S, VEC> y1;
            if constexpr (INTERLEAVED) {
#pragma unroll
              for (int e = 0; e < VEC; e += 2) {
                const float a = Cvt::load(x1[u].v[e]);
                const float b = Cvt::load(x1[u].v[e + 1]);
                const float c = cos_a[e / 2];
                const float s = sin_a[e / 2];
                y1.v[e] = Cvt::store((a * c - b * s) * scale);
                y1.v[e + 1] = Cvt::store((b * c + a * s) * scale);
              }
              store_pack<ALIGNED>(head + off1, y1, VEC);
            } else {
              Pack<S, VEC> y2;
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const float a = Cvt::load(x1[u].v[e]);
                const float b = Cvt::load(x2[u].v[e]);
                y1.v[e] = Cvt::store((a * cos_a[e] - b * sin_a[e]) * scale);
                y2.v[e] = Cvt::store((b * cos_a[e] + a * sin_a[e]) * scale);
              }
              store_pack<ALIGNED>(head + off1, y1, VEC);
              store_pack<ALIGNED>(head + off2, y2, VEC);
            }
          }
        }
      }
    } else if (q_scale != 1.0f) {
      // Unrotated dims of Q heads: logn only. A factor of exactly 1 leaves them as they are.
      const int off = args.rotary_dim + (slot - shape.rot_slots) * VEC;
      const int count = min(VEC, head_dim - off);
      const int q_end = min(h_end, num_q);
      for (int h0 = h_begin; h0 < q_end; h0 += UNROLL) {
        Pack<S, VEC> x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (h0 + u < q_end) load_pack<ALIGNED>(x[u], q_row + (h0 + u) * head_dim + off, count);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (h0 + u < q_end) {
            Pack<S, VEC> y;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              if (ALIGNED || e < count) y.v[e] = Cvt::store(Cvt::load(x[u].v[e]) * q_scale);
            }
            store_pack<ALIGNED>(q_row + (h0 + u) * head_dim + off, y, count);
          }
        }
      }
    }
  }
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

Shape make_shape(const RopeLognArgs& args, int vec) {
  Shape sh{};
  sh.vec = vec;
  const bool rope = args.rotary_dim > 0;
  const int half = args.rotary_dim / 2;
  sh.rot_slots = rope ? (args.interleaved ? args.rotary_dim / vec : half / vec) : 0;
  sh.tail_slots = args.use_logn ? ceil_div(args.head_dim - args.rotary_dim, vec) : 0;
  sh.active_heads = rope ? args.num_q_heads + args.num_kv_heads : args.num_q_heads;
  const int total_slots = sh.rot_slots + sh.tail_slots;
  sh.slot_threads = total_slots < kMaxThreads ? total_slots : kMaxThreads;
  // About two waves of threads on every multiprocessor; heads are split into groups only when
  // the tokens alone do not give that (short batches), since each group recomputes its angles.
  const int64_t per_sm =
      args.target_threads_per_sm > 0 ? args.target_threads_per_sm : kDefaultThreadsPerSm;
  const int64_t want = static_cast<int64_t>(args.num_sms > 0 ? args.num_sms : 1) * per_sm;
  const int64_t have = args.tokens * sh.slot_threads;
  int groups = have >= want ? 1 : ceil_div(want, have);
  const int max_groups = kMaxThreads / sh.slot_threads;
  if (groups > max_groups) groups = max_groups;
  if (groups > sh.active_heads) groups = sh.active_heads;
  if (groups < 1) groups = 1;
  sh.heads_per_group = ceil_div(sh.active_heads, groups);
  sh.head_groups = ceil_div(sh.active_heads, sh.heads_per_group);
  sh.tokens_per_block = kMaxThreads / (sh.slot_threads * sh.head_groups);
  return sh;
}

template <typename Cvt, int VEC, int UNROLL, bool ALIGNED, bool INTERLEAVED>
const char* launch_typed(const RopeLognArgs& args, cudaStream_t stream) {
  const Shape sh = make_shape(args, VEC);
  const int threads = sh.slot_threads * sh.head_groups * sh.tokens_per_block;
  const int64_t blocks = (args.tokens + sh.tokens_per_block - 1) / sh.tokens_per_block;
  if (blocks > 0x7fffffff) return "too many tokens for one launch";
  rope_logn_kernel<Cvt, VEC, UNROLL, ALIGNED, INTERLEAVED>
      <<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(args, sh);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename Cvt, int VEC, bool INTERLEAVED>
const char* launch_aligned(const RopeLognArgs& args, cudaStream_t stream) {
  switch (args.unroll > 0 ? args.unroll : kDefaultUnroll) {
    case 1:
      return launch_typed<Cvt, VEC, 1, true, INTERLEAVED>(args, stream);
    case 2:
      return launch_typed<Cvt, VEC, 2, true, INTERLEAVED>(args, stream);
    case 4:
      return launch_typed<Cvt, VEC, 4, true, INTERLEAVED>(args, stream);
  }
  return "unroll must be 0 (default), 1, 2 or 4";
}

// 16-byte vectors when both bases, both row strides and every slot boundary are 16-byte aligned;
// element accesses otherwise (any stride, any offset).
template <typename Cvt>
const char* launch_dtype(const RopeLognArgs& args, cudaStream_t stream) {
  using S = typename Cvt::Storage;
  constexpr int kVec = 16 / sizeof(S);
  const int half = args.rotary_dim / 2;
  const bool aligned = reinterpret_cast<uintptr_t>(args.q) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.k) % 16 == 0 &&
                       (args.q_row_stride * static_cast<int64_t>(sizeof(S))) % 16 == 0 &&
                       (args.k_row_stride * static_cast<int64_t>(sizeof(S))) % 16 == 0 &&
                       args.head_dim % kVec == 0 &&
                       (args.interleaved ? args.rotary_dim % kVec : half % kVec) == 0;
  if (args.interleaved) {
    return aligned ? launch_aligned<Cvt, kVec, true>(args, stream)
                   : launch_typed<Cvt, 2, kDefaultUnroll, false, true>(args, stream);
  }
  return aligned ? launch_aligned<Cvt, kVec, false>(args, stream)
                 : launch_typed<Cvt, 1, kDefaultUnroll, false, false>(args, stream);
}

// Multiprocessor count of the current device, asked once per device.
int current_sm_count() {
  constexpr int kMaxDevices = 64;
  static int counts[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < 0 || device >= kMaxDevices) return 0;
  if (counts[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 0;
    }
    counts[device] = n;
  }
  return counts[device];
}

}  // namespace

const char* launch_rope_logn(const RopeLognArgs& args_in, void* stream) {
  RopeLognArgs args = args_in;
  if (args.num_sms <= 0) args.num_sms = current_sm_count();
  if (args.tokens <= 0) return nullptr;
  if (args.rotary_dim == 0 && !args.use_logn) return nullptr;
  if (args.rotary_dim < 0 || args.rotary_dim % 2 != 0 || args.rotary_dim > args.head_dim ||
      args.rotary_dim / 2 > kMaxRotaryHalf) {
    return "rotary_dim must be even, <= head_dim and <= 2 * kMaxRotaryHalf";
  }
  if (args.batch < 1 || args.num_q_heads < 1 || args.num_kv_heads < 1 || args.head_dim < 1) {
    return "batch, head counts and head_dim must be positive";
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (args.dtype) {
    case ScalarKind::kFloat32:
      return launch_dtype<Float32>(args, s);
    case ScalarKind::kFloat16:
      return launch_dtype<Float16>(args, s);
    case ScalarKind::kBFloat16:
      return launch_dtype<BFloat16>(args, s);
  }
  return "unsupported dtype";
}

}  // namespace attn_backends
