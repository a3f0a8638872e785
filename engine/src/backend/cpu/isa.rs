//! The instruction sets the CPU kernels are built for, and which of them this CPU runs: detected once per
//! backend, passed to every kernel call, never assumed.

/// Which instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
