//! Crafted GGUF and safetensors files with counts, lengths, dimensions and offsets at and past their limits: the
//! loaders refuse them with an error that names the problem, and never allocate more than a small multiple of the
//! file's size (`reader_alloc_limit`; an allocation past it aborts this test binary).

use anyhow::Result;
use strata_engine::loader::gguf::GgufSource;
use strata_engine::loader::hf::HfSource;
use strata_engine::testing::alloc::{CountingAlloc, reader_alloc_limit, with_alloc_limit};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// A GGUF file written field by field.
struct Gguf(Vec<u8>);

impl Gguf {
    fn new(n_tensors: u64, n_kv: u64) -> Self {
        Gguf(b"GGUF".to_vec()).u32(3).u64(n_tensors).u64(n_kv)
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn str(self, s: &str) -> Self {
        let mut g = self.u64(s.len() as u64);
        g.0.extend(s.as_bytes());
        g
    }
    fn zeros(mut self, n: usize) -> Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

/// Opens `bytes` as a GGUF file under the allocation limit; returns the error text (empty when it opened) and the
/// peak allocated.
fn open_gguf(bytes: &[u8]) -> Result<(String, usize)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("crafted.gguf");
    std::fs::write(&path, bytes)?;
    let (opened, peak) = with_alloc_limit(reader_alloc_limit(bytes.len()), || GgufSource::open(&path));
    Ok((opened.err().map(|e| e.to_string()).unwrap_or_default(), peak))
}

fn assert_refused(bytes: &[u8], expected: &str, max_peak: usize) -> Result<()> {
    let (err, peak) = open_gguf(bytes)?;
    assert!(err.contains(expected), "expected an error with {expected:?}, got {err:?}");
    assert!(peak <= max_peak, "{expected}: allocated {peak} bytes for a {} byte file", bytes.len());
    Ok(())
}

const MIB: usize = 1 << 20;
/// Bytes the loader may hold whatever the file (paths, the error message, an empty map).
const FIXED: usize = 16 << 10;

#[test]
fn tensor_counts_beyond_what_the_file_holds_are_refused_before_allocating() -> Result<()> {
    // One entry more than the rest of the file holds (the metadata count's 8 bytes follow the tensor count).
    for n in [u64::MAX, 1 << 40, ((MIB + 8) / 24 + 1) as u64] {
        assert_refused(&Gguf::new(n, 0).zeros(MIB).0, "tensor count", FIXED)?;
    }
    // At the limit (every entry an empty name, no dimensions, f32 at offset 0) the directory is read, in a few
    // times the file's size, and the file then lacks metadata.
    let g = Gguf::new((MIB / 24) as u64, 0).zeros(MIB + 64);
    let (err, peak) = open_gguf(&g.0)?;
    assert!(err.contains("architecture"), "{err}");
    assert!(peak <= 4 * g.0.len() + FIXED, "allocated {peak} for {} bytes", g.0.len());
    Ok(())
}

#[test]
fn metadata_counts_beyond_what_the_file_holds_are_refused() -> Result<()> {
    for n in [u64::MAX, (MIB / 13 + 1) as u64] {
        assert_refused(&Gguf::new(0, n).zeros(MIB).0, "metadata count", FIXED)?;
    }
    // Each fits alone, not both together.
    let g = Gguf::new((MIB / 24) as u64, (MIB / 13) as u64).zeros(MIB);
    assert_refused(&g.0, "cannot fit in the file", FIXED)
}

#[test]
fn string_lengths_beyond_the_file_are_refused() -> Result<()> {
    let left = MIB;
    for n in [u64::MAX, left as u64 + 1] {
        assert_refused(&Gguf::new(0, 1).u64(n).zeros(left).0, "string byte count", FIXED)?;
    }
    Ok(())
}

#[test]
fn array_lengths_are_bounded_by_their_element_size() -> Result<()> {
    let g = |inner: u32, n: u64| Gguf::new(0, 1).str("a").u32(9).u32(inner).u64(n).zeros(MIB);
    // u64 (type 10) elements take 8 bytes each, so a count of a byte per element is refused, not allocated.
    assert_refused(&g(10, (MIB / 8 + 1) as u64).0, "array element count", FIXED)?;
    assert_refused(&g(0, u64::MAX).0, "array element count", FIXED)?;
    assert_refused(&g(8, (MIB / 8 + 1) as u64).0, "array element count", FIXED)?;
    assert_refused(&g(99, 1).0, "unknown array element type 99", FIXED)?;
    // Nested arrays: 12 bytes each (type and count).
    assert_refused(&g(9, (MIB / 12 + 1) as u64).0, "array element count", FIXED)?;
    // At the limit: a byte per element, each a 32-byte value, the worst case the allocation limit allows for.
    let full = g(0, MIB as u64);
    let (err, peak) = open_gguf(&full.0)?;
    assert!(err.contains("architecture"), "{err}");
    assert!(peak >= 32 * MIB && peak <= 33 * full.0.len() + FIXED, "allocated {peak} for {} bytes", full.0.len());
    // Arrays of arrays of arrays of arrays are refused, whatever their counts.
    let nested = Gguf::new(0, 1).str("a").u32(9).u32(9).u64(1).u32(9).u64(1).u32(9).u64(1).u32(9).u64(1).zeros(64);
    assert_refused(&nested.0, "nested too deeply", FIXED)?;
    Ok(())
}

/// A file with one tensor `t` of type f32 with `dims` at `offset`, and `data` bytes after the directory.
fn one_tensor(dims: &[u64], offset: u64, data: usize) -> Vec<u8> {
    let mut g = Gguf::new(1, 0).str("t").u32(dims.len() as u32);
    for &d in dims {
        g = g.u64(d);
    }
    g.u32(0).u64(offset).zeros(data).0
}

#[test]
fn dimensions_whose_product_overflows_are_refused() -> Result<()> {
    // The element count overflows; then the count fits but its bytes (4 per f32) do not.
    for dims in [&[1 << 32, 1 << 32, 4][..], &[1 << 62], &[1 << 61, 2]] {
        assert_refused(&one_tensor(dims, 0, 64), "invalid shape", FIXED)?;
    }
    assert_refused(&one_tensor(&[1, 1, 1, 1, 1], 0, 64), "5 dimensions", FIXED)?;
    Ok(())
}

#[test]
fn tensors_beyond_the_end_of_the_file_are_refused() -> Result<()> {
    for offset in [u64::MAX, u64::MAX - 31, 1 << 40] {
        assert_refused(&one_tensor(&[4], offset, 64), "beyond the end of the file", FIXED)?;
    }
    // 16 bytes of data start at the aligned end of the directory: a 4 x f32 tensor fits exactly at offset 0 and
    // not one byte later.
    let exact = one_tensor(&[4], 0, 0);
    let padded = exact.len().div_ceil(32) * 32 + 16;
    let mut fits = exact.clone();
    fits.resize(padded, 0);
    let (err, _) = open_gguf(&fits)?;
    assert!(!err.contains("beyond the end"), "{err}");
    let mut short = fits.clone();
    short.pop();
    assert_refused(&short, "beyond the end of the file", FIXED)
}

/// A Hugging Face directory with a valid tiny config and `weights` as `model.safetensors`; the error text (empty
/// when it opened) and the peak allocated.
fn open_hf(weights: &[u8]) -> Result<(String, usize)> {
    let dir = tempfile::tempdir()?;
    let config = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":2,"vocab_size":4}"#;
    std::fs::write(dir.path().join("config.json"), config)?;
    std::fs::write(dir.path().join("model.safetensors"), weights)?;
    let limit = reader_alloc_limit(weights.len() + config.len());
    let (opened, peak) = with_alloc_limit(limit, || HfSource::open(dir.path()));
    Ok((opened.err().map(|e| e.to_string()).unwrap_or_default(), peak))
}

fn safetensors(header: &str, data: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header.as_bytes());
    b.resize(b.len() + data, 0);
    b
}

#[test]
fn safetensors_headers_at_their_limits_are_refused() -> Result<()> {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        // Header lengths: absurd, and one past the file.
        ([u64::MAX.to_le_bytes().to_vec(), vec![b'{'; 64]].concat(), "header"),
        ([65u64.to_le_bytes().to_vec(), vec![b' '; 64]].concat(), "header"),
        (
            safetensors(r#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,16]}}"#, 16),
            "overflow",
        ),
        (safetensors(r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,18446744073709551615]}}"#, 16), ""),
        (safetensors(r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}"#, 16), ""),
        (safetensors(r#"{"t":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#, 16), "I64"),
    ];
    for (bytes, expected) in cases {
        let (err, peak) = open_hf(&bytes)?;
        assert!(!err.is_empty() && err.contains(expected), "expected an error with {expected:?}, got {err:?}");
        assert!(peak <= 4 * bytes.len() + FIXED, "{err}: allocated {peak} for {} bytes", bytes.len());
    }
    Ok(())
}

#[test]
fn many_safetensors_entries_cost_a_small_multiple_of_the_header() -> Result<()> {
    // As many tensors as a 1 MiB header holds, each empty.
    let entry = |i: usize| format!(r#""t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}"#);
    let mut header = String::from("{");
    let mut i = 0;
    while header.len() < MIB {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&entry(i));
        i += 1;
    }
    header.push('}');
    let bytes = safetensors(&header, 0);
    let (err, peak) = open_hf(&bytes)?;
    assert!(err.is_empty(), "{err}");
    // Measured: 14.5 times (each ~55-byte entry is a name, shape and offsets in the safetensors crate's map, a view,
    // and an entry in strata's index); the readers' limit is 64 times.
    assert!(peak <= 16 * bytes.len() + FIXED, "allocated {peak} for {} bytes", bytes.len());
    Ok(())
}
