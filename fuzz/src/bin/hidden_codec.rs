//! AFL++ entry of the `hidden_codec` fuzz target (see `strata_fuzz::hidden_codec`).

#[global_allocator]
static ALLOC: strata_fuzz::CountingAlloc = strata_fuzz::CountingAlloc;

fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::hidden_codec(data));
}
