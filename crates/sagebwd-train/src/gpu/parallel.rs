//! GPU replicas for [`crate::parallel::DataParallel`]: gradients summed with one NCCL all-reduce
//! over the flat FP32 gradient buffers (one communicator per GPU, all in this process).

use super::{Error, GpuEngine, Result};
use crate::parallel::Replica;
use cudarc::nccl::{group_end, group_start, Comm, ReduceOp};

/// NCCL's library name as cudarc loads it: `libnccl.so` (NCCL 2 installs `libnccl.so.2`; PyTorch's
/// `nvidia-nccl` wheel too, so a link named `libnccl.so` must be on LD_LIBRARY_PATH).
fn nccl_present() -> bool {
    std::panic::catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() }).unwrap_or(false)
}

impl Replica for GpuEngine {
    type Group = Vec<Comm>;

    fn group(replicas: &[Self]) -> Result<Vec<Comm>> {
        if replicas.len() < 2 {
            return Ok(Vec::new());
        }
        if !nccl_present() {
            return Err(Error::Gpu(
                "training on several GPUs needs NCCL: libnccl.so could not be loaded. Install NCCL 2 (or the \
                 nvidia-nccl-cu13 wheel) and put a directory holding `libnccl.so` (a link to libnccl.so.2 will do) on \
                 LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let streams = replicas.iter().map(|r| r.stream().clone()).collect();
        Comm::from_devices(streams).map_err(|e| Error::Gpu(format!("NCCL initialization: {e:?}")))
    }

    fn all_reduce(comms: &Vec<Comm>, replicas: &mut [Self]) -> Result<()> {
        let err = |e| Error::Gpu(format!("NCCL all-reduce of the gradients: {e:?}"));
        // One process drives every GPU: the per-communicator calls must form one NCCL group.
        group_start().map_err(err)?;
        let mut result = Ok(());
        for (comm, r) in comms.iter().zip(replicas.iter_mut()) {
            if let Err(e) = comm.all_reduce_in_place(r.grads_mut(), &ReduceOp::Sum) {
                result = Err(err(e));
                break;
            }
        }
        group_end().map_err(err)?;
        result
    }
}
