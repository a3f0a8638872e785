//! Opening a model for the CLI: the device flags, a progress bar on terminals, conversion.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use strata_engine::backend::Backend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, StageModel};
use strata_engine::tokenizer::Tokenizer;
use strata_engine::{CpuIsa, Device, DeviceSpec, FloatDtype, KvDtype, OnBackend, QuantDtype, on_device};

/// Where `generate` and `bench` run, shared by both.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Compute device: cpu or cuda:N (cuda needs a build with --features cuda).
    #[arg(long, env = "STRATA_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Store float weights as this type: f32, f16 or bf16 (on a GPU also the activation type, bf16 by default).
    #[arg(long, env = "STRATA_DTYPE")]
    pub dtype: Option<FloatDtype>,
    /// Quantize float weight matrices to q8_0, q4_0 or q4_1 as they load (llama.cpp's rounding); matrices a GGUF
    /// already stores quantized stay as they are.
    #[arg(long, env = "STRATA_QUANTIZE")]
    pub quantize: Option<QuantDtype>,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0, env = "STRATA_THREADS")]
    pub threads: usize,
    /// Instruction set of the CPU kernels: auto (the best this CPU has), scalar, avx2, avx-vnni or avx512-vnni
    /// (the CPU must have it).
    #[arg(long, env = "STRATA_CPU_ISA", default_value = "auto")]
    pub cpu_isa: CpuIsa,
    /// KV cache type of the engine in this process: f32, f16, bf16 or q8_0 (default: f32 on the CPU, the
    /// activation type on a GPU).
    #[arg(long, env = "STRATA_KV_DTYPE")]
    pub kv_dtype: Option<KvDtype>,
}

impl DeviceArgs {
    /// Opens the device and runs `work` on it.
    pub fn run<W: OnBackend<Out = (), Error = anyhow::Error>>(&self, work: W) -> Result<()> {
        let spec = DeviceSpec {
            device: self.device,
            threads: self.threads,
            cpu_isa: self.cpu_isa,
            dtype: self.dtype,
            gpu_memory_limit: None,
        };
        on_device(&spec, work)
    }

    /// The KV cache type asked for, or `backend`'s own.
    pub fn kv_dtype<B: Backend>(&self, backend: &B) -> KvDtype {
        self.kv_dtype.unwrap_or_else(|| backend.default_kv_dtype())
    }
}

/// A whole model on a device plus its tokenizer (when it has one).
pub struct Loaded<B: Backend> {
    /// All layers.
    pub model: StageModel<B>,
    /// The tokenizer.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

/// Loads every layer of `path` onto `backend`, with the weight types `device` asks for.
pub fn load<B: Backend>(path: &Path, device: &DeviceArgs, backend: Arc<B>, need_tokenizer: bool) -> Result<Loaded<B>> {
    let files = ModelFiles::open(path).with_context(|| format!("opening model {}", path.display()))?;
    let tokenizer = match files.tokenizer() {
        Ok(t) => Some(Arc::new(t)),
        Err(e) if need_tokenizer => return Err(e).context("loading the tokenizer"),
        Err(_) => None,
    };
    let n = files.config().num_layers;
    let bar = std::io::stdout().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(1);
        b.set_style(
            indicatif::ProgressStyle::with_template("loading weights {bar:40} {pos}/{len} tensors")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let progress = |done: usize, total: usize| {
        if let Some(b) = &bar {
            b.set_length(total as u64);
            b.set_position(done as u64);
        }
    };
    let opts = LoadOptions {
        dtype: device.dtype.map(FloatDtype::to_engine),
        quantize: device.quantize.map(QuantDtype::to_engine),
        progress: Some(&progress),
        ..LoadOptions::default()
    };
    let model = StageModel::load(&files, 0..n, backend, &opts)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(Loaded { model, tokenizer })
}

/// Arguments of `strata convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// A `.gguf` file, a Hugging Face directory, or `random:<preset>[:<dtype>]` (seeded random weights; a GGUF of
    /// one gets a stand-in vocabulary of single bytes, so llama.cpp loads it).
    #[arg(long)]
    model: PathBuf,
    /// Output: a directory (`--to hf`) or a `.gguf` file (`--to gguf`).
    #[arg(long)]
    out: PathBuf,
    /// Output format: `hf` (safetensors, dequantized) or `gguf`; default `gguf` when `--out` ends in `.gguf` or
    /// `--quantize` is given, `hf` otherwise.
    #[arg(long, value_enum)]
    to: Option<Format>,
    /// Matrix storage type.
    #[arg(long, default_value = "f32", conflicts_with = "quantize")]
    dtype: FloatDtype,
    /// Quantize float matrices (embeddings and head included) to q8_0, q4_0 or q4_1 as llama.cpp's
    /// `llama-quantize --pure` does; writes GGUF.
    #[arg(long)]
    quantize: Option<QuantDtype>,
}

/// A model file format `strata convert` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// A Hugging Face directory (`config.json`, `model.safetensors`, tokenizer files).
    Hf,
    /// A GGUF file of the model's llama.cpp architecture (`llama`, `qwen2` or `qwen3`).
    Gguf,
}

/// Runs `strata convert`.
pub fn convert(a: ConvertArgs) -> Result<()> {
    let files = ModelFiles::open(&a.model).with_context(|| format!("opening model {}", a.model.display()))?;
    let gguf_out = a.out.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let to = a.to.unwrap_or(if gguf_out || a.quantize.is_some() { Format::Gguf } else { Format::Hf });
    match (to, a.quantize) {
        (Format::Hf, Some(q)) => bail!("safetensors cannot hold {q} blocks: use --to gguf (or leave out --to)"),
        (Format::Hf, None) => strata_engine::convert::to_hf_dir(&files, &a.out, a.dtype.to_engine())?,
        (Format::Gguf, q) => {
            let dtype = q.map_or(a.dtype.to_engine(), QuantDtype::to_engine);
            let report = strata_engine::convert::to_gguf(&files, &a.out, dtype)?;
            if !report.kept_quantized.is_empty() {
                eprintln!(
                    "kept {} already-quantized matrices as they were (strata does not requantize): {}",
                    report.kept_quantized.len(),
                    report.kept_quantized.join(", ")
                );
            }
        }
    }
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
