//! The compute device a user names (`cpu` or `cuda:N`) and opening it: [`DeviceSpec`] says what to open,
//! [`on_device`] builds the backend and runs an [`OnBackend`] visitor with it, since model code is generic
//! over the backend type. Shared by the stage worker and the CLI.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::backend::Backend;
use crate::backend::cpu::{CpuBackend, CpuIsa};
use crate::dtype::FloatDtype;

/// The compute device, written `cpu` or `cuda:N` (`cuda` alone is `cuda:0`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Device {
    /// The CPU backend.
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(u32),
}

impl Device {
    /// An error for a `cuda:N` device in a build without the `cuda` feature, so a config can be refused before
    /// anything is loaded.
    pub fn check_compiled(self) -> Result<(), Error> {
        match self {
            Device::Cuda(_) if !cfg!(feature = "cuda") => Err(Error::CudaNotCompiled { device: self.to_string() }),
            _ => Ok(()),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.trim().to_ascii_lowercase();
        if lower == "cpu" {
            return Ok(Device::Cpu);
        }
        let ordinal = if lower == "cuda" { Some("0") } else { lower.strip_prefix("cuda:") };
        match ordinal.map(str::parse) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(Error::InvalidValue { what: "device", value: s.into(), expected: "cpu or cuda:N" }),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl From<Device> for String {
    fn from(d: Device) -> Self {
        d.to_string()
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What opening a device needs (a worker takes it from its config; `strata generate`/`bench` from flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSpec {
    /// The device.
    pub device: Device,
    /// CPU threads (0: one per core); CPU only.
    pub threads: usize,
    /// The CPU kernels' instruction set; CPU only.
    pub cpu_isa: CpuIsa,
    /// Float weight type; on a GPU also the activation type (default bf16, f16 before sm_80).
    pub dtype: Option<FloatDtype>,
    /// Device memory limit in bytes; GPU only.
    pub gpu_memory_limit: Option<u64>,
}

/// Work to run with an opened backend, whatever its type.
pub trait OnBackend {
    /// What the work produces.
    type Out;
    /// The caller's error type; failing to open the device is one of them.
    type Error: From<Error>;
    /// Runs the work on `backend`.
    fn run<B: Backend>(self, backend: Arc<B>) -> Result<Self::Out, Self::Error>;
}

/// Opens the device `spec` names and runs `work` on it. A `cuda:N` device in a build without the `cuda`
/// feature is an error, as is a machine without an NVIDIA driver.
pub fn on_device<W: OnBackend>(spec: &DeviceSpec, work: W) -> Result<W::Out, W::Error> {
    match spec.device {
        Device::Cpu => work.run(Arc::new(CpuBackend::with_isa(spec.threads, spec.cpu_isa)?)),
        Device::Cuda(n) => run_cuda(spec, n, work),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda<W: OnBackend>(spec: &DeviceSpec, ordinal: u32, work: W) -> Result<W::Out, W::Error> {
    use crate::backend::cuda::{CudaBackend, CudaOptions};
    let memory_limit = spec.gpu_memory_limit.map(usize::try_from).transpose().map_err(|_| Error::InvalidValue {
        what: "gpu_memory_limit",
        value: spec.gpu_memory_limit.unwrap_or_default().to_string(),
        expected: "a size that fits this platform's address space",
    })?;
    // The kernel cache and CUDA header locations follow the usual variables (XDG_CACHE_HOME, CUDA_HOME, ...).
    let opts = CudaOptions {
        act_dtype: spec.dtype.map(FloatDtype::to_engine),
        memory_limit,
        ..CudaOptions::from_env(ordinal as usize, |k| std::env::var(k).ok())
    };
    work.run(Arc::new(CudaBackend::new(opts)?))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<W: OnBackend>(spec: &DeviceSpec, _ordinal: u32, _work: W) -> Result<W::Out, W::Error> {
    Err(Error::CudaNotCompiled { device: spec.device.to_string() }.into())
}

/// Parses a byte count as operators write it: `1073741824`, `800M`, `40Gi` (K, M, G are powers of 1000; Ki, Mi,
/// Gi of 1024).
pub fn parse_bytes(s: &str) -> crate::Result<u64> {
    let bad = || Error::InvalidValue {
        what: "byte count",
        value: s.to_owned(),
        expected: "a number of bytes, optionally with a suffix K, M, G, Ki, Mi or Gi (e.g. 800Mi)",
    };
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let mult: u64 = match suffix.trim() {
        "" => 1,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_take_decimal_and_binary_suffixes() {
        assert_eq!(parse_bytes("1024").ok(), Some(1024));
        assert_eq!(parse_bytes(" 800Mi ").ok(), Some(800 << 20));
        assert_eq!(parse_bytes("2Gi").ok(), Some(2 << 30));
        assert_eq!(parse_bytes("3G").ok(), Some(3_000_000_000));
        for bad in ["", "Gi", "1.5Gi", "4Ti", "-1", "99999999999999999999"] {
            assert!(parse_bytes(bad).is_err_and(|e| e.to_string().contains("byte count")), "{bad:?}");
        }
        assert!(parse_bytes("18446744073709551615Gi").is_err(), "overflow");
    }

    #[test]
    fn devices_parse_print_and_serialize() -> Result<(), Box<dyn std::error::Error>> {
        assert_eq!("cpu".parse::<Device>()?, Device::Cpu);
        assert_eq!(" CUDA:1 ".parse::<Device>()?, Device::Cuda(1));
        assert_eq!("cuda".parse::<Device>()?, Device::Cuda(0));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert_eq!(serde_json::to_string(&Device::Cuda(2))?, "\"cuda:2\"");
        assert_eq!(serde_json::from_str::<Device>("\"cpu\"")?, Device::Cpu);
        for bad in ["tpu", "cuda:", "cuda:-1", "cuda:x"] {
            assert!(bad.parse::<Device>().is_err(), "{bad:?}");
        }
        let err = "tpu".parse::<Device>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid device \"tpu\": expected cpu or cuda:N");
        Ok(())
    }

    struct Name;
    impl OnBackend for Name {
        type Out = String;
        type Error = Error;
        fn run<B: Backend>(self, backend: Arc<B>) -> Result<String, Error> {
            Ok(backend.name())
        }
    }

    #[test]
    fn cpu_opens_and_cuda_needs_a_build_and_a_driver() -> Result<(), Error> {
        assert!(on_device(&DeviceSpec { threads: 1, ..DeviceSpec::default() }, Name)?.starts_with("cpu"));
        let gpu = DeviceSpec { device: Device::Cuda(0), ..DeviceSpec::default() };
        match on_device(&gpu, Name) {
            // A machine with a GPU and a cuda build opens it.
            Ok(name) => assert!(name.starts_with("cuda:0")),
            Err(e) if cfg!(feature = "cuda") => assert!(e.to_string().contains("CUDA"), "{e}"),
            Err(e) => {
                assert_eq!(e.to_string(), "device cuda:0: this build has no CUDA support (build with --features cuda)");
                assert!(Device::Cuda(0).check_compiled().is_err());
            }
        }
        assert!(Device::Cpu.check_compiled().is_ok());
        Ok(())
    }
}
