//! AFL++ entry of the `safetensors_header` fuzz target (see `strata_fuzz::safetensors_header`).

#[global_allocator]
static ALLOC: strata_fuzz::CountingAlloc = strata_fuzz::CountingAlloc;

fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::safetensors_header(data));
}
