//! The devices ggml can compute on in this build: the CPU always, and GPUs where a GPU
//! backend is built in (`--features vulkan`), and where a model's layers go
//! ([`Offload`]). Which device and how many layers are host policy: a plugin never
//! chooses.

use std::ffi::{CStr, CString};

use llama_cpp_sys_2 as sys;

use super::{backend, Error, Result};

/// What kind of device ggml says it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU backend.
    Cpu,
    /// A discrete GPU.
    Gpu,
    /// A GPU that shares the host's memory.
    IntegratedGpu,
    /// An accelerator ggml uses beside the CPU (BLAS, say); layers are not offloaded to it.
    Accelerator,
    /// A device type this llamabox does not know.
    Other,
}

impl DeviceKind {
    /// Whether model layers can be offloaded to it (a GPU of either kind).
    pub fn is_gpu(self) -> bool {
        matches!(self, Self::Gpu | Self::IntegratedGpu)
    }
}

/// One device, as ggml's device registry lists it.
#[derive(Clone, Debug)]
pub struct Device {
    /// ggml's name (`CPU`, `Vulkan0`, …): what `Offload::device` names.
    pub name: String,
    /// The driver's description (`llvmpipe (LLVM 15.0.6, 256 bits)`, `NVIDIA H200`, …).
    pub description: String,
    /// What kind of device it is.
    pub kind: DeviceKind,
    /// Bytes of its memory free when it was listed, as the driver reports them.
    pub memory_free: u64,
    /// Bytes of memory it has in all.
    pub memory_total: u64,
}

/// GPU backends built into this binary.
pub fn gpu_backends() -> &'static [&'static str] {
    if cfg!(feature = "vulkan") {
        &["Vulkan"]
    } else {
        &[]
    }
}

/// Every device ggml found, in its order (GPUs first, then the CPU).
pub fn devices() -> Vec<Device> {
    backend::init();
    // SAFETY: the registry is initialised (`backend::init`) and never shrinks; indices
    // below `ggml_backend_dev_count()` name live devices.
    let count = unsafe { sys::ggml_backend_dev_count() };
    (0..count)
        .filter_map(|i| {
            // SAFETY: `i` is below the count read above.
            let dev = unsafe { sys::ggml_backend_dev_get(i) };
            // SAFETY: `dev` is null or a live device of the registry.
            unsafe { device(dev) }
        })
        .collect()
}

/// # Safety
///
/// `dev` must be null or a device of ggml's registry (they live as long as the process).
unsafe fn device(dev: sys::ggml_backend_dev_t) -> Option<Device> {
    if dev.is_null() {
        return None;
    }
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            return String::new();
        }
        // SAFETY: ggml returns NUL-terminated strings owned by the device (or null, above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    // SAFETY: a live device (this function's contract); the getters only read it, and
    // `ggml_backend_dev_memory` writes the two integers it is given.
    unsafe {
        let (mut free, mut total) = (0usize, 0usize);
        sys::ggml_backend_dev_memory(dev, &mut free, &mut total);
        let kind = match sys::ggml_backend_dev_type(dev) {
            sys::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
            sys::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
            sys::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
            sys::GGML_BACKEND_DEVICE_TYPE_ACCEL => DeviceKind::Accelerator,
            _ => DeviceKind::Other,
        };
        Some(Device {
            name: text(sys::ggml_backend_dev_name(dev)),
            description: text(sys::ggml_backend_dev_description(dev)),
            kind,
            memory_free: free as u64,
            memory_total: total as u64,
        })
    }
}

/// Where a model's layers go: host policy, set by whoever loads the model (the
/// embedder, `llamabox run`/`serve` flags, serve's config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offload {
    /// Layers on the GPU: `None` for all of them when there is a GPU (none otherwise),
    /// 0 to keep the model on the CPU.
    pub gpu_layers: Option<u32>,
    /// The GPU, by ggml's device name (`Vulkan0`): `None` for the first GPU.
    pub device: Option<String>,
}

/// What an [`Offload`] resolved to on this machine.
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    /// The GPU the layers go to, if any layer does.
    pub device: Option<sys::ggml_backend_dev_t>,
    /// Layers asked for on it (llama.cpp caps it at the model's layers + output).
    pub gpu_layers: i32,
    /// Its name, for errors and `Model::device`.
    pub device_name: Option<String>,
}

impl Offload {
    /// Whether this machine can do it: an unknown device, or GPU layers asked of a
    /// build or machine without a GPU, is an error naming the GPUs there are.
    pub fn check(&self) -> Result<()> {
        self.place().map(drop)
    }

    /// The device and layer count for llama.cpp's model params; an unknown or non-GPU
    /// device is an error naming the GPUs there are.
    pub(crate) fn place(&self) -> Result<Placement> {
        backend::init();
        let cpu_only = Placement { device: None, gpu_layers: 0, device_name: None };
        let gpus: Vec<String> =
            devices().into_iter().filter(|d| d.kind.is_gpu()).map(|d| d.name).collect();
        // A device is checked even with 0 layers: a misspelt name is never silently ignored.
        if let Some(name) = self.device.as_ref().filter(|name| !gpus.contains(name)) {
            let there = if gpus.is_empty() {
                "none in this build and machine".to_string()
            } else {
                gpus.join(", ")
            };
            return Err(Error::InvalidArgument(format!("no GPU named {name:?} (GPUs: {there})")));
        }
        if self.gpu_layers == Some(0) {
            return Ok(cpu_only);
        }
        let name = match &self.device {
            Some(name) => name.clone(),
            None => match gpus.into_iter().next() {
                Some(first) => first,
                None if self.gpu_layers.is_some() => {
                    return Err(Error::InvalidArgument(
                        "GPU layers were asked for, but this build and machine have no GPU".into(),
                    ));
                }
                None => return Ok(cpu_only),
            },
        };
        let c_name = CString::new(name.as_str())
            .map_err(|_| Error::InvalidArgument("device name contains a NUL byte".into()))?;
        // SAFETY: a NUL-terminated name; the registry is initialised; returns a live device or null.
        let dev = unsafe { sys::ggml_backend_dev_by_name(c_name.as_ptr()) };
        if dev.is_null() {
            return Err(Error::Backend(format!(
                "ggml lists {name:?} but does not find it by name"
            )));
        }
        let gpu_layers = self.gpu_layers.map_or(i32::MAX, |n| i32::try_from(n).unwrap_or(i32::MAX));
        Ok(Placement { device: Some(dev), gpu_layers, device_name: Some(name) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_is_always_a_device_and_an_unknown_gpu_is_refused_by_name() {
        let all = devices();
        assert!(all.iter().any(|d| d.kind == DeviceKind::Cpu), "{all:?}");
        let err =
            Offload { gpu_layers: None, device: Some("NoSuchGpu7".into()) }.place().unwrap_err();
        assert!(err.to_string().contains("no GPU named \"NoSuchGpu7\""), "{err}");
        let cpu = Offload { gpu_layers: Some(0), device: None }.place().unwrap();
        assert_eq!(
            (cpu.device, cpu.gpu_layers),
            (None, 0),
            "0 layers: the CPU alone, whatever GPUs there are"
        );
        if all.iter().all(|d| !d.kind.is_gpu()) {
            assert_eq!(
                Offload::default().place().unwrap().device,
                None,
                "no GPU: the default is the CPU"
            );
            assert!(
                Offload { gpu_layers: Some(4), device: None }.place().is_err(),
                "layers asked of no GPU"
            );
        }
    }
}
