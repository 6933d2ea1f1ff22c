// AdamW over flat FP32 tensors (master weights, moments) that also refreshes the BF16 copy of the
// weights the products read, and the squared-norm partial sums for gradient clipping. Mirrors
// src/optim.rs.

// A contiguous piece of the flat parameter buffer with one weight decay: block b of `adamw` updates
// chunks[b]. Mirror of `AdamChunk` in src/gpu/kernels.rs.
struct AdamChunk {
    long start;
    int len;
    int decay;
};

// One element's update: g' = g · grad_scale (the clipping factor); m, v moments;
// p -= lr · (m̂ / (sqrt(v̂) + eps) + decay · p). Returns the new p; updates m and v in place.
struct AdamStep {
    float lr, beta1, beta2, eps, decay, bc1, bc2, grad_scale;
    __device__ __forceinline__ float operator()(float p, float g, float& m, float& v) const {
        const float gi = g * grad_scale;
        m = beta1 * m + (1.0f - beta1) * gi;
        v = beta2 * v + (1.0f - beta2) * gi * gi;
        const float update = (m / bc1) / (sqrtf(v / bc2) + eps);
        return p - lr * (update + decay * p);
    }
};

// One launch for every tensor (the chunks cover the flat buffers; a tensor's weight decay is wd or
// 0). A chunk whose start and length are multiples of 4 (all of them for dimensions that are) goes 4
// elements per thread with 16-byte accesses: ncu showed the one-element loop latency-bound (43 cycles
// per issued instruction, 3.3 TB/s of ~4.8) with only four 4-byte loads in flight per thread.
extern "C" __global__ void adamw(float* p, u16* p_bf16, const float* g, float* m, float* v, const AdamChunk* chunks,
                                 float lr, float beta1, float beta2, float eps, float wd, float bc1, float bc2,
                                 float grad_scale) {
    const AdamChunk c = chunks[blockIdx.x];
    const AdamStep step{lr, beta1, beta2, eps, c.decay ? wd : 0.0f, bc1, bc2, grad_scale};
    if (((c.start | (long)c.len) & 3) == 0) {
        for (long i = c.start + 4 * threadIdx.x; i < c.start + c.len; i += 4 * blockDim.x) {
            const float4 gi = *(const float4*)(g + i), pi = *(const float4*)(p + i);
            float4 mi = *(const float4*)(m + i), vi = *(const float4*)(v + i);
            const float4 po = make_float4(step(pi.x, gi.x, mi.x, vi.x), step(pi.y, gi.y, mi.y, vi.y),
                                          step(pi.z, gi.z, mi.z, vi.z), step(pi.w, gi.w, mi.w, vi.w));
            *(float4*)(m + i) = mi;
            *(float4*)(v + i) = vi;
            *(float4*)(p + i) = po;
            *(uint2*)(p_bf16 + i) = make_uint2(pack_bf16x2(po.x, po.y), pack_bf16x2(po.z, po.w));
        }
        return;
    }
    for (long i = c.start + threadIdx.x; i < c.start + c.len; i += blockDim.x) {
        float mi = m[i], vi = v[i];
        const float pi = step(p[i], g[i], mi, vi);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        p_bf16[i] = f32_to_bf16(pi);
    }
}

// partial[block] = Σ x² over a grid-stride share of x, in FP64 (the host adds the partials in order).
extern "C" __global__ void sum_squares(const float* x, long n, double* partial) {
    __shared__ double scratch[WARP];
    double acc = 0.0;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        acc += (double)x[i] * (double)x[i];
    for (int o = WARP / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < (int)(blockDim.x / WARP); w++) total += scratch[w];
        partial[blockIdx.x] = total;
    }
}

// Fills with a 32-bit pattern (NaN poison of buffers the step must overwrite, in checked runs).
extern "C" __global__ void fill_u32(u32* x, long n, u32 value) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] = value;
}
