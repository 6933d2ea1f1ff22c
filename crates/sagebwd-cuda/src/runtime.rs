//! Device context, NVRTC compilation of the embedded kernel sources, and the on-disk CUBIN cache.
//!
//! The CUDA driver (`libcuda.so`) and NVRTC (`libnvrtc.so.13`) are loaded at run time by cudarc's
//! `dynamic-loading`: the crate builds on machines without CUDA. cudarc panics when a library is
//! missing, so every first touch of a library is guarded (`is_culib_present`, `catch_unwind`) and
//! turned into an [`Error::Backend`] that says what to install or set.

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};
use sagebwd::{Error, Result};
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;

/// One stage's source: its pieces (paths under `kernels/`, see kernels/README.md) concatenated in
/// order, each after a `#line 1 "piece"` directive so that NVRTC's messages name the right file.
/// The pieces of a stage form one NVRTC program, hence one module.
macro_rules! stage_source {
    ($($piece:literal),+ $(,)?) => {
        concat!($("#line 1 \"", $piece, "\"\n", include_str!(concat!("../kernels/", $piece))),+)
    };
}

/// The kernel sources, embedded in the library. Each stage is compiled as `common.cuh` and
/// `hopper.cuh` followed by the stage's pieces, so NVRTC needs no include path and no CUDA header.
pub const COMMON: &str = include_str!("../kernels/common/common.cuh");
/// Hopper-only helpers (wgmma, descriptors), after `common.cuh`; empty unless compiled for sm_90a.
pub const HOPPER: &str = include_str!("../kernels/sm90/hopper.cuh");
pub const SOURCES: [(&str, &str); 6] = [
    ("quantize.cu", stage_source!("generic/quantize.cu")),
    (
        "forward.cu",
        stage_source!(
            "common/forward_params.cuh",
            "reference/forward_scalar.cu",
            "sm80/forward_int8.cu",
            "sm90/forward_warp_specialized.cuh",
            "sm80/forward_bf16.cu",
            "sm90/forward_bf16.cu",
            "sm90/forward_int8.cu",
            "sm90/forward_fp8.cu",
            "sm80/forward_entry.cu",
        ),
    ),
    ("backward_pre.cu", stage_source!("generic/backward_pre.cu")),
    (
        "backward_main.cu",
        stage_source!(
            "common/backward_params.cuh",
            "reference/backward_scalar.cu",
            "sm80/backward_mma.cu",
            "staged/backward_helpers.cuh",
            "staged/backward_int8.cu",
            "sm90/backward_int8_pipelined_types.cuh",
            "staged/backward_bf16.cu",
            "staged/backward_loop.cuh",
            "sm90/backward_int8_pipelined.cuh",
            "sm90/backward_int8_d64.cu",
            "sm90/backward_int8_d128.cu",
            "staged/backward_entry.cu",
        ),
    ),
    ("backward_post.cu", stage_source!("generic/backward_post.cu")),
    ("selftest.cu", stage_source!("generic/selftest.cu")),
];

/// Head dimensions the kernels are compiled for (`-DHEAD_DIM=`).
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Block sizes the kernels tile (ALGORITHM.md §2.1 defaults).
pub const BLOCK_Q: usize = 64;
pub const BLOCK_KV: usize = 128;
/// Threads per block of the tile kernels (`THREADS` in common.cuh).
pub const THREADS: u32 = 256;

/// Query rows rounded up to whole B_q blocks (row length of the transposed Q̂ᵀ, Qᵀ, dÔᵀ, dOᵀ).
pub fn padded_q(n_q: usize) -> usize {
    n_q.div_ceil(BLOCK_Q) * BLOCK_Q
}
/// Keys rounded up to whole B_kv blocks (row length of the transposed K̂ᵀ, Kᵀ, V̂ᵀ, Vᵀ).
pub fn padded_k(n_k: usize) -> usize {
    n_k.div_ceil(BLOCK_KV) * BLOCK_KV
}

/// Problem dimensions as the kernels see them (mirror of `Dims` in common.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Dims {
    pub batch: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub n_q: i32,
    pub n_k: i32,
    pub causal: i32,
    pub n_qblk: i32,
    pub n_kblk: i32,
    /// `n_qblk · B_q`, `n_kblk · B_kv`: row length of the transposed copies.
    pub n_qpad: i32,
    pub n_kpad: i32,
}
unsafe impl cudarc::driver::DeviceRepr for Dims {}

impl Dims {
    pub fn of(s: &sagebwd::Shape, causal: bool) -> Dims {
        Dims {
            batch: s.batch as i32,
            heads_q: s.heads_q as i32,
            heads_kv: s.heads_kv as i32,
            n_q: s.n_q as i32,
            n_k: s.n_k as i32,
            causal: causal as i32,
            n_qblk: s.n_q.div_ceil(BLOCK_Q) as i32,
            n_kblk: s.n_k.div_ceil(BLOCK_KV) as i32,
            n_qpad: padded_q(s.n_q) as i32,
            n_kpad: padded_k(s.n_k) as i32,
        }
    }
}

/// The NVRTC options of one compilation. `--fmad=false`: the specification's `fl(fl(a·b) + c)`
/// must not become one fused multiply-add (where it writes one — the quantizer's rounding, §2.2,
/// dequantize-and-accumulate, §2.3 — the kernels call `__fmaf_rn`); IEEE division and square root.
pub fn nvrtc_options(arch: &str, head_dim: usize) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("-DHEAD_DIM={head_dim}"),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
    ]
}

/// `common.cuh` + `hopper.cuh` + the stage's source, with `#line` directives so that NVRTC's
/// messages name the right file and line.
pub fn full_source(name: &str, body: &str) -> String {
    format!(
        "#line 1 \"common/common.cuh\"\n{COMMON}\n#line 1 \"sm90/hopper.cuh\"\n{HOPPER}\n#line 1 \"{name}\"\n{body}\n"
    )
}

/// Checks that NVRTC can be loaded (cudarc would panic on first use otherwise).
pub fn nvrtc_available() -> Result<()> {
    let present = std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
    if present {
        Ok(())
    } else {
        Err(Error::Backend(
            "NVRTC not found: libnvrtc.so.13 could not be loaded. Install the CUDA 13 toolkit or the \
             `nvidia-cuda-nvrtc` wheel and add the directory holding libnvrtc.so.13 to LD_LIBRARY_PATH \
             (e.g. /usr/local/cuda/lib64 or <site-packages>/nvidia/cu13/lib)"
                .into(),
        ))
    }
}

/// The result of one NVRTC compilation.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings); empty on a clean compile.
    pub log: String,
}

/// Compiles one stage for `arch` (e.g. `sm_90a`) and `head_dim` to CUBIN. Needs NVRTC, no GPU.
pub fn compile(name: &str, body: &str, arch: &str, head_dim: usize) -> Result<Compiled> {
    let what = format!("{name} for {arch}, HEAD_DIM={head_dim}");
    compile_program(name, &full_source(name, body), &nvrtc_options(arch, head_dim), &what)
}

/// Compiles a whole CUDA source (no header is added) with the given NVRTC options to CUBIN;
/// `what` names it in error messages. Other crates' kernels (the training step's) use this too.
pub fn compile_program(name: &str, source: &str, opts: &[String], what: &str) -> Result<Compiled> {
    nvrtc_available()?;
    let src = CString::new(source).map_err(|e| Error::Backend(e.to_string()))?;
    let cname = CString::new(name).map_err(|e| Error::Backend(e.to_string()))?;
    let guarded = std::panic::catch_unwind(|| unsafe { compile_raw(&src, &cname, opts) });
    let (ok, log, cubin) = guarded.map_err(|_| Error::Backend("NVRTC panicked (missing symbol?)".into()))??;
    if !ok {
        return Err(Error::Backend(format!("NVRTC failed to compile {what}:\n{log}")));
    }
    Ok(Compiled { cubin, log })
}

unsafe fn compile_raw(src: &CString, name: &CString, opts: &[String]) -> Result<(bool, String, Vec<u8>)> {
    let backend = |what: &str, e: nvrtc::NvrtcError| Error::Backend(format!("NVRTC {what}: {e:?}"));
    let prog = nvrtc::create_program(src, Some(name)).map_err(|e| backend("create_program", e))?;
    let compiled = nvrtc::compile_program(prog, opts);
    let log_raw = nvrtc::get_program_log(prog).map_err(|e| backend("get_program_log", e))?;
    let log_bytes: Vec<u8> = log_raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    let log = String::from_utf8_lossy(&log_bytes).trim().to_string();
    let mut cubin = Vec::new();
    if compiled.is_ok() {
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| backend("GetCUBINSize", e))?;
        cubin = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
            .result()
            .map_err(|e| backend("GetCUBIN", e))?;
    }
    let _ = nvrtc::destroy_program(prog);
    Ok((compiled.is_ok(), log, cubin))
}

// ---------------------------------------------------------------------------------------------
// On-disk cache.

/// `$SAGEBWD_CACHE_DIR`, else `$XDG_CACHE_HOME/sagebwd`, else `~/.cache/sagebwd`.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("SAGEBWD_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("sagebwd")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("sagebwd")))
}

/// FNV-1a, 64 bit: a hash that is stable across Rust versions (the cache outlives builds).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff; // separator, so that ("ab","c") and ("a","bc") differ
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn nvrtc_version() -> String {
    let mut major = 0;
    let mut minor = 0;
    unsafe {
        let _ = nvrtc_sys::nvrtcVersion(&mut major, &mut minor);
    }
    format!("{major}.{minor}")
}

/// Compiles through the cache: a hit is read back, a miss is compiled and written atomically
/// (temporary file + rename, so concurrent runs never see a partial file). Cache failures are not
/// errors (the kernel is just compiled again).
pub fn compile_cached(name: &str, body: &str, arch: &str, head_dim: usize) -> Result<Vec<u8>> {
    let what = format!("{name} for {arch}, HEAD_DIM={head_dim}");
    let tag = format!("{arch}-d{head_dim}");
    compile_program_cached(
        name,
        &full_source(name, body),
        &nvrtc_options(arch, head_dim),
        &tag,
        &what,
    )
}

/// [`compile_program`] through the on-disk cache; the file is named `{stem}-{tag}-{hash}.cubin`,
/// the hash covering source, options and the NVRTC version.
pub fn compile_program_cached(name: &str, source: &str, opts: &[String], tag: &str, what: &str) -> Result<Vec<u8>> {
    nvrtc_available()?;
    let version = nvrtc_version();
    let key = fnv1a(&[source.as_bytes(), opts.join(" ").as_bytes(), version.as_bytes()]);
    let stem = name.trim_end_matches(".cu");
    let path = cache_dir().map(|d| d.join(format!("{stem}-{tag}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let compiled = compile_program(name, source, opts, what)?;
    if let Some(p) = &path {
        let _ = write_atomically(p, &compiled.cubin);
    }
    Ok(compiled.cubin)
}

fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".tmp-{}-{nanos}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Every stage for `arch` and `head_dim` through the cache, compiled in parallel (NVRTC programs
/// are independent), in the order of [`SOURCES`].
pub fn compile_all(arch: &str, head_dim: usize) -> Result<Vec<Vec<u8>>> {
    std::thread::scope(|scope| {
        let jobs: Vec<_> = SOURCES
            .iter()
            .map(|&(name, body)| scope.spawn(move || compile_cached(name, body, arch, head_dim)))
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(Error::Backend("NVRTC compile thread panicked".into())))
            })
            .collect()
    })
}

// ---------------------------------------------------------------------------------------------
// Device.

/// The NVRTC target for a device of compute capability `major.minor`: `sm_90a` on Hopper (the
/// arch-specific target, for wgmma-era instructions), else `sm_XY`. Needs ≥ 8.0.
pub fn arch_for(major: i32, minor: i32) -> Result<String> {
    if major < 8 {
        return Err(Error::Backend(format!(
            "GPU of compute capability {major}.{minor} is not supported: the kernels need 8.0 or newer"
        )));
    }
    Ok(if (major, minor) == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    })
}

/// An initialized device: context, stream, target architecture.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub arch: String,
    pub name: String,
    /// The most dynamic shared memory one block may opt into (bytes), read once here rather than
    /// before every launch.
    pub smem_optin: usize,
    /// Streaming multiprocessors, read once here.
    pub sms: u32,
}

pub(crate) fn drv<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| Error::Backend(format!("CUDA {what}: {e:?}")))
}

impl Device {
    pub fn open(ordinal: usize) -> Result<Device> {
        let driver = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        if !driver {
            return Err(Error::Backend(
                "CUDA driver not found: libcuda.so could not be loaded (no NVIDIA driver installed?)".into(),
            ));
        }
        let count = std::panic::catch_unwind(CudaContext::device_count)
            .map_err(|_| Error::Backend("CUDA driver panicked on initialization".into()))?;
        let count = drv("device count (cuInit)", count)?;
        if count <= ordinal as i32 {
            return Err(Error::Backend(format!(
                "no CUDA GPU with ordinal {ordinal} ({count} visible)"
            )));
        }
        let ctx = drv("context creation", CudaContext::new(ordinal))?;
        let (major, minor) = drv("compute capability", ctx.compute_capability())?;
        let arch = arch_for(major, minor)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let stream = ctx.default_stream();
        let optin = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let smem_optin = drv("shared memory limit", ctx.attribute(optin))? as usize;
        let sm_attr = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sms = drv("multiprocessor count", ctx.attribute(sm_attr))? as u32;
        Ok(Device {
            ctx,
            stream,
            arch,
            name,
            smem_optin,
            sms,
        })
    }

    /// Free device memory in bytes (cuMemGetInfo).
    pub fn free_memory(&self) -> Result<usize> {
        Ok(drv("cuMemGetInfo", self.ctx.mem_get_info())?.0)
    }

    pub fn load(&self, cubin: Vec<u8>) -> Result<Arc<CudaModule>> {
        drv("module load", self.ctx.load_module(Ptx::from_binary(cubin)))
    }
}

/// Every kernel of one head dimension, loaded.
pub struct Kernels {
    pub head_dim: usize,
    pub k_mean: CudaFunction,
    pub k_mean_partial: CudaFunction,
    pub quantize_rows: CudaFunction,
    /// Q̂, K̂ byte-transposed for the backward (`quantize::transpose_qk_hat`).
    pub transpose_qk_hat: CudaFunction,
    pub fill_u32: CudaFunction,
    pub forward: CudaFunction,
    pub forward_mma: CudaFunction,
    pub bwd_delta: CudaFunction,
    pub bwd_main: CudaFunction,
    pub bwd_main_mma: CudaFunction,
    pub mma_selftest: CudaFunction,
    /// `exp2_ftz` monotone on [−∞, 16] and ≤ 1 on [−∞, 0] (`Gpu::ex2_selftest`).
    pub ex2_monotone: CudaFunction,
    /// `pack_bf16x2_nan` = `f32_to_bf16` on all 2³² patterns (`Gpu::bf16_pack_selftest`, epi15).
    pub bf16_pack_check: CudaFunction,
    pub post_dq: CudaFunction,
    pub post_dkdv: CudaFunction,
}

/// The kernel `name` of the module that holds `anchor` (a function `Kernels::load` took).
fn sibling_function(
    anchor: &CudaFunction,
    what: &str,
    name: &std::ffi::CStr,
) -> Result<cudarc::driver::sys::CUfunction> {
    use cudarc::driver::sys;
    unsafe {
        let mut module = std::mem::MaybeUninit::<sys::CUmodule>::uninit();
        drv(
            what,
            sys::cuFuncGetModule(module.as_mut_ptr(), anchor.cu_function()).result(),
        )?;
        let mut f = std::mem::MaybeUninit::<sys::CUfunction>::uninit();
        drv(
            &format!("load function {}", name.to_string_lossy()),
            sys::cuModuleGetFunction(f.as_mut_ptr(), module.assume_init(), name.as_ptr()).result(),
        )?;
        Ok(f.assume_init())
    }
}

impl Kernels {
    /// A kernel of the forward module by name, for the ones that exist only in its sm_90a build
    /// (the warp-specialized forwards and their variants), so `load` cannot take them on every
    /// GPU. A hash lookup in the driver.
    pub fn forward_function(&self, name: &std::ffi::CStr) -> Result<cudarc::driver::sys::CUfunction> {
        sibling_function(&self.forward_mma, "forward module", name)
    }

    /// A kernel of the quantization module by name (`sage_quantize_qkv`, which `load` does not
    /// take because only the fused-launch path needs it).
    pub fn quantize_function(&self, name: &std::ffi::CStr) -> Result<cudarc::driver::sys::CUfunction> {
        sibling_function(&self.quantize_rows, "quantize module", name)
    }

    /// A kernel of the backward-main module by name (the warp-specialized backward exists only in
    /// the sm_90a build), as `forward_function`.
    pub fn backward_main_function(&self, name: &std::ffi::CStr) -> Result<cudarc::driver::sys::CUfunction> {
        sibling_function(&self.bwd_main_mma, "backward module", name)
    }

    /// A kernel of the backward-postprocess module by name (`sage_bwd_post_dq_int8`, launched with PDL
    /// through the driver, so `load` does not take it), as `forward_function`.
    pub fn backward_post_function(&self, name: &std::ffi::CStr) -> Result<cudarc::driver::sys::CUfunction> {
        sibling_function(&self.post_dq, "backward post module", name)
    }

    pub fn load(dev: &Device, head_dim: usize) -> Result<Kernels> {
        let mut modules = Vec::new();
        for cubin in compile_all(&dev.arch, head_dim)? {
            modules.push(dev.load(cubin)?);
        }
        let f = |m: usize, n: &str| drv(&format!("load function {n}"), modules[m].load_function(n));
        Ok(Kernels {
            head_dim,
            k_mean: f(0, "sage_k_mean")?,
            k_mean_partial: f(0, "sage_k_mean_partial")?,
            quantize_rows: f(0, "sage_quantize_rows")?,
            transpose_qk_hat: f(0, "sage_transpose_qk_hat")?,
            fill_u32: f(0, "sage_fill_u32")?,
            forward: f(1, "sage_fwd_reference")?,
            forward_mma: f(1, "sage_fwd_sm80")?,
            bwd_delta: f(2, "sage_bwd_delta")?,
            bwd_main: f(3, "sage_bwd_main_reference")?,
            bwd_main_mma: f(3, "sage_bwd_main_sm80")?,
            mma_selftest: f(5, "sage_mma_selftest")?,
            ex2_monotone: f(5, "sage_ex2_monotone")?,
            bf16_pack_check: f(5, "sage_bf16_pack_check")?,
            post_dq: f(4, "sage_bwd_post_dq")?,
            post_dkdv: f(4, "sage_bwd_post_dkdv")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_selection() {
        assert_eq!(arch_for(9, 0).unwrap(), "sm_90a");
        assert_eq!(arch_for(8, 6).unwrap(), "sm_86");
        assert_eq!(arch_for(10, 0).unwrap(), "sm_100");
        assert!(arch_for(7, 5).is_err());
    }

    #[test]
    fn cache_key_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }

    #[test]
    fn atomic_write_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("sagebwd-cache-test-{}", std::process::id()));
        let p = dir.join("a.cubin");
        write_atomically(&p, b"abc").unwrap();
        write_atomically(&p, b"defg").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"defg");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
