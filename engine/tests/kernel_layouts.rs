//! The CUDA kernels' block layouts, checked without a GPU: `kernels/quant.cu` (with `common.cuh`) is compiled for
//! the CPU by the system's C++ compiler (`$CXX`, else `c++`), against stand-ins for the CUDA headers in
//! `tests/kernel_host/`, and its layout code runs one lane at a time on random blocks of every format with
//! kernels: each `dequant8` (what `gemm_*`, `dequantize_*` and `embedding_*` read) and the GEMV's unit walk (which
//! element each of a lane's weights meets, and that every element is met once) must give the table's dequantized
//! values exactly. What this cannot check, the GPU check does: the kernels' threads, shuffles, shared memory and
//! the device compiler's FMA contraction (`engine/tests/cuda.rs`).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use rand::{SeedableRng, rngs::StdRng};
use strata_engine::quant::{self, random_blocks};
use strata_engine::testing::CUDA_FORMATS;

fn compile_harness(out: &Path) -> Result<()> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let result = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", "-o"])
        .arg(out)
        .arg("-I")
        .arg(here.join("tests/kernel_host"))
        .arg("-I")
        .arg(here.join("../kernels"))
        .arg(here.join("tests/kernel_host/harness.cpp"))
        .output()
        .with_context(|| format!("running {cxx} (a C++17 compiler; scripts/setup installs g++)"))?;
    ensure!(result.status.success(), "compiling the host harness failed:\n{}", String::from_utf8_lossy(&result.stderr));
    Ok(())
}

fn read_f32(path: &Path) -> Result<Vec<f32>> {
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

#[test]
fn cuda_block_layouts_dequantize_as_the_reference() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let harness = dir.path().join("harness");
    compile_harness(&harness)?;
    let mut rng = StdRng::seed_from_u64(3);
    // Three K-quant super-blocks per row: every unit and group position, several blocks, several rows.
    let (n, k) = (5, 768);
    for dtype in CUDA_FORMATS {
        let f = quant::format(dtype).context("a block format")?;
        let blocks = random_blocks(dtype, n * k / f.block_elems, &mut rng);
        let (w, groups, units) = (dir.path().join("w"), dir.path().join("groups"), dir.path().join("units"));
        std::fs::write(&w, &blocks)?;
        let out = Command::new(&harness)
            .arg(f.name)
            .arg(&w)
            .args([n.to_string(), k.to_string()])
            .args([&groups, &units])
            .output()?;
        ensure!(out.status.success(), "{dtype}: the harness failed: {}", String::from_utf8_lossy(&out.stderr));
        let mut want = vec![0f32; n * k];
        quant::dequantize(dtype, &blocks, &mut want);
        for (what, path) in [("dequant8", &groups), ("the GEMV unit walk", &units)] {
            let got = read_f32(path)?;
            ensure!(got.len() == want.len(), "{dtype} {what}: {} values", got.len());
            // Equal values (a sum with the walk's zero minimum turns -0 into 0), not only close ones.
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                anyhow::bail!(
                    "{dtype} {what}: element {i} (row {}, column {}) is {}, the table says {}",
                    i / k,
                    i % k,
                    got[i],
                    want[i]
                );
            }
        }
    }
    Ok(())
}
