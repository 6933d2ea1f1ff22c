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

// One launch for every tensor (the chunks cover the flat buffers; a tensor's weight decay is wd or
// 0). g' = g · grad_scale (the clipping factor); m, v moments; p -= lr · (m̂ / (sqrt(v̂) + eps) + wd · p).
extern "C" __global__ void adamw(float* p, u16* p_bf16, const float* g, float* m, float* v, const AdamChunk* chunks,
                                 float lr, float beta1, float beta2, float eps, float wd, float bc1, float bc2,
                                 float grad_scale) {
    const AdamChunk c = chunks[blockIdx.x];
    const float decay = c.decay ? wd : 0.0f;
    for (long i = c.start + threadIdx.x; i < c.start + c.len; i += blockDim.x) {
        const float gi = g[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float update = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        const float pi = p[i] - lr * (update + decay * p[i]);
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
