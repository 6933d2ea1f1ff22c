//! Host side of the Hopper tensor memory accelerator (TMA): tensor maps (`CUtensorMap`) encoded
//! with the driver's `cuTensorMapEncodeTiled`, passed to a kernel by value as a
//! `__grid_constant__` parameter (128 bytes, 64-byte aligned; `TmaMapParam` in forward.cu).

use crate::runtime::drv;
use cudarc::driver::sys;
use sagebwd::Result;

/// Element type of the mapped device buffer (I8: V̂ᵀ of the INT8 forward, Q̂, dÔᵀ, Q̂ᵀ of the d = 128
/// INT8 backward; U16: the BF16 Q, K, V of the fpa forward, dO of that backward; F32: the backward's FP32
/// dQ accumulator, added to by TMA reduces).
#[derive(Clone, Copy, Debug)]
pub(crate) enum TmaElem {
    I8,
    U16,
    F32,
}

impl TmaElem {
    fn bytes(self) -> u64 {
        match self {
            TmaElem::I8 => 1,
            TmaElem::U16 => 2,
            TmaElem::F32 => 4,
        }
    }
}

/// Shared-memory swizzle the TMA writes (the same XOR pattern as the wgmma descriptors' modes;
/// the box's innermost extent must be at most the swizzle span).
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)]
pub(crate) enum TmaSwizzle {
    None,
    B64,
    B128,
}

/// An encoded tensor map, as the kernel parameter receives it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(pub [u64; 16]);

/// A tiled map of a 2-D to 5-D tensor of `elem` at device address `addr`: `dims` element counts,
/// innermost first (dimension 0 contiguous); `strides` the byte distance between consecutive
/// indices of dimensions 1.. (multiples of 16); `boxes` the tile extent per dimension (≤ 256
/// each). Coordinates outside `dims` read as zero.
pub(crate) fn encode_tiled(
    elem: TmaElem,
    addr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    swizzle: TmaSwizzle,
) -> Result<TensorMap> {
    let rank = dims.len();
    assert!((2..=5).contains(&rank) && strides.len() == rank - 1 && boxes.len() == rank);
    let dtype = match elem {
        TmaElem::I8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        TmaElem::U16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        TmaElem::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    let swz = match swizzle {
        TmaSwizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        TmaSwizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        TmaSwizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let unit_steps = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            rank as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit_steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swz,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    drv("encode tensor map", r.result())?;
    let map = unsafe { map.assume_init() };
    Ok(TensorMap(map.opaque))
}

/// `groups`·16 contiguous rows of `row_elems` elements as the 5-D view {row_elems, e: 2,
/// b: 4, c: 2, a} of row 16a + 4b + 2c + e, boxes of {`box0`, 2, 4, 2, `box_groups`}: the box lands in shared memory in
/// the permuted row order of the INT8 kernels' tiles (row 16a + 8c + 2b + e holds row 16a + 4b + 2c + e: forward.cu
/// `permuted_row`), under `swizzle`. A box starting at group a0 reads rows 16·a0..; the rows of a tensor of several heads
/// are folded together, so a box may run into the next head's rows (zeros past the last row).
pub(crate) fn permuted_rows_map(
    elem: TmaElem,
    addr: u64,
    row_elems: u64,
    groups: u64,
    box0: u32,
    box_groups: u32,
    swizzle: TmaSwizzle,
) -> Result<TensorMap> {
    let row_bytes = row_elems * elem.bytes();
    encode_tiled(
        elem,
        addr,
        &[row_elems, 2, 4, 2, groups],
        &[row_bytes, 4 * row_bytes, 2 * row_bytes, 16 * row_bytes],
        &[box0, 2, 4, 2, box_groups],
        swizzle,
    )
}
