//! Turning `strata-kernels`' sources into loaded CUDA functions at start: NVRTC compiles each module for the
//! device's compute capability, the PTX is cached on disk under a key of everything that shapes it, and every
//! entry point in [`strata_kernels::MODULES`] is resolved before the first batch, so a missing kernel fails the
//! start instead of a launch.
//!
//! The host-side parts (source preparation, cache keys, include discovery, the list of names to resolve) are
//! plain functions so they are tested without a GPU.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use strata_kernels::{COMMON_HEADER, COMMON_HEADER_NAME, KernelModule, MODULES, requires_sm80};

use crate::{Error, Result};

/// NVRTC options besides the architecture and include paths; they match `kernels/nvrtc_compile.py` (CI) so
/// what CI compiles is what runs: no fast-math (precise `expf`/`sincosf`), FMA contraction on.
pub const NVRTC_OPTIONS: &[&str] = &["-std=c++17", "--fmad=true"];

/// A compute capability, `(major, minor)`.
pub type Arch = (u32, u32);

/// The source NVRTC compiles for `module`: the shared header pasted in place of its `#include`, so no
/// include path is needed for it (NVRTC still needs the CUDA headers, see [`find_cuda_include`]).
pub fn prepared_source(module: &KernelModule) -> String {
    let header: String = COMMON_HEADER.lines().filter(|l| l.trim() != "#pragma once").flat_map(|l| [l, "\n"]).collect();
    let include = format!("#include \"{COMMON_HEADER_NAME}\"");
    let mut out = String::with_capacity(module.source.len() + header.len());
    for line in module.source.lines() {
        if line.trim() == include {
            out.push_str(&header);
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// NVRTC's option list for `arch` (PTX for the virtual architecture; the driver finishes it at load).
pub fn nvrtc_options(arch: Arch, include_dirs: &[PathBuf]) -> Vec<String> {
    let mut opts = vec![format!("--gpu-architecture=compute_{}{}", arch.0, arch.1)];
    opts.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    opts.extend(include_dirs.iter().map(|d| format!("--include-path={}", d.display())));
    opts
}

/// 64-bit FNV-1a: a stable hash (unlike `std`'s, which may change between Rust releases) for cache keys.
fn fnv1a(mut h: u64, data: &[u8]) -> u64 {
    for &b in data {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache file name of `module`'s PTX: `<module>-sm<XY>-<hash>.ptx`, the hash covering the prepared source
/// and the options that shape the code (include paths excluded: they locate headers, they do not change them
/// for one CUDA version, and a moved toolkit should not invalidate the cache).
pub fn cache_file_name(module: &KernelModule, arch: Arch) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325;
    for part in [prepared_source(module).as_str(), &format!("compute_{}{}", arch.0, arch.1)]
        .into_iter()
        .chain(NVRTC_OPTIONS.iter().copied())
    {
        h = fnv1a(h, part.as_bytes());
        h = fnv1a(h, &[0]);
    }
    format!("{}-sm{}{}-{h:016x}.ptx", module.name, arch.0, arch.1)
}

/// The kernel cache directory: `$XDG_CACHE_HOME/strata/kernels`, else `$HOME/.cache/strata/kernels`.
/// `env` looks a variable up (the binaries pass `std::env::var`), so this stays testable.
pub fn default_cache_dir(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let base = match env("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(env("HOME").filter(|v| !v.is_empty())?).join(".cache"),
    };
    Some(base.join("strata").join("kernels"))
}

/// Directories to search for `cuda_fp16.h`, in order: `$STRATA_CUDA_INCLUDE`, `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, `/usr/local/cuda/include`, `/usr/include`. Only existing ones holding the header are
/// returned.
pub fn find_cuda_include(env: impl Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(d) = env("STRATA_CUDA_INCLUDE") {
        candidates.push(PathBuf::from(d));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = env(var) {
            candidates.push(Path::new(&d).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.push(PathBuf::from("/usr/include"));
    let mut found: Vec<PathBuf> = Vec::new();
    for c in candidates {
        if c.join("cuda_fp16.h").is_file() && !found.contains(&c) {
            found.push(c);
        }
    }
    found
}

/// Every `(module, function)` the backend resolves on a device of `arch`: all of them, less the bf16
/// kernels below sm_80 (they are compiled out there).
pub fn functions_to_resolve(arch: Arch) -> Vec<(&'static KernelModule, &'static str)> {
    let bf16 = arch.0 >= 8;
    MODULES
        .iter()
        .flat_map(|m| m.functions.iter().map(move |f| (m, *f)))
        .filter(|(_, f)| bf16 || !requires_sm80(f))
        .collect()
}

/// The loaded kernels, by name.
pub struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
    // Modules stay loaded as long as their functions are used.
    _modules: Vec<Arc<CudaModule>>,
}

impl Kernels {
    /// Compiles (or reads from `cache_dir`) every module for `arch`, loads it and resolves every name.
    pub fn load(
        ctx: &Arc<CudaContext>,
        arch: Arch,
        cache_dir: Option<&Path>,
        include_dirs: &[PathBuf],
    ) -> Result<Self> {
        let mut modules = Vec::with_capacity(MODULES.len());
        let mut functions = HashMap::new();
        for m in MODULES {
            let module = load_module(ctx, m, arch, cache_dir, include_dirs)?;
            for (_, name) in functions_to_resolve(arch).into_iter().filter(|(owner, _)| owner.name == m.name) {
                let f = module.load_function(name).map_err(|e| {
                    Error::Device(format!("kernel {name} is missing from the compiled module {}: {e}", m.name))
                })?;
                functions.insert(name, f);
            }
            modules.push(module);
        }
        Ok(Kernels { functions, _modules: modules })
    }

    /// The function `name`; an error (not a panic) for names that were not resolved.
    pub fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| {
            Error::Device(format!("kernel {name} is not available on this device (bf16 kernels need sm_80+)"))
        })
    }

    /// Number of resolved functions.
    pub fn len(&self) -> usize {
        self.functions.len()
    }
}

fn load_module(
    ctx: &Arc<CudaContext>,
    m: &KernelModule,
    arch: Arch,
    cache_dir: Option<&Path>,
    include_dirs: &[PathBuf],
) -> Result<Arc<CudaModule>> {
    let cached = cache_dir.map(|d| d.join(cache_file_name(m, arch)));
    if let Some(path) = &cached
        && let Ok(ptx) = std::fs::read_to_string(path)
    {
        match ctx.load_module(Ptx::from_src(ptx)) {
            Ok(module) => return Ok(module),
            // A PTX from a newer NVRTC than this driver accepts: recompile with the local NVRTC.
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cached kernel PTX does not load; recompiling")
            }
        }
    }
    let ptx = compile(m, arch, include_dirs)?;
    if let Some(path) = &cached
        && let Err(e) = write_atomically(path, &ptx)
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot cache kernel PTX; continuing without");
    }
    ctx.load_module(Ptx::from_src(ptx))
        .map_err(|e| Error::Device(format!("CUDA driver rejected the PTX of kernel module {}: {e}", m.name)))
}

fn compile(m: &KernelModule, arch: Arch, include_dirs: &[PathBuf]) -> Result<String> {
    if include_dirs.is_empty() {
        return Err(Error::Device(
            "CUDA headers (cuda_fp16.h) not found for compiling the kernels: set STRATA_CUDA_INCLUDE or CUDA_HOME"
                .into(),
        ));
    }
    // SAFETY: only probes whether the NVRTC shared library can be opened; cudarc would panic on first use
    // without it, so the check turns that into an error.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Device(
            "NVRTC (libnvrtc.so) not found: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and put its lib \
             directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let opts = CompileOptions {
        options: nvrtc_options(arch, include_dirs),
        name: Some(format!("{}.cu", m.name)),
        ..CompileOptions::default()
    };
    let started = std::time::Instant::now();
    let ptx = compile_ptx_with_opts(prepared_source(m), opts)
        .map_err(|e| Error::Device(format!("NVRTC failed on kernel module {}: {e}", m.name)))?;
    tracing::info!(module = m.name, ms = started.elapsed().as_millis() as u64, "compiled kernels with NVRTC");
    Ok(ptx.to_src())
}

/// Writes under a temporary name and renames into place, so concurrent workers never read a partial file.
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_pasted_once_without_pragma_once() {
        for m in MODULES {
            let src = prepared_source(m);
            assert!(!src.contains("#include \"common.cuh\""), "{}", m.name);
            assert!(!src.contains("#pragma once"), "{}", m.name);
            assert_eq!(src.matches("#define STRATA_WARP 32").count(), 1, "{}", m.name);
            assert!(src.contains("#include <cuda_fp16.h>"), "the CUDA headers still come from the include path");
        }
    }

    #[test]
    fn cache_names_change_with_source_and_arch_only() {
        let a = cache_file_name(&strata_kernels::NORM, (9, 0));
        assert!(a.starts_with("norm-sm90-") && a.ends_with(".ptx"), "{a}");
        assert_eq!(a, cache_file_name(&strata_kernels::NORM, (9, 0)), "stable");
        assert_ne!(a, cache_file_name(&strata_kernels::NORM, (8, 0)));
        let mut edited = strata_kernels::NORM;
        edited.source = "// changed\n";
        assert_ne!(a, cache_file_name(&edited, (9, 0)));
        let names: std::collections::HashSet<_> = MODULES.iter().map(|m| cache_file_name(m, (9, 0))).collect();
        assert_eq!(names.len(), MODULES.len());
    }

    #[test]
    fn options_match_the_ci_compile() {
        let opts = nvrtc_options((9, 0), &[PathBuf::from("/cuda/include")]);
        assert_eq!(
            opts,
            ["--gpu-architecture=compute_90", "-std=c++17", "--fmad=true", "--include-path=/cuda/include"]
        );
        let ci = include_str!("../../../../kernels/nvrtc_compile.py");
        for o in NVRTC_OPTIONS {
            assert!(ci.contains(&format!("\"{o}\"")), "CI compiles without {o}");
        }
    }

    #[test]
    fn cache_dir_follows_xdg_then_home() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(
            default_cache_dir(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some("/x/strata/kernels".into())
        );
        assert_eq!(default_cache_dir(env(&[("HOME", "/h")])), Some("/h/.cache/strata/kernels".into()));
        assert_eq!(default_cache_dir(env(&[])), None);
    }

    #[test]
    fn include_search_keeps_only_dirs_with_the_header() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let inc = dir.path().join("include");
        std::fs::create_dir_all(&inc)?;
        std::fs::write(inc.join("cuda_fp16.h"), "")?;
        let home = dir.path().to_string_lossy().into_owned();
        let found = find_cuda_include(|k| (k == "CUDA_HOME").then(|| home.clone()));
        assert_eq!(found.first(), Some(&inc));
        let none = find_cuda_include(|k| (k == "STRATA_CUDA_INCLUDE").then(|| "/nonexistent".to_string()));
        assert!(!none.contains(&PathBuf::from("/nonexistent")));
        Ok(())
    }

    #[test]
    fn every_listed_kernel_is_resolved_and_bf16_only_from_sm80() {
        let all: usize = MODULES.iter().map(|m| m.functions.len()).sum();
        assert_eq!(functions_to_resolve((9, 0)).len(), all);
        let old = functions_to_resolve((7, 5));
        assert!(old.iter().all(|(_, f)| !f.ends_with("bf16")));
        assert_eq!(old.len(), all - MODULES.iter().flat_map(|m| m.functions).filter(|f| requires_sm80(f)).count());
        for (m, f) in functions_to_resolve((8, 0)) {
            assert!(m.functions.contains(&f));
        }
    }

    #[test]
    fn cache_writes_are_atomic_renames() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("a/b/norm-sm90-0.ptx");
        write_atomically(&path, "ptx")?;
        assert_eq!(std::fs::read_to_string(&path)?, "ptx");
        let leftovers = std::fs::read_dir(path.parent().unwrap_or(dir.path()))?.count();
        assert_eq!(leftovers, 1, "no temporary file is left behind");
        Ok(())
    }
}
