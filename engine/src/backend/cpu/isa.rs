//! The instruction sets the CPU kernels are built for, and which of them this CPU runs: detected once per
//! backend (or chosen by the operator, [`CpuIsa`]), passed to every kernel call, never assumed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Which instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C with AVX-VNNI: the 8-bit dot products of the quantized kernels as one `vpdpbusd`.
    AvxVnni,
    /// AVX2 + FMA + F16C with AVX-512 F/BW/VL and VNNI: `vpdpbusd`, and two tokens per 512-bit register in the
    /// token tile of batched decode and prefill.
    Avx512Vnni,
}

impl Isa {
    /// The x86-64 instruction sets, in the order [`Isa::detect`] prefers the last one present.
    pub const X86: [Isa; 3] = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

    /// The best instruction set this CPU supports.
    pub fn detect() -> Self {
        Self::X86.into_iter().rev().find(|isa| isa.supported()).unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = || {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            };
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2(),
                Isa::AvxVnni => avx2() && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512Vnni => {
                    avx2()
                        && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// Whether the AVX2 kernels (and so every x86 one) may run: every instruction set but [`Isa::Scalar`].
    pub(super) fn avx2(self) -> bool {
        self != Isa::Scalar
    }

    /// Whether the kernels may use AVX-512 F (with AVX2): [`Isa::Avx512Vnni`].
    pub(super) fn avx512(self) -> bool {
        self == Isa::Avx512Vnni
    }

    /// The name benchmarks and logs print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// The CPU features `self` needs beyond the baseline, for reports of a path this CPU cannot run.
    pub fn needs(self) -> &'static str {
        match self {
            Isa::Scalar => "nothing",
            Isa::Avx2 => "AVX2, FMA and F16C",
            Isa::AvxVnni => "AVX-VNNI",
            Isa::Avx512Vnni => "AVX-512 F/BW/VL and AVX512-VNNI",
        }
    }
}

/// The level an operator asks the CPU backend to run at (`--cpu-isa`): `auto`, the best this CPU has, or one level
/// by its [`Isa::name`], which the CPU must have. Naming a lower level than `auto` would pick measures that level's
/// kernels on this machine (against another engine built for it, say), or steps around one the CPU runs badly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CpuIsa {
    /// [`Isa::detect`].
    #[default]
    Auto,
    /// This level.
    Level(Isa),
}

impl CpuIsa {
    /// What the settings accept, for error messages and help.
    pub const EXPECTED: &'static str = "auto, scalar, avx2, avx-vnni or avx512-vnni";

    /// The level to run at on this CPU: an error naming the missing features when it lacks the one asked for.
    pub fn resolve(self) -> Result<Isa> {
        match self {
            CpuIsa::Auto => Ok(Isa::detect()),
            CpuIsa::Level(isa) if isa.supported() => Ok(isa),
            CpuIsa::Level(isa) => Err(Error::Device(format!(
                "CPU instruction set {} needs {}, which this CPU lacks (the best it has is {})",
                isa.name(),
                isa.needs(),
                Isa::detect().name()
            ))),
        }
    }
}

impl FromStr for CpuIsa {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        if lower == "auto" {
            return Ok(CpuIsa::Auto);
        }
        [Isa::Scalar].into_iter().chain(Isa::X86).find(|isa| isa.name() == lower).map(CpuIsa::Level).ok_or_else(|| {
            Error::InvalidValue { what: "CPU instruction set", value: s.into(), expected: Self::EXPECTED }
        })
    }
}

impl TryFrom<String> for CpuIsa {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<CpuIsa> for String {
    fn from(c: CpuIsa) -> Self {
        c.to_string()
    }
}

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CpuIsa::Auto => "auto",
            CpuIsa::Level(isa) => isa.name(),
        })
    }
}

/// Calls `$m!(module, level constant, target features)` for each level of [`Isa::X86`], in that order: the one
/// list of the features each level's kernel entry points (`simd::x86`, `qgemm::x86`) are compiled with.
#[cfg(target_arch = "x86_64")]
macro_rules! for_each_level {
    ($m:ident) => {
        $m!(avx2, AVX2, "avx2,fma,f16c");
        $m!(avx_vnni, AVX_VNNI, "avx2,fma,f16c,avxvnni");
        $m!(avx512_vnni, AVX512_VNNI, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use for_each_level;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_by_level_name_and_round_trip() {
        assert_eq!("auto".parse::<CpuIsa>().ok(), Some(CpuIsa::Auto));
        assert_eq!(" AVX2 ".parse::<CpuIsa>().ok(), Some(CpuIsa::Level(Isa::Avx2)));
        for isa in [Isa::Scalar].into_iter().chain(Isa::X86) {
            let setting = CpuIsa::Level(isa);
            assert_eq!(setting.to_string().parse::<CpuIsa>().ok(), Some(setting));
        }
        let err = "avx512".parse::<CpuIsa>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid CPU instruction set \"avx512\": expected auto, scalar, avx2, avx-vnni or avx512-vnni");
    }

    #[test]
    fn a_level_resolves_only_where_this_cpu_has_it() {
        assert_eq!(CpuIsa::Auto.resolve().ok(), Some(Isa::detect()));
        assert_eq!(CpuIsa::Level(Isa::Scalar).resolve().ok(), Some(Isa::Scalar));
        for isa in Isa::X86 {
            match CpuIsa::Level(isa).resolve() {
                Ok(got) => assert!(got == isa && isa.supported()),
                Err(e) => {
                    assert!(!isa.supported());
                    assert!(e.to_string().contains(isa.needs()), "{e}");
                }
            }
        }
    }
}
