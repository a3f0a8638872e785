//! AFL++ entry of the `gguf` fuzz target (see `strata_fuzz::gguf`).

#[global_allocator]
static ALLOC: strata_fuzz::CountingAlloc = strata_fuzz::CountingAlloc;

fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::gguf(data));
}
