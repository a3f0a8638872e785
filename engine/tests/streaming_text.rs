//! Streaming text stays exact while costing O(new text) per token: the incremental decoder's deltas add up to
//! the decoding of every id (on SmolLM2's real vocabulary, through multi-byte characters split across tokens),
//! and stop-string matching over the tail gives what matching over the whole text gives.

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_engine::generate::StopState;
use strata_engine::loader::ModelFiles;
use strata_engine::tokenizer::IncrementalDecoder;

const CORPUS: &str = "Hello, world! Ünïcödé: naïve café, 日本語のテキスト, emoji 🦀🚀 and math ∑∫√. \
    fn main() {\n    println!(\"{}\", 42);\n}\n\n\tTabs\tand    runs of spaces.   12345 67.89 \
    Ελληνικά кириллица עברית العربية";

#[test]
fn deltas_add_up_to_the_whole_decoding() -> Result<()> {
    let tok = ModelFiles::open(&strata_testkit::smollm2())?.tokenizer()?;
    let ids = tok.encode(CORPUS)?;
    let mut dec = IncrementalDecoder::default();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&dec.push(&tok, id)?);
    }
    assert_eq!(streamed, tok.decode(&ids)?);
    // Random ids, including byte tokens that split characters: whatever is complete at the end matches.
    let mut rng = StdRng::seed_from_u64(5);
    let vocab = tok.vocab_size() as u32;
    for round in 0..20 {
        let ids: Vec<u32> = (0..200).map(|_| rng.random_range(0..vocab.min(49152))).collect();
        let mut dec = IncrementalDecoder::default();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(&tok, id)?);
        }
        let whole = tok.decode(&ids)?;
        if !whole.ends_with('\u{fffd}') {
            assert_eq!(streamed, whole, "round {round}");
        } else {
            assert!(whole.starts_with(&streamed), "round {round}");
        }
    }
    Ok(())
}

/// What stop matching must give: the text up to the earliest stop string, and whether one was found.
fn reference(text: &str, stops: &[String]) -> (String, bool) {
    match stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min() {
        Some(cut) => (text[..cut].to_owned(), true),
        None => (text.to_owned(), false),
    }
}

#[test]
fn stop_matching_over_the_tail_equals_matching_over_the_whole_text() {
    let alphabet: Vec<char> = "ab é日🦀\n".chars().collect();
    let mut rng = StdRng::seed_from_u64(9);
    let word = |rng: &mut StdRng, n: usize| -> String {
        (0..n).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect()
    };
    for round in 0..2000 {
        let len = rng.random_range(0..60);
        let text = word(&mut rng, len);
        let count = rng.random_range(0..4);
        let stops: Vec<String> = (0..count)
            .map(|_| {
                let n = rng.random_range(1..5);
                word(&mut rng, n)
            })
            .collect();
        let mut state = StopState::new(stops.clone());
        let (mut out, mut hit) = (String::new(), false);
        let chars: Vec<char> = text.chars().collect();
        let mut i = 0;
        while i < chars.len() && !hit {
            let n = rng.random_range(1..4).min(chars.len() - i);
            let piece: String = chars[i..i + n].iter().collect();
            i += n;
            let (delta, h) = state.push(&piece);
            out.push_str(&delta);
            hit = h;
        }
        if !hit {
            out.push_str(&state.finish().0);
        }
        assert_eq!((out, hit), reference(&text, &stops), "round {round}: {text:?} with {stops:?}");
    }
}
