//! cuBLASLt BF16 products for the training step, in row-major terms.
//!
//! Every product reads BF16 operands and accumulates in FP32 (`CUBLAS_COMPUTE_32F`); the output is
//! FP32 or BF16, optionally plus a matrix of the output's layout (`beta = 1`: accumulation in place, or a residual). cuBLASLt is column-major: a row-major
//! `[r, c]` matrix is its column-major transpose `[c, r]`, so each row-major product below is the
//! column-major product of the transposes with the operands swapped. The descriptors, layouts and
//! the heuristic's algorithm are built once per shape and cached (a heuristic query costs tens of
//! microseconds, a step issues hundreds of products).
//!
//! Algorithm choice: cuBLASLt's heuristic ranks candidates without running them, and its first pick
//! is not always the fastest for this step's shapes. Unless `SAGEBWD_GEMM_TUNE=0`, each new shape
//! times the heuristic's first [`CANDIDATES`] algorithms on the real operands once (a few
//! milliseconds per shape, inside the first step) and keeps the fastest. Different algorithms may
//! round differently (split-K, tile order), so the choices are kept in one process-wide
//! [`book`](export_algorithms) that every GPU of a data-parallel run shares and that checkpoints
//! carry: a resumed run computes its products with the algorithms of the run it continues. (The
//! GPU step is still not bit-reproducible from run to run: the attention backward adds dQ with
//! atomics in whatever order the blocks finish. The CPU path resumes bit for bit.)

use super::{Error, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use serde::{Deserialize, Serialize};
use std::collections::hash_map::{Entry, HashMap};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Element type of a product's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Out {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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

impl Plan {
    fn destroy(self) {
        unsafe {
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.c);
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

// The raw cuBLASLt handles are plain pointers owned by this module and only used under the mutex.
unsafe impl Send for Plan {}

pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    plans: Mutex<HashMap<Key, Plan>>,
    /// Set when a plan timed its candidates (and may have allocated scratch memory): see [`Blas::take_timed`].
    timed: AtomicBool,
}

/// Heuristic candidates timed per product shape.
pub const CANDIDATES: usize = 8;
/// Timed runs per candidate (after one untimed run).
const TIMED_RUNS: usize = 5;

/// The algorithm of each product shape, for the whole process (see the module's documentation).
fn book() -> &'static Mutex<BTreeMap<Key, [u64; 8]>> {
    static BOOK: OnceLock<Mutex<BTreeMap<Key, [u64; 8]>>> = OnceLock::new();
    BOOK.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn book_lock() -> Result<std::sync::MutexGuard<'static, BTreeMap<Key, [u64; 8]>>> {
    book().lock().map_err(|_| Error::Gpu("cuBLASLt algorithm book poisoned".into()))
}

#[derive(Serialize, Deserialize)]
struct Choice {
    product: Key,
    algorithm: [u64; 8],
}

/// The algorithms chosen so far, as JSON (a checkpoint's `gemm_algorithms`).
pub fn export_algorithms() -> Result<serde_json::Value> {
    let choices: Vec<Choice> = book_lock()?.iter().map(|(k, a)| Choice { product: *k, algorithm: *a }).collect();
    serde_json::to_value(choices).map_err(|e| Error::Gpu(format!("cuBLASLt algorithms: {e}")))
}

/// Makes the products of these shapes use these algorithms (a checkpoint's `gemm_algorithms`;
/// `null`, as in checkpoints of earlier versions, changes nothing). Plans built before keep theirs:
/// call it before the first step.
pub fn import_algorithms(v: &serde_json::Value) -> Result<()> {
    if v.is_null() {
        return Ok(());
    }
    let choices: Vec<Choice> = serde_json::from_value(v.clone()).map_err(|e| Error::Gpu(format!("checkpoint's cuBLASLt algorithms: {e}")))?;
    let mut book = book_lock()?;
    for c in choices {
        book.insert(c.product, c.algorithm);
    }
    Ok(())
}

/// Whether new shapes time their candidates (`SAGEBWD_GEMM_TUNE=0` or `off`: the heuristic's first pick).
fn tuning() -> bool {
    static TUNE: OnceLock<bool> = OnceLock::new();
    *TUNE.get_or_init(|| !matches!(std::env::var("SAGEBWD_GEMM_TUNE").as_deref(), Ok("0") | Ok("off")))
}

/// Device pointers of one product's operands: `c` is read when `beta = 1`, `d` written.
#[derive(Clone, Copy)]
struct Operands {
    a: u64,
    b: u64,
    c: u64,
    d: u64,
    beta: f32,
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
        Ok(Blas { handle, workspace, stream, plans: Mutex::new(HashMap::new()), timed: AtomicBool::new(false) })
    }

    /// True once after products timed their candidates: their scratch memory (see `time_candidates`)
    /// then counts in the memory pool's high-water mark, which a caller may want to reset.
    pub fn take_timed(&self) -> bool {
        self.timed.swap(false, Ordering::Relaxed)
    }

    /// Drops the plans built so far (the next product of each shape takes the book's algorithm).
    pub fn forget_plans(&self) -> Result<()> {
        let mut plans = self.plans.lock().map_err(|_| Error::Gpu("cuBLASLt plan cache poisoned".into()))?;
        for (_, p) in plans.drain() {
            p.destroy();
        }
        Ok(())
    }

    fn plan(&self, key: Key, ops: Operands) -> Result<Plan> {
        let ty = |out: Out| match out {
            Out::F32 => sys::cudaDataType_t::CUDA_R_32F,
            Out::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        };
        let e = |w: &'static str| move |err| blas_err(w, err);
        let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(e("matmul desc"))?;
        for (attr, on) in [
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, key.trans_a),
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, key.trans_b),
        ] {
            let op: i32 = on as i32; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
            unsafe { result::set_matmul_desc_attribute(desc, attr, &op as *const i32 as *const c_void, 4) }.map_err(e("transpose"))?;
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
        let mut found = [sys::cublasLtMatmulHeuristicResult_t { algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] }, workspaceSize: 0, state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS, wavesCount: 0.0, reserved: [0; 4] }; CANDIDATES];
        let mut count = 0i32;
        let status = unsafe { sys::cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, CANDIDATES as i32, found.as_mut_ptr(), &mut count) };
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        let found: Vec<sys::cublasLtMatmulAlgo_t> = found[..count.max(0) as usize]
            .iter()
            .filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= WORKSPACE_BYTES)
            .map(|h| h.algo)
            .collect();
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || found.is_empty() {
            return Err(Error::Gpu(format!("cuBLASLt: no algorithm for a {}×{}×{} product ({key:?}): {status:?}", key.m, key.n, key.k)));
        }
        let mut plan = Plan { desc, a, b, c, algo: found[0] };
        // Held until the choice is recorded: the GPUs of a data-parallel run meeting a new shape
        // together time it once, and all use that choice (the one a checkpoint records).
        let mut book = book_lock()?;
        if let Some(&data) = book.get(&key) {
            let algo = sys::cublasLtMatmulAlgo_t { data };
            if self.supports(&plan, &algo) {
                plan.algo = algo;
                return Ok(plan);
            }
            eprintln!(
                "warning: the recorded cuBLASLt algorithm of the {}×{}×{} product does not run with this cuBLASLt/GPU; choosing \
                 anew (a resumed run's products may round differently from the run it continues)",
                key.m, key.n, key.k
            );
        }
        if tuning() && found.len() > 1 {
            plan.algo = self.time_candidates(&plan, key, ops, &found)?;
        }
        book.insert(key, plan.algo.data);
        Ok(plan)
    }

    fn supports(&self, p: &Plan, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        let mut out = std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed();
        let status = unsafe { sys::cublasLtMatmulAlgoCheck(self.handle, p.desc, p.a, p.b, p.c, p.c, algo, out.as_mut_ptr()) };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && unsafe { out.assume_init() }.workspaceSize <= WORKSPACE_BYTES
    }

    /// The fastest of `found` on these operands (CUDA events, `TIMED_RUNS` runs each after one
    /// untimed run). The output is written: harmless when `beta = 0` or C is another buffer (the
    /// real product overwrites D next), but a product accumulating into D in place (`C = D`) would
    /// add up its own runs, so it is timed on a zeroed scratch copy of D's shape instead.
    fn time_candidates(&self, p: &Plan, key: Key, ops: Operands, found: &[sys::cublasLtMatmulAlgo_t]) -> Result<sys::cublasLtMatmulAlgo_t> {
        let cuda = |what: &'static str| move |e| super::cuda_err(what, e);
        let in_place = ops.beta != 0.0 && ops.c == ops.d;
        let bytes = key.ldc as usize * key.n as usize * if key.out == Out::F32 { 4 } else { 2 };
        let scratch = if in_place { Some(self.stream.alloc_zeros::<u8>(bytes).map_err(cuda("GEMM timing scratch"))?) } else { None };
        let ops = match &scratch {
            Some(buf) => {
                let (ptr, _guard) = buf.device_ptr(&self.stream);
                Operands { c: ptr, d: ptr, ..ops }
            }
            None => ops,
        };
        self.timed.store(true, Ordering::Relaxed);
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        for algo in found {
            if self.launch(p, algo, ops).is_err() {
                continue; // a candidate that does not launch is not a candidate
            }
            let start = self.stream.record_event(timing).map_err(cuda("event"))?;
            let mut ok = true;
            for _ in 0..TIMED_RUNS {
                ok &= self.launch(p, algo, ops).is_ok();
            }
            let end = self.stream.record_event(timing).map_err(cuda("event"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda("event timing"))?;
            if ok && best.is_none_or(|(t, _)| ms < t) {
                best = Some((ms, *algo));
            }
        }
        drop(scratch);
        Ok(best.map_or(found[0], |(_, algo)| algo))
    }

    fn launch(&self, p: &Plan, algo: &sys::cublasLtMatmulAlgo_t, ops: Operands) -> std::result::Result<(), result::CublasError> {
        let alpha = 1.0f32;
        let (ws, _guard) = self.workspace.device_ptr(&self.stream);
        unsafe {
            result::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &ops.beta as *const f32 as *const c_void,
                ops.a as *const c_void,
                p.a,
                ops.b as *const c_void,
                p.b,
                ops.c as *const c_void,
                p.c,
                ops.d as *mut c_void,
                p.c,
                algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
    }

    /// Column-major `D[m×n] = op(A) · op(B) (+ add)`, A and B BF16; `add` is a matrix with D's layout
    /// (D itself to accumulate in place, or another one: a residual).
    #[allow(clippy::too_many_arguments)]
    fn matmul(&self, trans_a: bool, trans_b: bool, m: usize, n: usize, k: usize, a: u64, lda: usize, b: u64, ldb: usize, d: u64, ldd: usize, out: Out, add: Option<u64>) -> Result<()> {
        let key = Key { trans_a, trans_b, m: m as u64, n: n as u64, k: k as u64, lda: lda as i64, ldb: ldb as i64, ldc: ldd as i64, out, accumulate: add.is_some() };
        // Not read when beta = 0.
        let ops = Operands { a, b, c: add.unwrap_or(d), d, beta: if add.is_some() { 1.0 } else { 0.0 } };
        let mut plans = self.plans.lock().map_err(|_| Error::Gpu("cuBLASLt plan cache poisoned".into()))?;
        let p = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(self.plan(key, ops)?),
        };
        self.launch(p, &p.algo, ops).map_err(|err| blas_err(&format!("{m}×{n}×{k} product"), err))
    }

    /// `y[t, o] = Σ_i x[t, i] · w[o, i] (+ residual[t, o])` — a linear layer's forward: `x`
    /// `[rows, in]` BF16, `w` `[out, in]` BF16, `y` and `residual` `[rows, ld_y]` (first `out` columns).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(&self, y: u64, ld_y: usize, x: u64, w: u64, rows: usize, in_dim: usize, out_dim: usize, out: Out, residual: Option<u64>) -> Result<()> {
        self.matmul(true, false, out_dim, rows, in_dim, w, in_dim, x, in_dim, y, ld_y, out, residual)
    }

    /// `dx[t, i] = Σ_o dy[t, o] · w[o, i]` — the input gradient: `dy` `[rows, ld_dy]` BF16.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_dx(&self, dx: u64, dy: u64, ld_dy: usize, w: u64, rows: usize, in_dim: usize, out_dim: usize, out: Out) -> Result<()> {
        self.matmul(false, false, in_dim, rows, out_dim, w, in_dim, dy, ld_dy, dx, in_dim, out, None)
    }

    /// `dw[o, i] += Σ_t dy[t, o] · x[t, i]` — the weight gradient, FP32, accumulated.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_dw(&self, dw: u64, dy: u64, ld_dy: usize, x: u64, rows: usize, in_dim: usize, out_dim: usize) -> Result<()> {
        self.matmul(false, true, in_dim, out_dim, rows, x, in_dim, dy, ld_dy, dw, in_dim, Out::F32, Some(dw))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            for (_, p) in plans.drain() {
                p.destroy();
            }
        }
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_choices_survive_a_checkpoint_round_trip() {
        let key = Key { trans_a: true, trans_b: false, m: 768, n: 16384, k: 2304, lda: 2304, ldb: 2304, ldc: 768, out: Out::Bf16, accumulate: false };
        let saved = serde_json::to_value(vec![Choice { product: key, algorithm: [1, 2, 3, 4, 5, 6, 7, 8] }]).unwrap();
        import_algorithms(&serde_json::Value::Null).unwrap();
        import_algorithms(&saved).unwrap();
        let back: Vec<Choice> = serde_json::from_value(export_algorithms().unwrap()).unwrap();
        let found = back.iter().find(|c| c.product == key).expect("the imported choice is exported again");
        assert_eq!(found.algorithm, [1, 2, 3, 4, 5, 6, 7, 8]);
        let bad = serde_json::json!([{ "product": "qkv", "algorithm": [1] }]);
        assert!(import_algorithms(&bad).unwrap_err().to_string().contains("cuBLASLt algorithms"));
    }
}
