//! AFL++ entry of the `openai_request` fuzz target (see `strata_fuzz::openai_request`).

#[global_allocator]
static ALLOC: strata_fuzz::CountingAlloc = strata_fuzz::CountingAlloc;

fn main() {
    afl::fuzz!(|data: &[u8]| strata_fuzz::openai_request(data));
}
