// The CUDA kernels of kiln's CUDA backend, compiled at start-up with NVRTC (no headers: the
// 16-bit conversions are written out below). Activations are f32, row-major; weights bf16;
// the KV cache f16 or f32. Every kernel computes each output row from its own input row (and,
// for attention, its sequence's cache), so batching never changes a row's arithmetic.
//
// Launch shapes are stated above each kernel; the Rust side (`kernels.rs`) keeps to them.
// Row-wise kernels spread a row over a grid's y dimension (blocks of 256 elements) or over a
// block of up to 1024 threads, so that a short step (one token at batch 1) is not a chain of
// dependent loads in one thread; how a row is split depends only on its width, never on the
// batch.

typedef unsigned short bf16_t;
typedef unsigned short f16_t;
typedef unsigned int u32;

#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_t f32_to_f16(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum, or with `is_max` the max, over the block (blockDim.x a multiple of 32, at most
// 1024); every thread gets it.
__device__ __forceinline__ float block_reduce(float v, bool is_max) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        float s = lane < nw ? partial[lane] : (is_max ? -INFINITY : 0.0f);
        s = is_max ? warp_max(s) : warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float s = total;
    __syncthreads();
    return s;
}

__device__ float block_sum(float v) { return block_reduce(v, false); }

__device__ float block_max(float v) { return block_reduce(v, true); }

// grid (ceil(n / 256)), block 256: y[i] = bf16(x[i]).
extern "C" __global__ void cast_f32_bf16(const float* x, bf16_t* y, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(x[i]);
}

// grid (num_tokens, ceil(hidden / 256)), block 256: out[t] = bf16 table[ids[t]] * scale.
extern "C" __global__ void embed(const bf16_t* table, const u32* ids, float* out, int hidden,
                                 float scale) {
    int t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    const bf16_t* row = table + (unsigned long long)ids[t] * hidden;
    out[(unsigned long long)t * hidden + i] = bf16_to_f32(row[i]) * scale;
}

// grid (rows, ceil(n / 256)), block 256: out[r, i] += bias[i].
extern "C" __global__ void add_bias(float* out, const float* bias, int n) {
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < n) out[(unsigned long long)blockIdx.x * n + i] += bias[i];
}

// Elements of a row a norm's thread keeps in registers; rows longer than NORM_CACHE * blockDim
// read the rest twice.
#define NORM_CACHE 8

// grid (rows), block norm_threads(d) (a multiple of 32, at most 1024): out = rmsnorm(x) * w over
// rows of d (out may be x). Thread t takes elements t, t + blockDim, ...
extern "C" __global__ void __launch_bounds__(1024)
rms_norm(const float* x, const float* w, float* out, int d, float eps) {
    const float* xr = x + (unsigned long long)blockIdx.x * d;
    float* o = out + (unsigned long long)blockIdx.x * d;
    int n = blockDim.x;
    float v[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * n;
        v[c] = i < d ? xr[i] : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) ss += v[c] * v[c];
    for (int i = threadIdx.x + NORM_CACHE * n; i < d; i += n) ss += xr[i] * xr[i];
    float inv = rsqrtf(block_sum(ss) / d + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * n;
        if (i < d) o[i] = v[c] * inv * w[i];
    }
    for (int i = threadIdx.x + NORM_CACHE * n; i < d; i += n) o[i] = xr[i] * inv * w[i];
}

// grid (rows), block norm_threads(d): branch = rmsnorm(branch) * post (when post), x += branch,
// then out = rmsnorm(x) * next (when next). Rows of d; out is neither x nor branch.
extern "C" __global__ void __launch_bounds__(1024)
residual_norm(float* branch, const float* post, float* x, const float* next, float* out, int d,
              float eps) {
    unsigned long long base = (unsigned long long)blockIdx.x * d;
    float* br = branch + base;
    float* xr = x + base;
    int n = blockDim.x, rest = threadIdx.x + NORM_CACHE * n;
    float b[NORM_CACHE], xv[NORM_CACHE];
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * n;
        b[c] = i < d ? br[i] : 0.0f;
        xv[c] = i < d ? xr[i] : 0.0f;
    }
    if (post) {
        float ss = 0.0f;
#pragma unroll
        for (int c = 0; c < NORM_CACHE; c++) ss += b[c] * b[c];
        for (int i = rest; i < d; i += n) ss += br[i] * br[i];
        float inv_post = rsqrtf(block_sum(ss) / d + eps);
#pragma unroll
        for (int c = 0; c < NORM_CACHE; c++) {
            int i = threadIdx.x + c * n;
            if (i < d) {
                b[c] = b[c] * inv_post * post[i];
                br[i] = b[c];
            }
        }
        for (int i = rest; i < d; i += n) br[i] = br[i] * inv_post * post[i];
    }
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * n;
        xv[c] += b[c];
        if (i < d) xr[i] = xv[c];
        ss += xv[c] * xv[c];
    }
    for (int i = rest; i < d; i += n) {
        float v = xr[i] + br[i];
        xr[i] = v;
        ss += v * v;
    }
    if (next) {
        float inv = rsqrtf(block_sum(ss) / d + eps);
        float* o = out + base;
#pragma unroll
        for (int c = 0; c < NORM_CACHE; c++) {
            int i = threadIdx.x + c * n;
            if (i < d) o[i] = xv[c] * inv * next[i];
        }
        for (int i = rest; i < d; i += n) o[i] = xr[i] * inv * next[i];
    }
}

// grid (num_tokens), block 128: table[t] = [cos(p * f_i) for i < half, sin(p * f_i) ...].
extern "C" __global__ void rope_table(const u32* positions, const float* inv_freq,
                                      float* table, int half) {
    int t = blockIdx.x;
    float p = (float)positions[t];
    float* row = table + (unsigned long long)t * 2 * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = p * inv_freq[i];
        row[i] = cosf(a);
        row[half + i] = sinf(a);
    }
}

// grid (num_tokens, ceil(num_heads * half / 256)), block 256: rotates x[t, heads, head_dim] by
// table[t], a pair a thread (half pairs per head; interleaved pairs 2i, 2i+1, else i, i + half).
extern "C" __global__ void rope_apply(float* x, const float* table, int num_heads, int head_dim,
                                      int half, int interleaved) {
    int t = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= num_heads * half) return;
    const float* cs = table + (unsigned long long)t * 2 * half;
    int h = j / half, i = j % half;
    float* head = x + ((unsigned long long)t * num_heads + h) * head_dim;
    int ia = interleaved ? 2 * i : i;
    int ib = interleaved ? 2 * i + 1 : i + half;
    float a = head[ia], b = head[ib], c = cs[i], s = cs[half + i];
    head[ia] = a * c - b * s;
    head[ib] = b * c + a * s;
}

// grid (ceil(n / 256)), block 256: gate = act(gate) * up (act 0: SiLU, 1: GeLU tanh).
extern "C" __global__ void gated_act(float* gate, const float* up, unsigned long long n,
                                     int act) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    float a;
    if (act == 0) {
        a = g / (1.0f + expf(-g));
    } else {
        const float c = 0.7978845608028654f;  // sqrt(2 / pi)
        a = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    }
    gate[i] = a * up[i];
}

// grid (num_tokens, ceil(row / 256)), block 256: the cache rows at slots[t] take k[t], v[t]
// (row elements). Two kernels, f16 and f32 caches.
extern "C" __global__ void write_kv_f16(const float* k, const float* v, const u32* slots,
                                        f16_t* kc, f16_t* vc, int row) {
    int t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= row) return;
    unsigned long long dst = (unsigned long long)slots[t] * row + i;
    unsigned long long src = (unsigned long long)t * row + i;
    kc[dst] = f32_to_f16(k[src]);
    vc[dst] = f32_to_f16(v[src]);
}

extern "C" __global__ void write_kv_f32(const float* k, const float* v, const u32* slots,
                                        float* kc, float* vc, int row) {
    int t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= row) return;
    unsigned long long dst = (unsigned long long)slots[t] * row + i;
    unsigned long long src = (unsigned long long)t * row + i;
    kc[dst] = k[src];
    vc[dst] = v[src];
}

// grid (rows, ceil(width / 256)), block 256: dst[r] = src[rows[r]] over rows of width.
extern "C" __global__ void gather_rows(const float* src, const u32* rows, float* dst,
                                       int width) {
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= width) return;
    dst[(unsigned long long)blockIdx.x * width + i] =
        src[(unsigned long long)rows[blockIdx.x] * width + i];
}

// grid (ceil(n / 256)), block 256: x = cap * tanh(x / cap).
extern "C" __global__ void softcap(float* x, unsigned long long n, float cap) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

#define MAX_HEAD_DIM 256
#define PER_LANE (MAX_HEAD_DIM / 32)
#define DEC_WARPS 8
#define DEC_CHUNK (32 * DEC_WARPS)
#define DEC_MAX_SPLITS 64

__device__ __forceinline__ float load_kv(const void* cache, int f16, unsigned long long i) {
    return f16 ? f16_to_f32(((const f16_t*)cache)[i]) : ((const float*)cache)[i];
}

// Keys per split of a decode row that attends to `len` keys: whole chunks of DEC_CHUNK, as few
// as keep the row within DEC_MAX_SPLITS splits. A function of the row alone (`decode_split_keys`
// in kernels.rs is the same).
__device__ __forceinline__ int decode_split_keys(int len) {
    int per = DEC_CHUNK * DEC_MAX_SPLITS;
    return max(1, (len + per - 1) / per) * DEC_CHUNK;
}

// The dot product of q (in shared memory) with the cached key at `base`, in head order:
// 16-byte loads where the row allows them (f16 heads of a multiple of 8 elements, f32 of 4).
__device__ __forceinline__ float key_dot(const void* kc, int f16, unsigned long long base,
                                         const float* sq, int head_dim) {
    float dot = 0.0f;
    if (f16 && (head_dim & 7) == 0) {
        const uint4* k = (const uint4*)((const f16_t*)kc + base);
#pragma unroll 4
        for (int c = 0; c < head_dim / 8; c++) {
            uint4 u = k[c];
            u32 w[4] = {u.x, u.y, u.z, u.w};
            for (int i = 0; i < 4; i++) {
                dot += sq[8 * c + 2 * i] * f16_to_f32((f16_t)(w[i] & 0xffffu));
                dot += sq[8 * c + 2 * i + 1] * f16_to_f32((f16_t)(w[i] >> 16));
            }
        }
    } else if (!f16 && (head_dim & 3) == 0) {
        const float4* k = (const float4*)((const float*)kc + base);
#pragma unroll 4
        for (int c = 0; c < head_dim / 4; c++) {
            float4 u = k[c];
            dot += sq[4 * c] * u.x;
            dot += sq[4 * c + 1] * u.y;
            dot += sq[4 * c + 2] * u.z;
            dot += sq[4 * c + 3] * u.w;
        }
    } else {
        for (int d = 0; d < head_dim; d++) dot += sq[d] * load_kv(kc, f16, base + d);
    }
    return dot;
}

// Paged attention for decode rows, FlashDecoding-style: the keys of one query row are cut into
// splits (`decode_split_keys`), each split's partial softmax is computed by one block, and
// `attention_combine` merges the splits. Within a split the block takes chunks of DEC_CHUNK
// keys: thread t scores key t of the chunk (a whole dot product, so every key's loads are in
// flight at once), the block takes the chunk's max and sum, then warp w adds keys w, w + 8, ...
// of P·V, lane l holding head elements l, l + 32, ... The warps merge in a fixed order.
//
// grid (num_rows, num_heads, max_splits), block DEC_CHUNK; splits past a row's keys write
// m = -inf, l = 0. seqs: [num_seqs, 4] = (query_start, query_len, context_len,
// block_table_start); row_seq: [num_rows] the sequence of each query row.
// part_out: [num_rows, num_heads, max_splits, head_dim]; part_ml: [.., max_splits, 2].
extern "C" __global__ void __launch_bounds__(DEC_CHUNK) paged_attention(
    const float* q, const void* kc, const void* vc, int kv_f16, const u32* seqs,
    const u32* row_seq, const u32* block_tables, float* part_out, float* part_ml,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
    float softcap, int max_splits) {
    __shared__ float sq[MAX_HEAD_DIM];
    __shared__ float sp[DEC_CHUNK];                  // the chunk's weights exp(s - m)
    __shared__ unsigned long long sbase[DEC_CHUNK];  // each key's first cache element
    __shared__ float sacc[DEC_WARPS][MAX_HEAD_DIM];
    int row = blockIdx.x, h = blockIdx.y, split = blockIdx.z, t = threadIdx.x;
    int lane = t & 31, warp = t >> 5;
    const u32* seq = seqs + 4 * row_seq[row];
    int query_start = seq[0], query_len = seq[1], context_len = seq[2];
    const u32* table = block_tables + seq[3];
    int p = context_len - query_len + (row - query_start);
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int keys = decode_split_keys(p + 1 - lo);
    int split_lo = lo + split * keys;
    int split_hi = min(p + 1, split_lo + keys);
    unsigned long long part = ((unsigned long long)row * num_heads + h) * max_splits + split;
    if (split_lo >= split_hi) {  // the whole block leaves together
        if (t == 0) {
            part_ml[2 * part] = -INFINITY;
            part_ml[2 * part + 1] = 0.0f;
        }
        return;
    }
    int kvh = h / (num_heads / num_kv_heads);
    unsigned long long kv_row = (unsigned long long)num_kv_heads * head_dim;
    if (t < head_dim) sq[t] = q[((unsigned long long)row * num_heads + h) * head_dim + t];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[PER_LANE];
    for (int e = 0; e < PER_LANE; e++) acc[e] = 0.0f;
    for (int c0 = split_lo; c0 < split_hi; c0 += DEC_CHUNK) {
        int n = min(DEC_CHUNK, split_hi - c0);
        float s = -INFINITY;
        if (t < n) {
            int j = c0 + t;
            unsigned long long slot =
                (unsigned long long)table[j / block_size] * block_size + j % block_size;
            unsigned long long base = slot * kv_row + (unsigned long long)kvh * head_dim;
            sbase[t] = base;
            s = key_dot(kc, kv_f16, base, sq, head_dim) * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        }
        float m_new = fmaxf(m, block_max(s));
        float w = t < n ? expf(s - m_new) : 0.0f;
        sp[t] = w;
        float corr = expf(m - m_new);
        l = l * corr + block_sum(w);  // its barriers publish sp and sbase
        for (int e = 0; e < PER_LANE; e++) acc[e] *= corr;
#pragma unroll 4
        for (int k = warp; k < n; k += DEC_WARPS) {
            float pk = sp[k];
            unsigned long long base = sbase[k];
            for (int e = 0; e < PER_LANE; e++) {
                int d = lane + 32 * e;
                if (d < head_dim) acc[e] += pk * load_kv(vc, kv_f16, base + d);
            }
        }
        m = m_new;
        __syncthreads();  // the next chunk overwrites sp and sbase
    }
    for (int e = 0; e < PER_LANE; e++) {
        int d = lane + 32 * e;
        if (d < head_dim) sacc[warp][d] = acc[e];
    }
    __syncthreads();
    if (t < head_dim) {
        float o = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) o += sacc[w][t];
        part_out[part * head_dim + t] = o;
    }
    if (t == 0) {
        part_ml[2 * part] = m;
        part_ml[2 * part + 1] = l;
    }
}

// grid (num_rows, num_heads), block 32 * ceil(head_dim / 32): out[row, h] = the splits of
// `paged_attention` merged (splits past the row's keys hold m = -inf, l = 0).
extern "C" __global__ void attention_combine(const float* part_out, const float* part_ml,
                                             float* out, int num_heads, int head_dim,
                                             int max_splits) {
    int row = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    unsigned long long base = ((unsigned long long)row * num_heads + h) * max_splits;
    float mm = -INFINITY;
    for (int s = 0; s < max_splits; s++) mm = fmaxf(mm, part_ml[2 * (base + s)]);
    float ll = 0.0f, o = 0.0f;
    for (int s = 0; s < max_splits; s++) {
        float m = part_ml[2 * (base + s)];
        if (m == -INFINITY) continue;
        float c = expf(m - mm);
        ll += part_ml[2 * (base + s) + 1] * c;
        if (d < head_dim) o += part_out[(base + s) * head_dim + d] * c;
    }
    if (d < head_dim) out[((unsigned long long)row * num_heads + h) * head_dim + d] = o / ll;
}

#define TQ 16
#define TK 32
#define TILE_HEAD_DIM 128

// Paged attention for prefill, FlashAttention-style: a block takes a tile of up to TQ query rows
// of one sequence and one head, walks the keys in tiles of TK staged in shared memory (read
// once for all TQ rows), and keeps an online softmax per row. Lane j scores key j of the tile
// against a row (a dot product over the head, from shared memory), the warp takes the tile's
// max and sum, and each lane accumulates its head elements (lane, lane + 32, ...) of P·V.
//
// grid (num_tiles, num_heads), block 128 (4 warps, TQ / 4 rows each); head_dim ≤ TILE_HEAD_DIM.
// tiles: [num_tiles, 2] = (sequence, first query row); seqs and block tables as above.
extern "C" __global__ void attention_prefill(
    const float* q, const void* kc, const void* vc, int kv_f16, const u32* seqs,
    const u32* tiles, const u32* block_tables, float* out, int num_heads, int num_kv_heads,
    int head_dim, int block_size, float scale, int window, float softcap) {
    __shared__ float sq[TQ][TILE_HEAD_DIM];
    __shared__ float sk[TK][TILE_HEAD_DIM + 1];  // +1: lanes read rows, conflict-free
    __shared__ float sv[TK][TILE_HEAD_DIM];
    const int rows_per_warp = TQ / 4;
    int tile = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32* seq = seqs + 4 * tiles[2 * tile];
    int query_start = seq[0], query_len = seq[1], context_len = seq[2];
    const u32* table = block_tables + seq[3];
    int first = tiles[2 * tile + 1];
    int nrows = min(TQ, query_start + query_len - first);
    int kvh = h / (num_heads / num_kv_heads);
    unsigned long long kv_row = (unsigned long long)num_kv_heads * head_dim;
    int p0 = context_len - query_len + (first - query_start);
    for (int i = threadIdx.x; i < TQ * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i % head_dim;
        sq[r][d] = r < nrows ? q[((unsigned long long)(first + r) * num_heads + h) * head_dim + d]
                             : 0.0f;
    }
    float m[TQ / 4], l[TQ / 4], acc[TQ / 4][TILE_HEAD_DIM / 32];
    for (int rr = 0; rr < rows_per_warp; rr++) {
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
        for (int e = 0; e < TILE_HEAD_DIM / 32; e++) acc[rr][e] = 0.0f;
    }
    int p_last = p0 + nrows - 1;
    int lo = window > 0 ? max(0, p0 + 1 - window) : 0;
    for (int j0 = lo; j0 <= p_last; j0 += TK) {
        __syncthreads();
        for (int i = threadIdx.x; i < TK * head_dim; i += blockDim.x) {
            int kk = i / head_dim, d = i % head_dim, j = j0 + kk;
            float kv = 0.0f, vv = 0.0f;
            if (j <= p_last) {
                unsigned long long slot =
                    (unsigned long long)table[j / block_size] * block_size + j % block_size;
                unsigned long long at = slot * kv_row + (unsigned long long)kvh * head_dim + d;
                kv = load_kv(kc, kv_f16, at);
                vv = load_kv(vc, kv_f16, at);
            }
            sk[kk][d] = kv;
            sv[kk][d] = vv;
        }
        __syncthreads();
        for (int rr = 0; rr < rows_per_warp; rr++) {
            int r = warp * rows_per_warp + rr;
            if (r >= nrows) break;
            int p = p0 + r;
            int row_lo = window > 0 ? max(0, p + 1 - window) : 0;
            int j = j0 + lane;
            float s = -INFINITY;
            if (j >= row_lo && j <= p) {
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++) dot += sq[r][d] * sk[lane][d];
                s = dot * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            }
            float tile_max = warp_max(s);
            if (tile_max == -INFINITY) continue;
            float m_new = fmaxf(m[rr], tile_max);
            float corr = expf(m[rr] - m_new);
            float pj = s == -INFINITY ? 0.0f : expf(s - m_new);
            l[rr] = l[rr] * corr + warp_sum(pj);
            for (int e = 0; e < TILE_HEAD_DIM / 32; e++) acc[rr][e] *= corr;
            for (int kk = 0; kk < TK; kk++) {
                float pk = __shfl_sync(0xffffffffu, pj, kk);
                for (int e = 0; e < TILE_HEAD_DIM / 32; e++) {
                    int d = lane + 32 * e;
                    if (d < head_dim) acc[rr][e] += pk * sv[kk][d];
                }
            }
            m[rr] = m_new;
        }
    }
    for (int rr = 0; rr < rows_per_warp; rr++) {
        int r = warp * rows_per_warp + rr;
        if (r >= nrows) break;
        float* o = out + ((unsigned long long)(first + r) * num_heads + h) * head_dim;
        for (int e = 0; e < TILE_HEAD_DIM / 32; e++) {
            int d = lane + 32 * e;
            if (d < head_dim) o[d] = acc[rr][e] / l[rr];
        }
    }
}
