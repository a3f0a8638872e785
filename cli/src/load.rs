//! Opening a model for the CLI: the device flags, a progress bar on terminals, conversion.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use strata_engine::backend::Backend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, StageModel};
use strata_engine::tensor::DType;
use strata_engine::tokenizer::Tokenizer;
use strata_engine::{Device, DeviceSpec, FloatDtype, OnBackend, on_device};

/// Where `generate` and `bench` run, shared by both.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Compute device: cpu or cuda:N (cuda needs a build with --features cuda).
    #[arg(long, env = "STRATA_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Store float weights as this type: f32, f16 or bf16 (on a GPU also the activation type, bf16 by default).
    #[arg(long, env = "STRATA_DTYPE")]
    pub dtype: Option<FloatDtype>,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0, env = "STRATA_THREADS")]
    pub threads: usize,
}

impl DeviceArgs {
    /// Opens the device and runs `work` on it.
    pub fn run<W: OnBackend<Out = (), Error = anyhow::Error>>(&self, work: W) -> Result<()> {
        let spec = DeviceSpec { device: self.device, threads: self.threads, dtype: self.dtype, gpu_memory_limit: None };
        on_device(&spec, work)
    }
}

/// A whole model on a device plus its tokenizer (when it has one).
pub struct Loaded<B: Backend> {
    /// All layers.
    pub model: StageModel<B>,
    /// The tokenizer.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

/// Loads every layer of `path` onto `backend`.
pub fn load<B: Backend>(path: &Path, dtype: Option<DType>, backend: Arc<B>, need_tokenizer: bool) -> Result<Loaded<B>> {
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
    let opts = LoadOptions { dtype, progress: Some(&progress), ..LoadOptions::default() };
    let model = StageModel::load(&files, 0..n, backend, &opts)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(Loaded { model, tokenizer })
}

/// Arguments of `strata convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// A `.gguf` file.
    #[arg(long)]
    model: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Matrix storage type.
    #[arg(long, default_value = "f32")]
    dtype: FloatDtype,
}

/// Runs `strata convert`.
pub fn convert(a: ConvertArgs) -> Result<()> {
    let files = ModelFiles::open(&a.model).with_context(|| format!("opening model {}", a.model.display()))?;
    if !matches!(files, ModelFiles::Gguf(_)) {
        bail!("{} is not a GGUF file", a.model.display());
    }
    strata_engine::convert::to_hf_dir(&files, &a.out, a.dtype.to_engine())?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
