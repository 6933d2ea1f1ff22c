extern "C" __global__ void __launch_bounds__(256) sage_fwd_sm80(ForwardParams p) {
    extern __shared__ __align__(128) unsigned char fwd_smem[];
    const int fwd_products = p.flags & (F_QK | F_PV);
    if (fwd_products == (F_QK | F_PV)) {
        require_dynamic_smem((u32)FAST_SMEM_BYTES);
        if (p.flags & F_SMOOTH_Q) forward_mma_fast<true>(p, fwd_smem);
        else forward_mma_fast<false>(p, fwd_smem);
    } else if (fwd_products == 0) {
        // Smoothing flags do not matter here: BF16 products take the unsmoothed inputs (§1).
        require_dynamic_smem((u32)BF16_SMEM_BYTES);
        forward_mma_bf16(p, fwd_smem);
    } else {
        require_dynamic_smem((u32)GATHER_SMEM_BYTES);
        forward_mma_gather(p, *(ForwardMmaShared*)fwd_smem);
    }
}
