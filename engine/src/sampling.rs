//! Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, the repetition, presence and
//! frequency penalties, seeded.

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::backend::cpu::exp::{exp_from_max, max_of};
use crate::backend::cpu::simd::Isa;
use crate::{Error, Result};

mod sequences;

pub use sequences::{Draw, SequenceSampler, draw_all};

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    pub top_p: f32,
    /// Seed for reproducible sampling (None: from the OS).
    pub seed: Option<u64>,
    /// Divide positive logits (multiply negative ones) of already-seen tokens by this (1: off).
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the output already holds (OpenAI's; 0: off).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it (OpenAI's; 0: off).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Keep only tokens at least this likely relative to the most likely one, after the temperature (vLLM's and
    /// llama.cpp's min-p; 0: off).
    #[serde(default)]
    pub min_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
        }
    }
}

impl SamplingParams {
    /// Settings as the wire carries them (`strata.v1.SamplingParams`): proto3 cannot tell an unset number from
    /// 0, so 0 turns top-k, top-p and the repetition penalty off (the presence and frequency penalties are off at
    /// 0 anyway: see [`SamplingParams::with_penalties`]). The one conversion from the wire's fields; not validated
    /// (see [`SamplingParams::validate`]).
    pub fn with_zeros_off(
        temperature: f32,
        top_k: u32,
        top_p: f32,
        seed: Option<u64>,
        repetition_penalty: f32,
    ) -> Self {
        SamplingParams {
            temperature,
            // A k beyond the address space keeps every token, as k = 0 does.
            top_k: usize::try_from(top_k).unwrap_or(0),
            top_p: if top_p == 0.0 { 1.0 } else { top_p },
            seed,
            repetition_penalty: if repetition_penalty == 0.0 { 1.0 } else { repetition_penalty },
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
        }
    }

    /// These settings with OpenAI's presence and frequency penalties.
    pub fn with_penalties(self, presence_penalty: f32, frequency_penalty: f32) -> Self {
        SamplingParams { presence_penalty, frequency_penalty, ..self }
    }

    /// These settings with a min-p threshold (0: off).
    pub fn with_min_p(self, min_p: f32) -> Self {
        SamplingParams { min_p, ..self }
    }

    /// Whether they pick the largest logit (temperature 0): a pass over the logits, no draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Rejects values that make no sense.
    pub fn validate(&self) -> Result<()> {
        let invalid = |param: &'static str, message: String| Err(Error::InvalidParam { param, message });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return invalid("temperature", format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return invalid("min_p", format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid("top_p", format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return invalid(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {}", self.repetition_penalty),
            );
        }
        for (name, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return invalid(name, format!("{name} must be in [-2, 2], got {value}"));
            }
        }
        Ok(())
    }
}

/// A sampler with its own random stream (one per sequence). With a seed, the draw for a token depends only on
/// the seed and the token's position, so a sequence recomputed from its prompt and output (after a preemption or
/// a plan change, with a fresh sampler) continues exactly as it would have.
pub struct Sampler {
    params: SamplingParams,
    /// The stream of an unseeded sampler, made at its first draw.
    rng: Option<StdRng>,
}

/// Index of the largest value (the first on ties; NaNs are never larger, so a NaN first value stays the answer).
pub fn argmax(xs: &[f32]) -> u32 {
    // Two passes the compiler turns into vector code, the maximum ([`max_of`], in lanes) and then its first index,
    // instead of one loop whose every step waits on the last: 49,152 SmolLM2 logits in ~5 µs instead of ~40, paid
    // per sampled token.
    match xs.first() {
        None => 0,
        Some(first) if first.is_nan() => 0,
        Some(_) => {
            let top = max_of(xs);
            xs.iter().position(|&x| x == top).unwrap_or(0) as u32
        }
    }
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        Sampler { params, rng: None }
    }

    /// Whether it picks the largest logit ([`SamplingParams::is_greedy`]).
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// Picks a token. `history` holds the prompt and generated ids, which the penalties read, and its length is
    /// the position the seeded draw depends on. Penalties apply in vLLM's order: repetition (prompt and output),
    /// then frequency and presence (output only).
    pub fn sample(&mut self, logits: &mut [f32], history: &TokenHistory) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &id in &history.seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &count) in &history.output_counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= p.frequency_penalty * count as f32 + p.presence_penalty;
                }
            }
        }
        if p.is_greedy() {
            return argmax(logits);
        }
        let cand = candidates(logits, p);
        let draw = match p.seed {
            Some(seed) => position_rng(seed, history.len).random::<f32>(),
            None => self.rng.get_or_insert_with(StdRng::from_os_rng).random::<f32>(),
        };
        match cand {
            Candidates::All(w) => pick_in_blocks(&w, draw),
            Candidates::Kept(kept) => pick(kept.iter().copied(), draw),
        }
    }
}

/// The token at `draw` (in [0, 1)) of the way through the candidates' summed weight, walking them in order.
fn pick(cand: impl Iterator<Item = (u32, f32)> + Clone, draw: f32) -> u32 {
    let total: f32 = cand.clone().map(|c| c.1).sum();
    let (mut r, mut last) = (draw * total, 0);
    for (id, w) in cand {
        if r < w {
            return id;
        }
        r -= w;
        // Rounding can leave `r` past the end: the last token that had weight (min-p zeroes some).
        if w > 0.0 {
            last = id;
        }
    }
    last
}

/// Weights per block of [`pick_in_blocks`].
const PICK_BLOCK: usize = 64;

/// The log-probability of `token` under `logits` (their log-softmax), from a copy of the logits taken before any
/// penalty or temperature: consumed as scratch space for a vectorized `exp`. `None` for a token outside them.
pub fn log_softmax_at(mut logits: Vec<f32>, token: u32) -> Option<f32> {
    let raw = *logits.get(token as usize)?;
    let max = max_of(&logits);
    if !max.is_finite() {
        return Some(raw - max);
    }
    exp_from_max(Isa::detect(), &mut logits);
    Some(raw - max - lane_sum(&logits).ln())
}

/// [`pick`] over every token in vocabulary order, `w` holding each one's weight, without walking the whole
/// vocabulary one dependent addition at a time: the blocks' sums (each summed in independent lanes, which the
/// compiler vectorizes) are walked first, then the block the draw falls in. Over SmolLM2's 49,152 tokens the one
/// long chain of additions and subtractions cost ~60 µs a draw.
fn pick_in_blocks(w: &[f32], draw: f32) -> u32 {
    let sums: Vec<f32> = w.chunks(PICK_BLOCK).map(lane_sum).collect();
    let total: f32 = sums.iter().sum();
    let mut r = draw * total;
    let mut start = w.len();
    for (b, &s) in sums.iter().enumerate() {
        if r < s {
            start = b * PICK_BLOCK;
            break;
        }
        r -= s;
    }
    // The walk from that block on; rounding can carry it past the block, or past the end.
    let (mut last, mut r) = (None, r);
    for (i, &x) in w.iter().enumerate().skip(start) {
        if r < x {
            return i as u32;
        }
        r -= x;
        if x > 0.0 {
            last = Some(i);
        }
    }
    // Past the end: the last token that has weight (min-p zeroes some).
    last.or_else(|| w.iter().rposition(|&x| x > 0.0)).unwrap_or(0) as u32
}

/// The sum of `xs` in 16 independent lanes.
fn lane_sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// What a temperature draw chooses among (see [`candidates`]).
enum Candidates {
    /// Every token, in vocabulary order: its weight at its id (no (id, weight) pairs built for a whole vocabulary).
    All(Vec<f32>),
    /// The kept tokens with their weights, in descending order of logit.
    Kept(Vec<(u32, f32)>),
}

#[cfg(test)]
impl Candidates {
    /// (id, weight) pairs in the order a draw walks them.
    fn pairs(self) -> Vec<(u32, f32)> {
        match self {
            Candidates::All(w) => w.into_iter().enumerate().map(|(i, w)| (i as u32, w)).collect(),
            Candidates::Kept(kept) => kept,
        }
    }
}

/// The tokens a temperature draw chooses among, with weights `e^((l − max)/T)`: every token in vocabulary order
/// without top-k and top-p, else the kept ones in descending order of logit (ties by id). Only what top-k keeps,
/// or the head that reaches top-p, is ever sorted: sorting the whole vocabulary (49,152 SmolLM2 tokens, 150k for
/// Qwen) for every sampled token cost more than a decode step of a small model. Min-p then drops the tokens whose
/// weight (their probability over the most likely one's) is under `min_p`, as vLLM applies it after top-k and
/// top-p: in vocabulary order their weight becomes 0.
fn candidates(logits: &[f32], p: &SamplingParams) -> Candidates {
    match candidates_k_p(logits, p) {
        cand if p.min_p <= 0.0 => cand,
        Candidates::All(mut w) => {
            let cut = p.min_p * w.iter().fold(0f32, |m, &x| m.max(x));
            w.iter_mut().filter(|w| **w < cut).for_each(|w| *w = 0.0);
            Candidates::All(w)
        }
        // Descending order: the kept tokens are a head, the most likely first.
        Candidates::Kept(mut kept) => {
            let cut = p.min_p * kept.first().map_or(0.0, |c| c.1);
            kept.truncate(kept.partition_point(|c| c.1 >= cut).max(1));
            Candidates::Kept(kept)
        }
    }
}

/// [`candidates`] before min-p.
fn candidates_k_p(logits: &[f32], p: &SamplingParams) -> Candidates {
    let n = logits.len();
    let mut w: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
    exp_from_max(Isa::detect(), &mut w);
    let top_k = if p.top_k > 0 && p.top_k < n { p.top_k } else { n };
    let weighted = |keys: &[u64]| Candidates::Kept(keys.iter().map(|&k| (k as u32, w[k as u32 as usize])).collect());
    if top_k == n {
        if p.top_p >= 1.0 {
            return Candidates::All(w);
        }
        if let Some(head) = nucleus_by_magnitude(logits, &w, p.top_p) {
            return weighted(&head);
        }
    }
    // Keys sort in draw order, so selecting and sorting compare plain integers, not logits looked up by id.
    let mut keys: Vec<u64> = logits.iter().enumerate().map(|(i, &l)| draw_order_key(l, i as u32)).collect();
    if top_k < n {
        keys.select_nth_unstable(top_k - 1);
        keys.truncate(top_k);
    }
    if p.top_p >= 1.0 {
        keys.sort_unstable();
        return weighted(&keys);
    }
    weighted(&nucleus(keys, &w, p.top_p))
}

/// Top-p's head of `keys` (draw-order keys of the tokens whose weights are `w`): the smallest one holding `top_p`
/// of their mass. Sorts a head, and selects and sorts more only while it falls short.
fn nucleus(mut keys: Vec<u64>, w: &[f32], top_p: f32) -> Vec<u64> {
    let id = |k: u64| k as u32 as usize;
    let total: f32 = keys.iter().map(|&k| w[id(k)]).sum();
    let (mut sorted, mut upto, mut acc) = (0, 64.min(keys.len()), 0f32);
    loop {
        if upto < keys.len() {
            keys[sorted..].select_nth_unstable(upto - sorted - 1);
        }
        keys[sorted..upto].sort_unstable();
        for i in sorted..upto {
            acc += w[id(keys[i])] / total;
            if acc >= top_p {
                keys.truncate(i + 1);
                return keys;
            }
        }
        if upto == keys.len() {
            // Rounding kept the sum below top_p: every token stays.
            return keys;
        }
        (sorted, upto) = (upto, (upto * 8).min(keys.len()));
    }
}

/// Binary orders of magnitude a weight is bucketed by in [`nucleus_by_magnitude`]; the last holds everything under
/// 2^-62 (and zeros).
const MAGNITUDES: usize = 64;

/// The bucket of a weight in (0, 1]: 0 for [1, 2), b for [2^-b, 2^-b+1).
fn magnitude(w: f32) -> usize {
    let exponent = (w.to_bits() >> 23) & 0xff;
    (127u32.saturating_sub(exponent) as usize).min(MAGNITUDES - 1)
}

/// [`nucleus`] of the whole vocabulary without selecting or sorting all of it: one pass sums the weights by
/// binary order of magnitude, the heaviest orders that together hold `top_p` of the mass (and one more, for
/// rounding) are a head of the draw order, and only that head is sorted and walked. The head's walk is the one
/// `nucleus` makes over the same tokens with the same total, so where it reaches `top_p` it ends on the same
/// token; `None` where it cannot tell (the mass sits in the last order, or rounding left the walk short), and
/// the caller walks the vocabulary. (Selecting among 49,152 SmolLM2 tokens cost ~400 µs a draw.)
fn nucleus_by_magnitude(logits: &[f32], w: &[f32], top_p: f32) -> Option<Vec<u64>> {
    let mut mass = [0f32; MAGNITUDES];
    // Summed in vocabulary order, as `nucleus` sums keys made in that order.
    let mut total = 0f32;
    for &x in w {
        total += x;
        mass[magnitude(x)] += x;
    }
    let need = top_p * total * (1.0 + 1e-3);
    let mut acc = 0f32;
    let last = mass[..MAGNITUDES - 1].iter().position(|&m| {
        acc += m;
        acc >= need
    })?;
    let last = (last + 1).min(MAGNITUDES - 2);
    let mut keys: Vec<u64> = (w.iter().zip(logits).enumerate())
        .filter(|(_, (x, _))| magnitude(**x) <= last)
        .map(|(i, (_, &l))| draw_order_key(l, i as u32))
        .collect();
    keys.sort_unstable();
    let mut acc = 0f32;
    let end = keys.iter().position(|&k| {
        acc += w[k as u32 as usize] / total;
        acc >= top_p
    })?;
    keys.truncate(end + 1);
    Some(keys)
}

/// A key that sorts ascending in a draw's order: descending logit (`f32::total_cmp`'s order), ties by ascending id,
/// with the id in the low 32 bits.
fn draw_order_key(logit: f32, id: u32) -> u64 {
    let bits = logit.to_bits();
    // total_cmp's order as an unsigned integer: negatives with every bit flipped, the rest with the sign bit set.
    let ascending = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    (u64::from(!ascending) << 32) | u64::from(id)
}

/// The tokens a sequence holds, as the penalties read them: the distinct ids of the prompt and output (the
/// repetition penalty) and how often each occurs in the output (presence and frequency). Kept up to date a token at
/// a time, so sampling costs O(distinct tokens), never a pass over the whole sequence.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    len: usize,
    prompt_len: usize,
    seen: HashSet<u32>,
    output_counts: HashMap<u32, u32>,
}

impl TokenHistory {
    /// An empty history whose first `prompt_len` tokens will be the prompt (the rest, output).
    pub fn new(prompt_len: usize) -> Self {
        TokenHistory { prompt_len, ..Default::default() }
    }

    /// A history holding `prompt`, all of it prompt.
    pub fn from_prompt(prompt: &[u32]) -> Self {
        let mut h = TokenHistory::new(prompt.len());
        h.extend(prompt);
        h
    }

    /// Appends one token.
    pub fn push(&mut self, id: u32) {
        if self.len >= self.prompt_len {
            *self.output_counts.entry(id).or_default() += 1;
        }
        self.seen.insert(id);
        self.len += 1;
    }

    /// Appends tokens in order.
    pub fn extend(&mut self, ids: &[u32]) {
        for &id in ids {
            self.push(id);
        }
    }

    /// Tokens held: the position of the next one.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The random stream of the token at `position` of a seeded sequence (a SplitMix64 step mixes the two, so
/// neighbouring positions get unrelated streams).
fn position_rng(seed: u64, position: usize) -> StdRng {
    let mut z = seed ^ (position as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 2.0, 2.0, -1.0], &TokenHistory::default()), 1);
    }

    #[test]
    fn argmax_takes_the_first_maximum_and_skips_nans() {
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[-3.0, 5.0, 1.0, 5.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0, f32::NAN]), 2);
        assert_eq!(argmax(&[f32::NAN, 7.0, 9.0]), 0, "nothing compares larger than a NaN first value");
        // Long enough for the lanes and a tail, with ties and NaNs anywhere: the first maximum, as one walk finds it.
        let walk = |xs: &[f32]| {
            let mut best = 0;
            for (i, &x) in xs.iter().enumerate() {
                if x > xs[best] {
                    best = i;
                }
            }
            best as u32
        };
        let mut rng = StdRng::seed_from_u64(3);
        for len in [1, 15, 16, 17, 100, 49_152, 49_155] {
            for _ in 0..20 {
                let mut xs: Vec<f32> = (0..len).map(|_| rng.random_range(0..40) as f32).collect();
                for _ in 0..rng.random_range(0..3) {
                    let i = rng.random_range(1..len.max(2)).min(len - 1);
                    xs[i] = f32::NAN;
                }
                assert_eq!(argmax(&xs), walk(&xs), "{len} values");
            }
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let params = SamplingParams { temperature: 1.0, top_k: 2, seed: Some(7), ..Default::default() };
        let logits = vec![1.0, 3.0, 2.9, 0.5, 2.8];
        let run = || {
            let mut s = Sampler::new(params.clone());
            let mut history = TokenHistory::from_prompt(&[0; 3]);
            let mut out = Vec::new();
            for _ in 0..50 {
                let t = s.sample(&mut logits.clone(), &history);
                history.push(t);
                out.push(t);
            }
            out
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().all(|&t| t == 1 || t == 2), "{a:?}");
        assert!(a.contains(&1) && a.contains(&2));
    }

    #[test]
    fn a_fresh_seeded_sampler_continues_where_the_old_one_was() {
        // A recomputed sequence gets a new sampler at its current length: it must draw what the old one would.
        let params = SamplingParams { temperature: 1.0, seed: Some(11), ..Default::default() };
        let logits = vec![1.0, 1.1, 0.9, 1.05, 0.95, 1.0];
        let run = |sampler: &mut Sampler, tokens: &mut Vec<u32>| {
            let mut history = TokenHistory::new(3);
            history.extend(tokens);
            while tokens.len() < 43 {
                let t = sampler.sample(&mut logits.clone(), &history);
                history.push(t);
                tokens.push(t);
            }
        };
        let mut tokens = vec![5u32, 4, 3];
        run(&mut Sampler::new(params.clone()), &mut tokens);
        for cut in [3, 10, 25, 42] {
            let mut resumed = tokens[..cut].to_vec();
            run(&mut Sampler::new(params.clone()), &mut resumed);
            assert_eq!(resumed, tokens, "resumed at {cut}");
        }
        // Another seed draws differently.
        let mut other = tokens[..3].to_vec();
        run(&mut Sampler::new(SamplingParams { seed: Some(12), ..params }), &mut other);
        assert_ne!(other, tokens);
    }

    /// What sampling kept before heads were selected instead of sorted: the whole vocabulary sorted by logit,
    /// cut by top-k and top-p, weighted by libm's `exp`.
    fn sorted_reference(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        cand.iter_mut().for_each(|c| c.1 = (c.1 - max).exp());
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let mut acc = 0f32;
        if let Some(i) = cand.iter().position(|c| {
            acc += c.1 / total;
            acc >= p.top_p
        }) {
            cand.truncate(i + 1);
        }
        cand
    }

    /// The selected heads are the sorted vocabulary's, token for token, with the same weights (to the vector
    /// `exp`'s rounding); without a cut every token is kept with its weight. Peaked and flat logits, so top-p's
    /// head ends inside the first 64 tokens, past them, and past 512.
    #[test]
    fn candidates_are_those_of_the_sorted_vocabulary() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(5);
        for spread in [20.0f32, 2.0, 0.05] {
            // Some repeated values, so ties are broken by id as the sort breaks them.
            let logits: Vec<f32> =
                (0..5000).map(|_| (rng.random_range(-1.0f32..1.0) * spread * 64.0).round() / 64.0).collect();
            for (temperature, top_k, top_p) in
                [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.0, 0, 0.9), (1.3, 0, 0.995), (0.8, 300, 0.5), (1.0, 9999, 0.97)]
            {
                let p = SamplingParams { temperature, top_k, top_p, ..Default::default() };
                let got = candidates(&logits, &p).pairs();
                let mut want = sorted_reference(&logits, &p);
                if top_p >= 1.0 && (top_k == 0 || top_k >= logits.len()) {
                    want.sort_by_key(|c| c.0);
                }
                let ids = |c: &[(u32, f32)]| c.iter().map(|c| c.0).collect::<Vec<_>>();
                assert_eq!(ids(&got), ids(&want), "spread {spread}, {p:?}");
                for (g, w) in got.iter().zip(&want) {
                    assert!((g.1 - w.1).abs() <= 4e-7 * w.1 + 1e-37, "token {}: {} vs {}", g.0, g.1, w.1);
                }
            }
        }
    }

    /// Top-p's head found through orders of magnitude is the one the full walk finds, token for token, on peaked,
    /// flat and tied logits, and that path serves every cut below 0.99 on them (the full walk only backs it up).
    #[test]
    fn the_nucleus_by_magnitude_is_the_walked_nucleus() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(7);
        for (spread, n) in [(30.0f32, 49_152), (8.0, 49_152), (1.0, 5000), (0.01, 5000), (0.0, 300)] {
            let logits: Vec<f32> =
                (0..n).map(|_| (rng.random_range(-1.0f32..1.0) * spread * 64.0).round() / 64.0).collect();
            for temperature in [0.6f32, 1.0, 1.5] {
                let mut w: Vec<f32> = logits.iter().map(|&l| l / temperature).collect();
                exp_from_max(Isa::detect(), &mut w);
                for top_p in [0.05f32, 0.5, 0.9, 0.95, 0.98, 0.999, 0.999_999] {
                    let keys: Vec<u64> = logits.iter().enumerate().map(|(i, &l)| draw_order_key(l, i as u32)).collect();
                    let walked = nucleus(keys, &w, top_p);
                    let fast = nucleus_by_magnitude(&logits, &w, top_p);
                    if let Some(fast) = &fast {
                        assert_eq!(fast, &walked, "spread {spread}, T {temperature}, top_p {top_p}");
                    }
                    assert!(top_p >= 0.99 || fast.is_some(), "spread {spread}, T {temperature}, top_p {top_p}");
                }
            }
        }
        assert_eq!((magnitude(1.0), magnitude(0.75), magnitude(0.5), magnitude(0.0)), (0, 1, 1, MAGNITUDES - 1));
        assert_eq!(magnitude(f32::MIN_POSITIVE), MAGNITUDES - 1);
    }

    /// A draw through the blocks' sums lands on the token whose share of the weight it falls in (to f32 rounding
    /// of the sums, a millionth of the total here): draws at the middle of many tokens' intervals, over lengths with
    /// a partial last block and with zeroed (min-p) weights, and the ends.
    #[test]
    fn a_draw_through_block_sums_lands_in_its_share() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(11);
        for len in [1usize, 63, 64, 65, 1000, 49_152] {
            let w: Vec<f32> = (0..len)
                .map(|_| if rng.random_range(0..4) == 0 { 0.0 } else { rng.random_range(0.0f32..1.0).powi(3) })
                .collect();
            let cum: Vec<f64> =
                w.iter().scan(0f64, |acc, &x| Some(std::mem::replace(acc, *acc + f64::from(x)))).collect();
            let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
            if total == 0.0 {
                continue;
            }
            for (i, &x) in w.iter().enumerate().filter(|(i, x)| **x > 0.0 && (i % 7 == 0 || len < 100)) {
                let at = cum[i] + f64::from(x) / 2.0;
                let got = pick_in_blocks(&w, (at / total) as f32) as usize;
                let slack = 1e-6 * total;
                assert!(
                    w[got] > 0.0 && cum[got] - slack <= at && at <= cum[got] + f64::from(w[got]) + slack,
                    "{len} tokens: a draw in token {i}'s share picked {got}"
                );
            }
            let first = w.iter().position(|&x| x > 0.0).unwrap_or(0) as u32;
            let last = w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32;
            assert_eq!(pick_in_blocks(&w, 0.0), first);
            assert_eq!(pick_in_blocks(&w, 1.0 - f32::EPSILON / 2.0), last);
        }
    }

    #[test]
    fn log_softmax_at_matches_a_double_precision_reference() {
        let logits: Vec<f32> = (0..49_152u64).map(|i| ((i * 104_729) % 4001) as f32 / 211.0 - 9.0).collect();
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = max + logits.iter().map(|&x| (f64::from(x) - max).exp()).sum::<f64>().ln();
        for token in [0u32, 1, 777, 49_151] {
            let want = f64::from(logits[token as usize]) - lse;
            let got = log_softmax_at(logits.clone(), token).map(f64::from);
            assert!(got.is_some_and(|g| (g - want).abs() < 2e-5), "token {token}: {got:?} vs {want}");
        }
        assert_eq!(log_softmax_at(logits, 49_152), None);
        assert_eq!(log_softmax_at(vec![f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY], 1), Some(0.0));
        assert_eq!(log_softmax_at(vec![f32::NEG_INFINITY, 0.0], 0), Some(f32::NEG_INFINITY));
    }

    #[test]
    fn draw_order_keys_sort_as_descending_logits_then_ids() {
        let logits = [1.0, f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY, -3.5, 1.0, -f32::NAN, 2e-38, -1e-40];
        let mut by_key: Vec<u32> = (0..logits.len() as u32).collect();
        by_key.sort_by_key(|&i| draw_order_key(logits[i as usize], i));
        let mut by_logit = by_key.clone();
        by_logit.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        assert_eq!(by_key, by_logit);
        assert_eq!(by_key[..3], [1, 4, 0], "NaN, +inf, then the first of the two 1.0s");
    }

    #[test]
    fn min_p_keeps_the_tokens_at_least_that_likely_relative_to_the_best() {
        // Probabilities relative to the best: 1, 0.5, 0.25, 0.1, then a tail far below.
        let mut logits: Vec<f32> = [1.0f32, 0.5, 0.25, 0.1].iter().map(|r| r.ln()).collect();
        logits.extend((0..60).map(|i| -10.0 - i as f32));
        logits.swap(0, 7); // the best is not the first id
        let kept = |p: SamplingParams| -> Vec<u32> {
            candidates(&logits, &p).pairs().into_iter().filter(|c| c.1 > 0.0).map(|c| c.0).collect()
        };
        let p = |min_p, top_k, top_p| SamplingParams { temperature: 1.0, min_p, top_k, top_p, ..Default::default() };
        // In vocabulary order without top-k/top-p, in draw order with them.
        assert_eq!(kept(p(0.3, 0, 1.0)), [1, 7]);
        assert_eq!(kept(p(0.2, 0, 1.0)), [1, 2, 7]);
        assert_eq!(kept(p(0.2, 3, 1.0)), [7, 1, 2]);
        assert_eq!(kept(p(0.2, 2, 1.0)), [7, 1], "top-k cuts first");
        assert_eq!(kept(p(0.05, 0, 0.99)), [7, 1, 2, 3]);
        assert_eq!(kept(p(0.0, 0, 1.0)).len(), logits.len(), "0 is off");
        // A higher temperature flattens the distribution: at T = 2 the 0.25 token is at 0.5 of the best.
        let hot = SamplingParams { temperature: 2.0, ..p(0.4, 0, 1.0) };
        assert_eq!(kept(hot), [1, 2, 7]);
        // min_p = 1 keeps only the best: every seeded draw is greedy.
        let mut s = Sampler::new(SamplingParams { seed: Some(3), ..p(1.0, 0, 1.0) });
        for pos in 0..50 {
            let history = TokenHistory::new(pos);
            assert_eq!(s.sample(&mut logits.clone(), &history), 7);
        }
        assert!(SamplingParams { min_p: 1.5, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { min_p: -0.1, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn top_p_keeps_only_the_head() {
        let params = SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(params);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [0.0, 10.0, 0.0], &TokenHistory::default()), 1);
        }
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() });
        assert_eq!(s.sample(&mut [3.0, 2.0], &TokenHistory::from_prompt(&[0])), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_output() {
        // Tokens 0 and 3 are the prompt, token 1 is output twice.
        let mut history = TokenHistory::new(2);
        history.extend(&[0, 3, 1, 1]);
        let pick = |logits: [f32; 4], presence, frequency| {
            let params = SamplingParams::default().with_penalties(presence, frequency);
            let mut logits = logits;
            (Sampler::new(params).sample(&mut logits, &history), logits)
        };
        assert_eq!(pick([3.0, 2.5, 2.0, 0.0], 2.0, 2.0).0, 0, "the prompt's token 0 is not penalized");
        // Presence counts once: 2.5 - 0.4 = 2.1 still beats 2.
        let close = |a: [f32; 4], b: [f32; 4]| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6);
        let (token, logits) = pick([0.0, 2.5, 2.0, 0.0], 0.4, 0.0);
        assert!(token == 1 && close(logits, [0.0, 2.1, 2.0, 0.0]), "{token} {logits:?}");
        // Frequency counts each occurrence: 2.5 - 2 × 0.4 = 1.7 does not.
        let (token, logits) = pick([0.0, 2.5, 2.0, 0.0], 0.0, 0.4);
        assert!(token == 2 && close(logits, [0.0, 1.7, 2.0, 0.0]), "{token} {logits:?}");
        // Negative values encourage repetition.
        assert_eq!(pick([3.0, 2.5, 2.0, 0.0], -1.0, 0.0).0, 1);
    }

    #[test]
    fn zeros_from_the_wire_mean_off() {
        assert_eq!(SamplingParams::with_zeros_off(0.0, 0, 0.0, None, 0.0), SamplingParams::default());
        let p = SamplingParams::with_zeros_off(0.7, 40, 0.9, Some(3), 1.1);
        let expected = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            seed: Some(3),
            repetition_penalty: 1.1,
            ..Default::default()
        };
        assert_eq!(p, expected);
    }

    #[test]
    fn rejects_bad_params() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().with_penalties(2.5, 0.0).validate().is_err());
        assert!(SamplingParams::default().with_penalties(0.0, f32::NAN).validate().is_err());
        assert!(SamplingParams::default().with_penalties(-2.0, 2.0).validate().is_ok());
    }
}
