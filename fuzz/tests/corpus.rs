//! Every committed input (the seeds in `corpus/<target>/` and the crashes fixed since in `crashes/<target>/`) runs
//! through its target without AFL, so a fixed crash stays fixed under plain `cargo test`.

use std::path::Path;

use strata_fuzz::{CountingAlloc, TARGETS};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn every_committed_input_runs_cleanly() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, target) in TARGETS {
        let mut seeds = 0;
        for dir in [root.join("corpus").join(name), root.join("crashes").join(name)] {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries {
                let path = entry?.path();
                if path.is_file() {
                    target(&std::fs::read(&path)?);
                    seeds += usize::from(path.starts_with(root.join("corpus")));
                }
            }
        }
        assert!(seeds > 0, "{name} has no seeds in corpus/{name}");
    }
    Ok(())
}
