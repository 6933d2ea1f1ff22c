//! cuBLASLt BF16 products for the training step, in row-major terms.
//!
//! Every product reads BF16 operands and accumulates in FP32 (`CUBLAS_COMPUTE_32F`); the output is
//! FP32 or BF16, optionally plus a matrix of the output's layout (`beta = 1`: accumulation in place, or a residual). cuBLASLt is column-major: a row-major
//! `[r, c]` matrix is its column-major transpose `[c, r]`, so each row-major product below is the
//! column-major product of the transposes with the operands swapped. The descriptors, layouts and
//! the heuristic's algorithm are built once per shape and cached (a heuristic query costs tens of
//! microseconds, a step issues hundreds of products).

use super::{Error, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::hash_map::{Entry, HashMap};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Element type of a product's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Out {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    trans_a: bool,
    trans_b: bool,
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldc: i64,
    out: Out,
    accumulate: bool,
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// The raw cuBLASLt handles are plain pointers owned by this module and only used under the mutex.
unsafe impl Send for Plan {}

pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    plans: Mutex<HashMap<Key, Plan>>,
}

unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

fn blas_err(what: &str, e: result::CublasError) -> Error {
    Error::Gpu(format!("cuBLASLt {what}: {e:?}"))
}

/// Hopper's recommended workspace (cuBLAS documentation: 32 MiB on sm_90).
const WORKSPACE_BYTES: usize = 32 << 20;

impl Blas {
    /// Errors (never panics) when libcublasLt.so.13 cannot be loaded.
    pub fn new(stream: Arc<CudaStream>) -> Result<Blas> {
        let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err(Error::Gpu(
                "cuBLASLt not found: libcublasLt.so.13 could not be loaded. Install the CUDA 13 toolkit (or the \
                 nvidia-cublas wheel) and add its lib directory to LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64)"
                    .into(),
            ));
        }
        let handle = result::create_handle().map_err(|e| blas_err("create handle", e))?;
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }.map_err(|e| super::cuda_err("workspace", e))?;
        Ok(Blas {
            handle,
            workspace,
            stream,
            plans: Mutex::new(HashMap::new()),
        })
    }

    fn plan(&self, key: Key) -> Result<Plan> {
        let ty = |out: Out| match out {
            Out::F32 => sys::cudaDataType_t::CUDA_R_32F,
            Out::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        };
        let e = |w: &'static str| move |err| blas_err(w, err);
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(e("matmul desc"))?;
        for (attr, on) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                key.trans_a,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                key.trans_b,
            ),
        ] {
            let op: i32 = on as i32; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
            unsafe { result::set_matmul_desc_attribute(desc, attr, &op as *const i32 as *const c_void, 4) }
                .map_err(e("transpose"))?;
        }
        let (ar, ac) = if key.trans_a { (key.k, key.m) } else { (key.m, key.k) };
        let (br, bc) = if key.trans_b { (key.n, key.k) } else { (key.k, key.n) };
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let a = result::create_matrix_layout(bf16, ar, ac, key.lda).map_err(e("layout A"))?;
        let b = result::create_matrix_layout(bf16, br, bc, key.ldb).map_err(e("layout B"))?;
        let c = result::create_matrix_layout(ty(key.out), key.m, key.n, key.ldc).map_err(e("layout C"))?;
        let pref = result::create_matmul_pref().map_err(e("preference"))?;
        let ws = WORKSPACE_BYTES;
        unsafe {
            result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(e("workspace preference"))?;
        }
        let heuristic = unsafe { result::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref) };
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        let heuristic = heuristic.map_err(|err| {
            blas_err(
                &format!("no algorithm for a {}×{}×{} product ({key:?})", key.m, key.n, key.k),
                err,
            )
        })?;
        Ok(Plan {
            desc,
            a,
            b,
            c,
            algo: heuristic.algo,
        })
    }

    /// Column-major `D[m×n] = op(A) · op(B) (+ add)`, A and B BF16; `add` is a matrix with D's layout
    /// (D itself to accumulate in place, or another one: a residual).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        d: u64,
        ldd: usize,
        out: Out,
        add: Option<u64>,
    ) -> Result<()> {
        let key = Key {
            trans_a,
            trans_b,
            m: m as u64,
            n: n as u64,
            k: k as u64,
            lda: lda as i64,
            ldb: ldb as i64,
            ldc: ldd as i64,
            out,
            accumulate: add.is_some(),
        };
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Gpu("cuBLASLt plan cache poisoned".into()))?;
        let p = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(self.plan(key)?),
        };
        let (alpha, beta) = (1.0f32, if add.is_some() { 1.0f32 } else { 0.0f32 });
        let c = add.unwrap_or(d); // not read when beta = 0
        let (ws, _guard) = self.workspace.device_ptr(&self.stream);
        unsafe {
            result::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a as *const c_void,
                p.a,
                b as *const c_void,
                p.b,
                c as *const c_void,
                p.c,
                d as *mut c_void,
                p.c,
                &p.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|err| blas_err(&format!("{m}×{n}×{k} product"), err))
    }

    /// `y[t, o] = Σ_i x[t, i] · w[o, i] (+ residual[t, o])` — a linear layer's forward: `x`
    /// `[rows, in]` BF16, `w` `[out, in]` BF16, `y` and `residual` `[rows, ld_y]` (first `out` columns).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        y: u64,
        ld_y: usize,
        x: u64,
        w: u64,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: Out,
        residual: Option<u64>,
    ) -> Result<()> {
        self.matmul(
            true, false, out_dim, rows, in_dim, w, in_dim, x, in_dim, y, ld_y, out, residual,
        )
    }

    /// `dx[t, i] = Σ_o dy[t, o] · w[o, i]` — the input gradient: `dy` `[rows, ld_dy]` BF16.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_dx(
        &self,
        dx: u64,
        dy: u64,
        ld_dy: usize,
        w: u64,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: Out,
    ) -> Result<()> {
        self.matmul(
            false, false, in_dim, rows, out_dim, w, in_dim, dy, ld_dy, dx, in_dim, out, None,
        )
    }

    /// `dw[o, i] += Σ_t dy[t, o] · x[t, i]` — the weight gradient, FP32, accumulated.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_dw(
        &self,
        dw: u64,
        dy: u64,
        ld_dy: usize,
        x: u64,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        self.matmul(
            false,
            true,
            in_dim,
            out_dim,
            rows,
            x,
            in_dim,
            dy,
            ld_dy,
            dw,
            in_dim,
            Out::F32,
            Some(dw),
        )
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            for (_, p) in plans.drain() {
                unsafe {
                    let _ = result::destroy_matrix_layout(p.a);
                    let _ = result::destroy_matrix_layout(p.b);
                    let _ = result::destroy_matrix_layout(p.c);
                    let _ = result::destroy_matmul_desc(p.desc);
                }
            }
        }
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}
