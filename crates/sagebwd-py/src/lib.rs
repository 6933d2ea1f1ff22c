//! `sagebwd._native`: the Python extension behind the `sagebwd` package. It knows nothing of
//! PyTorch: it takes raw device addresses, shapes and a raw stream handle, and calls
//! `sagebwd_cuda::external`. The Python layer (`sagebwd/ops.py`) checks the tensors and passes them.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
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
    fn new(preset: &str, int8: Option<Vec<String>>, bf16: Option<Vec<String>>, smooth_k: Option<bool>) -> PyResult<Self> {
        let mut cfg = Config::preset(preset).map_err(value_error)?;
        let (int8, bf16) = (parse_products(int8, "int8")?, parse_products(bf16, "bf16")?);
        if let Some(p) = int8.iter().find(|p| bf16.contains(p)) {
            return Err(PyValueError::new_err(format!("product `{}` is listed in both int8 and bf16", p.name())));
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
        Product::ALL.into_iter().filter(|p| self.cfg.is_int8(*p)).map(|p| p.name()).collect()
    }

    #[getter]
    fn smooth_k(&self) -> bool {
        self.cfg.smooth_k
    }

    fn __repr__(&self) -> String {
        format!("Config({}, int8={:?}, smooth_k={})", self.cfg.label(), self.int8(), self.cfg.smooth_k)
    }
}

/// One GPU (the CUDA primary context of this ordinal, the one PyTorch uses) with its kernels.
#[pyclass(name = "Device", module = "sagebwd._native", frozen)]
struct PyDevice {
    gpu: Arc<Gpu>,
}

/// What the forward saved for the backward (quantized operands, scales, K mean, row offsets,
/// LSE). Exposes the natural LSE `[B, H_q, N_q]` (FP32) through `__cuda_array_interface__`, so that
/// a tensor made from it keeps this object, hence the whole state, alive.
#[pyclass(name = "Saved", module = "sagebwd._native", frozen, weakref)]
struct PySaved {
    gpu: Arc<Gpu>,
    state: Mutex<ExternalForward>,
}

fn shape_of(dims: (usize, usize, usize, usize, usize, usize)) -> Shape {
    let (batch, heads_q, heads_kv, n_q, n_k, head_dim) = dims;
    Shape { batch, heads_q, heads_kv, n_q, n_k, head_dim }
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

    /// Free and total device memory in bytes (cuMemGetInfo).
    fn mem_info(&self) -> PyResult<(usize, usize)> {
        self.gpu.dev.ctx.mem_get_info().map_err(|e| PyRuntimeError::new_err(format!("cuMemGetInfo: {e:?}")))
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
    fn forward(&self, py: Python<'_>, stream: usize, dims: (usize, usize, usize, usize, usize, usize), causal: bool,
               config: &PyConfig, q: u64, k: u64, v: u64, o: u64) -> PyResult<PySaved> {
        let shape = shape_of(dims);
        let gpu = &self.gpu;
        let cfg = &config.cfg;
        let state = py
            .detach(|| unsafe { external::forward(gpu, stream as _, shape, causal, cfg, q, k, v, o) })
            .map_err(call_error)?;
        Ok(PySaved { gpu: self.gpu.clone(), state: Mutex::new(state) })
    }

    /// The backward of `forward`: dQ, dK, dV written into `dq`, `dk`, `dv`.
    #[allow(clippy::too_many_arguments)]
    fn backward(&self, py: Python<'_>, stream: usize, saved: &PySaved, q: u64, k: u64, v: u64, o: u64, d_o: u64,
                dq: u64, dk: u64, dv: u64) -> PyResult<()> {
        if !Arc::ptr_eq(&self.gpu, &saved.gpu) {
            return Err(PyValueError::new_err("the saved state belongs to another device"));
        }
        let gpu = &self.gpu;
        py.detach(|| {
            let mut state =
                saved.state.lock().map_err(|_| sagebwd::Error::Backend("saved state lock poisoned".into()))?;
            unsafe { external::backward(gpu, stream as _, &mut state, q, k, v, o, d_o, dq, dk, dv) }
        })
        .map_err(call_error)
    }
}

#[pymethods]
impl PySaved {
    /// The natural LSE `[B, H_q, N_q]`, FP32, as CUDA Array Interface v2 (no stream: it is ready on the
    /// stream the forward was queued on, which is the consumer's).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = self.state.lock().map_err(|_| PyRuntimeError::new_err("saved state lock poisoned"))?;
        let s = state.shape;
        let d = PyDict::new(py);
        d.set_item("shape", (s.batch, s.heads_q, s.n_q))?;
        d.set_item("typestr", "<f4")?;
        d.set_item("data", (state.lse_ptr(&self.gpu), false))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 2)?;
        Ok(d)
    }

    #[getter]
    fn label(&self) -> PyResult<String> {
        let state = self.state.lock().map_err(|_| PyRuntimeError::new_err("saved state lock poisoned"))?;
        Ok(state.config().label())
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
    m.add_function(wrap_pyfunction!(head_dims, m)?)?;
    m.add("PRESETS", sagebwd::config::PRESETS.to_vec())?;
    Ok(())
}
