//! `sagebwd._native`: the Python extension behind the `sagebwd` package. It knows nothing of
//! PyTorch: it takes raw device addresses, shapes and a raw stream handle, and calls
//! `sagebwd_cuda::external`. The Python layer (`sagebwd/ops.py`) checks the tensors and passes them.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use sagebwd::{Config, Precision, Product, Shape};
use sagebwd_cuda::external::{self, ExternalForward};
use sagebwd_cuda::Gpu;
use std::sync::{Arc, Mutex};

fn value_error(e: sagebwd::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn runtime_error(e: sagebwd::Error) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// Errors of the GPU calls: shape and configuration errors are the caller's (ValueError), the rest
/// (driver, NVRTC, out of memory) RuntimeError.
fn call_error(e: sagebwd::Error) -> PyErr {
    match e {
        sagebwd::Error::Shape(_) | sagebwd::Error::HeadDim { .. } | sagebwd::Error::Config(_) => value_error(e),
        other => runtime_error(other),
    }
}

/// The method's configuration: a preset, then products moved to INT8 or BF16, then K-smoothing.
#[pyclass(name = "Config", module = "sagebwd._native", frozen)]
#[derive(Clone)]
struct PyConfig {
    cfg: Config,
}

fn parse_products(names: Option<Vec<String>>, what: &str) -> PyResult<Vec<Product>> {
    names
        .unwrap_or_default()
        .iter()
        .map(|n| Product::parse(n).map_err(|e| PyValueError::new_err(format!("{what}: {e}"))))
        .collect()
}

#[pymethods]
impl PyConfig {
    #[new]
    #[pyo3(signature = (preset="sagebwd", int8=None, bf16=None, smooth_k=None))]
    fn new(
        preset: &str,
        int8: Option<Vec<String>>,
        bf16: Option<Vec<String>>,
        smooth_k: Option<bool>,
    ) -> PyResult<Self> {
        let mut cfg = Config::preset(preset).map_err(value_error)?;
        let (int8, bf16) = (parse_products(int8, "int8")?, parse_products(bf16, "bf16")?);
        if let Some(p) = int8.iter().find(|p| bf16.contains(p)) {
            return Err(PyValueError::new_err(format!(
                "product `{}` is listed in both int8 and bf16",
                p.name()
            )));
        }
        for p in int8 {
            cfg.set(p, Precision::Int8);
        }
        for p in bf16 {
            cfg.set(p, Precision::Bf16);
        }
        if let Some(s) = smooth_k {
            cfg.smooth_k = s;
        }
        cfg.validate().map_err(value_error)?;
        Ok(PyConfig { cfg })
    }

    /// The configuration's short name (`sagebwd`, `fpa`, `int8[dq]+smoothK`, ...).
    #[getter]
    fn label(&self) -> String {
        self.cfg.label()
    }

    /// The products computed in INT8, by name.
    #[getter]
    fn int8(&self) -> Vec<&'static str> {
        Product::ALL
            .into_iter()
            .filter(|p| self.cfg.is_int8(*p))
            .map(|p| p.name())
            .collect()
    }

    #[getter]
    fn smooth_k(&self) -> bool {
        self.cfg.smooth_k
    }

    fn __repr__(&self) -> String {
        format!(
            "Config({}, int8={:?}, smooth_k={})",
            self.cfg.label(),
            self.int8(),
            self.cfg.smooth_k
        )
    }
}

/// One GPU (the CUDA primary context of this ordinal, the one PyTorch uses) with its kernels.
#[pyclass(name = "Device", module = "sagebwd._native", frozen)]
struct PyDevice {
    gpu: Arc<Gpu>,
}

/// What the forward saved for the backward (quantized operands, scales, K mean, row offsets,
/// LSE). Exposes the natural LSE `[B, H_q, N_q]` (FP32) as DLPack ([`PySaved::lse_dlpack`]), so that
/// a tensor made from it keeps this object, hence the whole state, alive.
#[pyclass(name = "Saved", module = "sagebwd._native", frozen, weakref)]
struct PySaved {
    gpu: Arc<Gpu>,
    state: Mutex<ExternalForward>,
}

fn shape_of(dims: (usize, usize, usize, usize, usize, usize)) -> Shape {
    let (batch, heads_q, heads_kv, n_q, n_k, head_dim) = dims;
    Shape {
        batch,
        heads_q,
        heads_kv,
        n_q,
        n_k,
        head_dim,
    }
}

#[pymethods]
impl PyDevice {
    /// Opens GPU `ordinal`. RuntimeError (with the reason) when the driver, the GPU or NVRTC is missing.
    #[new]
    fn new(py: Python<'_>, ordinal: usize) -> PyResult<Self> {
        let gpu = py.detach(|| external::open(ordinal)).map_err(runtime_error)?;
        Ok(PyDevice { gpu: Arc::new(gpu) })
    }

    /// "NVIDIA H100 80GB HBM3 (sm_90a)".
    fn describe(&self) -> String {
        self.gpu.describe()
    }

    /// Compiles (or reads from the kernel cache) the kernels of this head dimension now.
    fn load_kernels(&self, py: Python<'_>, head_dim: usize) -> PyResult<()> {
        py.detach(|| self.gpu.kernels(head_dim).map(|_| ())).map_err(call_error)
    }

    /// How the backward splits its heads to bound its peak memory: "lean" (peak within cuDNN's at
    /// every shape, at some backward time at N ≤ 2k), "auto" (split only where it costs no time),
    /// "off" (never), or a number of head groups. Applies to every later call on this device.
    fn set_backward_groups(&self, policy: &str) -> PyResult<()> {
        self.gpu.set_backward_groups(parse_groups(policy)?);
        Ok(())
    }

    /// Releases the memory the library's stream-ordered pool keeps for reuse (its workspaces) back to
    /// the driver, after the work queued so far (a device synchronization).
    fn empty_cache(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| sagebwd_cuda::pool::Pool::release_unused(&self.gpu))
            .map_err(runtime_error)
    }

    /// Free and total device memory in bytes (cuMemGetInfo).
    fn mem_info(&self) -> PyResult<(usize, usize)> {
        self.gpu
            .dev
            .ctx
            .mem_get_info()
            .map_err(|e| PyRuntimeError::new_err(format!("cuMemGetInfo: {e:?}")))
    }

    /// Peak bytes in use in the device's stream-ordered memory pool (where the library's outputs and
    /// workspaces live; PyTorch's caching allocator does not draw from it) since the last reset;
    /// `reset`: start a new peak from what is in use now. None without memory pools.
    #[pyo3(signature = (reset=false))]
    fn pool_peak(&self, reset: bool) -> PyResult<Option<u64>> {
        let pool = sagebwd_cuda::pool::Pool::of(&self.gpu).map_err(runtime_error)?;
        let Some(pool) = pool else { return Ok(None) };
        let peak = pool.high().map_err(runtime_error)?;
        if reset {
            pool.reset_high().map_err(runtime_error)?;
        }
        Ok(Some(peak))
    }

    /// The forward on contiguous BF16 device tensors: `dims` = (B, H_q, H_kv, N_q, N_k, d); O is
    /// written into `o`; queued on the raw stream handle `stream`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        stream: usize,
        dims: (usize, usize, usize, usize, usize, usize),
        causal: bool,
        config: &PyConfig,
        q: u64,
        k: u64,
        v: u64,
        o: u64,
    ) -> PyResult<PySaved> {
        let shape = shape_of(dims);
        let gpu = &self.gpu;
        let cfg = &config.cfg;
        let state = py
            .detach(|| unsafe { external::forward(gpu, stream as _, shape, causal, cfg, q, k, v, o) })
            .map_err(call_error)?;
        Ok(PySaved {
            gpu: self.gpu.clone(),
            state: Mutex::new(state),
        })
    }

    /// The backward of `forward`: dQ, dK, dV written into `dq`, `dk`, `dv`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        py: Python<'_>,
        stream: usize,
        saved: &PySaved,
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        d_o: u64,
        dq: u64,
        dk: u64,
        dv: u64,
    ) -> PyResult<()> {
        if !Arc::ptr_eq(&self.gpu, &saved.gpu) {
            return Err(PyValueError::new_err("the saved state belongs to another device"));
        }
        let gpu = &self.gpu;
        py.detach(|| {
            let mut state = saved
                .state
                .lock()
                .map_err(|_| sagebwd::Error::Backend("saved state lock poisoned".into()))?;
            unsafe { external::backward(gpu, stream as _, &mut state, q, k, v, o, d_o, dq, dk, dv) }
        })
        .map_err(call_error)
    }
}

#[pymethods]
impl PySaved {
    /// The natural LSE `[B, H_q, N_q]` (FP32, on CUDA device `device_index`) as a DLPack capsule for
    /// `torch.utils.dlpack.from_dlpack`. The tensor made from it holds a reference to this object:
    /// the saved state lives as long as that tensor's storage (and is freed with it).
    fn lse_dlpack(slf: &Bound<'_, Self>, device_index: i32) -> PyResult<Py<PyAny>> {
        let this = slf.get();
        let state = this
            .state
            .lock()
            .map_err(|_| PyRuntimeError::new_err("saved state lock poisoned"))?;
        let s = state.shape;
        let data = state.lse_ptr(&this.gpu);
        drop(state);
        dlpack::lse_capsule(
            slf.py(),
            slf.clone().unbind(),
            data,
            [s.batch as i64, s.heads_q as i64, s.n_q as i64],
            device_index,
        )
    }

    #[getter]
    fn label(&self) -> PyResult<String> {
        let state = self
            .state
            .lock()
            .map_err(|_| PyRuntimeError::new_err("saved state lock poisoned"))?;
        Ok(state.config().label())
    }
}

/// A DLPack (v0.x, `DLManagedTensor`) view of device memory that keeps a Python object alive.
mod dlpack {
    use pyo3::prelude::*;
    use std::ffi::{c_void, CStr};

    #[repr(C)]
    struct DlDevice {
        device_type: i32,
        device_id: i32,
    }

    #[repr(C)]
    struct DlDataType {
        code: u8,
        bits: u8,
        lanes: u16,
    }

    #[repr(C)]
    struct DlTensor {
        data: *mut c_void,
        device: DlDevice,
        ndim: i32,
        dtype: DlDataType,
        shape: *mut i64,
        strides: *mut i64,
        byte_offset: u64,
    }

    #[repr(C)]
    struct DlManagedTensor {
        dl_tensor: DlTensor,
        manager_ctx: *mut c_void,
        deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
    }

    /// What the managed tensor owns: the shape array and a reference to the memory's owner.
    struct Holder {
        shape: [i64; 3],
        _owner: Py<PyAny>,
    }

    const KDL_CUDA: i32 = 2;
    const KDL_FLOAT: u8 = 2;
    const NAME: &CStr = c"dltensor";

    /// Frees the managed tensor and its holder. The owner's reference is released through PyO3,
    /// which defers it when the calling thread is not attached to the interpreter.
    unsafe extern "C" fn deleter(m: *mut DlManagedTensor) {
        if m.is_null() {
            return;
        }
        let m = unsafe { Box::from_raw(m) };
        drop(unsafe { Box::from_raw(m.manager_ctx as *mut Holder) });
    }

    /// The capsule's destructor: frees the tensor only if no consumer took it (a consumer renames the
    /// capsule `used_dltensor` and calls the deleter itself when done).
    unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
        unsafe {
            if pyo3::ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
                let m = pyo3::ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) as *mut DlManagedTensor;
                deleter(m);
            }
        }
    }

    /// A capsule of a contiguous FP32 tensor of `shape` at `data` on CUDA device `device_id`.
    pub fn lse_capsule(
        py: Python<'_>,
        owner: Py<super::PySaved>,
        data: u64,
        shape: [i64; 3],
        device_id: i32,
    ) -> PyResult<Py<PyAny>> {
        let holder = Box::into_raw(Box::new(Holder {
            shape,
            _owner: owner.into_any(),
        }));
        let m = Box::into_raw(Box::new(DlManagedTensor {
            dl_tensor: DlTensor {
                data: data as *mut c_void,
                device: DlDevice {
                    device_type: KDL_CUDA,
                    device_id,
                },
                ndim: 3,
                dtype: DlDataType {
                    code: KDL_FLOAT,
                    bits: 32,
                    lanes: 1,
                },
                shape: unsafe { (*holder).shape.as_mut_ptr() },
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: holder as *mut c_void,
            deleter: Some(deleter),
        }));
        unsafe {
            let cap = pyo3::ffi::PyCapsule_New(m as *mut c_void, NAME.as_ptr(), Some(capsule_destructor));
            if cap.is_null() {
                deleter(m);
                return Err(PyErr::fetch(py));
            }
            Ok(Py::from_owned_ptr(py, cap))
        }
    }
}

/// Whether NVRTC (libnvrtc.so.13) can be loaded, and if not why: (ok, message).
#[pyfunction]
fn nvrtc_status() -> (bool, String) {
    match sagebwd_cuda::runtime::nvrtc_available() {
        Ok(()) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    }
}

/// The kernel cache directory (`SAGEBWD_CACHE_DIR`, else `$XDG_CACHE_HOME/sagebwd`, else `~/.cache/sagebwd`).
#[pyfunction]
fn cache_dir() -> Option<String> {
    sagebwd_cuda::runtime::cache_dir().map(|p| p.display().to_string())
}

/// ValueError unless `policy` names a backward memory policy (`Device.set_backward_groups`).
#[pyfunction]
fn check_backward_groups(policy: &str) -> PyResult<()> {
    parse_groups(policy).map(drop)
}

fn parse_groups(policy: &str) -> PyResult<sagebwd_cuda::GroupPolicy> {
    // the library's parser reads an empty variable as unset (auto); here a name is required
    let named = if policy.trim().is_empty() { None } else { Some(policy) };
    named
        .and_then(|p| sagebwd_cuda::GroupPolicy::parse(Some(p)).ok())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
            "backward memory policy {policy:?}: expected \"lean\" (peak within cuDNN's), \"auto\" (split only where \
             free), \"off\" or a number of head groups >= 1"
        ))
        })
}

/// The product names, in the order of ALGORITHM.md.
#[pyfunction]
fn products() -> Vec<&'static str> {
    Product::ALL.map(|p| p.name()).to_vec()
}

/// The head dimensions the kernels are built for.
#[pyfunction]
fn head_dims() -> Vec<usize> {
    sagebwd_cuda::runtime::HEAD_DIMS.to_vec()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyConfig>()?;
    m.add_class::<PyDevice>()?;
    m.add_class::<PySaved>()?;
    m.add_function(wrap_pyfunction!(nvrtc_status, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(products, m)?)?;
    m.add_function(wrap_pyfunction!(check_backward_groups, m)?)?;
    m.add_function(wrap_pyfunction!(head_dims, m)?)?;
    m.add("PRESETS", sagebwd::config::PRESETS.to_vec())?;
    Ok(())
}
