//! Board energy of one GPU from NVML's cumulative counter (`nvmlDeviceGetTotalEnergyConsumption`:
//! millijoules since the driver loaded; Volta and newer).
//!
//! Why it matters here: the H200 caps board power at 700 W, and a training step at full load runs at
//! the cap, where the clock, and so the step's time, follows the energy the kernels spend
//! (docs/PERFORMANCE.md: INT8 attention spends ~9.5 % less energy per forward + backward
//! than BF16, and that is where `sagebwd`'s lead at sequence 4096 comes from). Energy is therefore a
//! figure of merit of its own, reported by `sagebwd bench --energy` and by GPU training runs.
//!
//! NVML ships with the driver and is loaded at run time (`libnvidia-ml.so.1`): where it is missing, or
//! the GPU has no energy counter, [`EnergyMeter::open`] returns an error that says so, and callers go
//! on without energy numbers. The counter is refreshed every 20–100 ms, so a span should last a
//! second or more for a figure good to ~1 %.

use crate::runtime::{drv, Device};
use nvml_wrapper::Nvml;
use sagebwd::{Error, Result};
use std::time::Instant;

/// NVML opened on the GPU of one [`Device`].
pub struct EnergyMeter {
    nvml: Nvml,
    /// NVML's index of the device (NVML orders by PCI bus; CUDA's order may differ).
    index: u32,
}

impl std::fmt::Debug for EnergyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnergyMeter")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

fn nvml_err(what: &str) -> impl Fn(nvml_wrapper::error::NvmlError) -> Error + '_ {
    move |e| Error::Backend(format!("NVML {what}: {e}"))
}

/// `domain:bus:device.0` of a CUDA device, as NVML prints it.
fn pci_bus_id(dev: &Device) -> Result<String> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let attr = |a, what| drv(what, dev.ctx.attribute(a));
    let domain = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, "PCI domain")?;
    let bus = attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, "PCI bus")?;
    let device = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, "PCI device")?;
    Ok(format!("{domain:08X}:{bus:02X}:{device:02X}.0"))
}

impl EnergyMeter {
    /// NVML on `dev`'s GPU; fails (with the reason) without NVML or without an energy counter.
    pub fn open(dev: &Device) -> Result<EnergyMeter> {
        let bus = pci_bus_id(dev)?;
        let nvml = Nvml::init().map_err(|e| {
            Error::Backend(format!(
                "NVML (libnvidia-ml.so.1, part of the NVIDIA driver) not available: {e}"
            ))
        })?;
        let index = nvml
            .device_by_pci_bus_id(bus.as_str())
            .map_err(nvml_err("device lookup by PCI bus id"))?;
        let index = index.index().map_err(nvml_err("device index"))?;
        let meter = EnergyMeter { nvml, index };
        meter.millijoules()?;
        Ok(meter)
    }

    /// The board's energy counter (mJ since the driver loaded).
    pub fn millijoules(&self) -> Result<u64> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(nvml_err("device handle"))?;
        d.total_energy_consumption()
            .map_err(nvml_err("total energy consumption (needs Volta or newer)"))
    }

    /// The SM clock now (MHz): under the power cap it drops below the maximum.
    pub fn sm_clock_mhz(&self) -> Result<u32> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(nvml_err("device handle"))?;
        d.clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
            .map_err(nvml_err("SM clock"))
    }

    /// Starts a span: the counter and the wall clock now.
    pub fn start(&self) -> Result<EnergySpan> {
        Ok(EnergySpan {
            mj: self.millijoules()?,
            at: Instant::now(),
        })
    }

    /// The energy and wall time since `span` started.
    pub fn since(&self, span: &EnergySpan) -> Result<Energy> {
        let mj = self.millijoules()?;
        Ok(Energy {
            joules: mj.saturating_sub(span.mj) as f64 * 1e-3,
            seconds: span.at.elapsed().as_secs_f64(),
        })
    }
}

/// The start of a measured interval (see [`EnergyMeter::start`]).
#[derive(Clone, Copy, Debug)]
pub struct EnergySpan {
    mj: u64,
    at: Instant,
}

impl EnergySpan {
    /// Wall-clock seconds since the span started.
    pub fn elapsed_secs(&self) -> f64 {
        self.at.elapsed().as_secs_f64()
    }
}

/// Energy spent over a wall-clock interval.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Energy {
    pub joules: f64,
    pub seconds: f64,
}

impl Energy {
    /// Mean board power over the interval (W); 0 for an empty interval.
    pub fn watts(&self) -> f64 {
        if self.seconds > 0.0 {
            self.joules / self.seconds
        } else {
            0.0
        }
    }

    /// Energy per unit of work (J each) for `count` units done in the interval.
    pub fn per(&self, count: usize) -> Option<f64> {
        (count > 0).then(|| self.joules / count as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_and_energy_per_unit_follow_from_the_interval() {
        let e = Energy {
            joules: 1035.0,
            seconds: 1.5,
        };
        assert_eq!(e.watts(), 690.0);
        assert_eq!(e.per(1035), Some(1.0));
        assert_eq!(e.per(0), None);
        assert_eq!(Energy::default().watts(), 0.0);
    }
}
