//! Raw driver streams beside the kernels' stream, and the events that order them.
//!
//! Raw, non-blocking streams: non-blocking because the kernels' stream is the context's default
//! (legacy) stream, with which a blocking stream would serialize; raw because a second cudarc
//! stream would switch the whole context to cudarc's per-buffer event tracking (extra driver calls
//! on every buffer access, for every user of the context). Ordering is explicit: [`order`] for
//! "everything so far", [`Mark`] for a point to wait for later.

use crate::runtime::drv;
use cudarc::driver::{sys, CudaContext};
use sagebwd::Result;
use std::sync::Arc;

/// A non-blocking driver stream, destroyed on drop (queued work completes first: the driver
/// defers the release).
pub struct RawStream(sys::CUstream);

impl RawStream {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<RawStream> {
        drv("bind context", ctx.bind_to_thread())?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        drv("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut stream, flags).result() })?;
        Ok(RawStream(stream))
    }

    pub fn handle(&self) -> sys::CUstream {
        self.0
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.0);
        }
    }
}

// A driver stream handle is usable from any thread of its context.
unsafe impl Send for RawStream {}
unsafe impl Sync for RawStream {}

/// The point a stream had reached when the mark was recorded (an event without timing).
pub struct Mark(sys::CUevent);

impl Mark {
    /// Marks everything queued on `stream` so far.
    ///
    /// # Safety
    /// `stream` is a live stream of the context bound to this thread.
    pub unsafe fn record(stream: sys::CUstream) -> Result<Mark> {
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        drv("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags).result() })?;
        let mark = Mark(event);
        drv("cuEventRecord", unsafe { sys::cuEventRecord(event, stream).result() })?;
        Ok(mark)
    }

    /// Makes `stream` wait (on the device) until the marked point is done.
    ///
    /// # Safety
    /// As [`Mark::record`].
    pub unsafe fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        drv("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, self.0, 0).result() })
    }
}

impl Drop for Mark {
    /// Released once the recorded work completes; waits already queued keep their point.
    fn drop(&mut self) {
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.0);
        }
    }
}

unsafe impl Send for Mark {}

/// Makes `to` wait for everything queued on `from` so far.
///
/// # Safety
/// `from` and `to` are live streams of the context bound to this thread.
pub unsafe fn order(from: sys::CUstream, to: sys::CUstream) -> Result<()> {
    unsafe { Mark::record(from)?.wait_on(to) }
}
