//! Log-probabilities of generated tokens, as OpenAI's `logprobs` reports them: taken from
//! the model's own distribution over the vocabulary (the softmax of the raw logits),
//! before anything the sampler does to it (grammar, bias, penalties, truncation,
//! temperature). So they say how likely the model found a token, whatever picked it.

use super::Token;

/// Most alternatives a token can report: OpenAI's own bound on `top_logprobs`. Each
/// costs a pass over the candidates kept so far, per generated token.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A token's log-probability, and the most likely tokens at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token this is about (the one generated).
    pub token: Token,
    /// Natural log of its probability; `-inf` for a token the model gave no chance
    /// (a banned logit of `-inf` never occurs in a model's own output, but NaN does in
    /// broken models and counts as no chance).
    pub logprob: f32,
    /// The `n` most likely tokens, most likely first; ties go to the lower token id.
    pub top: Vec<(Token, f32)>,
}

/// The log-probability of `token` under the softmax of `logits`, and the `top` most
/// likely tokens (at most [`MAX_TOP_LOGPROBS`]). One pass for the maximum, one for the
/// normaliser and the leaders: O(n-vocab × (1 + top)) at worst, about n-vocab in
/// practice since few logits beat the current leaders.
pub fn token_logprob(logits: &[f32], token: Token, top: u32) -> TokenLogprob {
    let finite = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits.iter().copied().map(finite).fold(f32::NEG_INFINITY, f32::max);
    if max.is_infinite() {
        // No distribution to speak of (every logit -inf, or one infinite): say so
        // rather than report NaN.
        return TokenLogprob { token, logprob: f32::NEG_INFINITY, top: Vec::new() };
    }
    let n = top.min(MAX_TOP_LOGPROBS) as usize;
    let mut leaders: Vec<(Token, f32)> = Vec::with_capacity(n + 1);
    let mut sum = 0.0f64;
    for (id, &l) in logits.iter().enumerate() {
        let l = finite(l);
        sum += f64::from(l - max).exp();
        // Kept sorted, most likely first; a later id never displaces an equal logit.
        if n > 0 && (leaders.len() < n || l > leaders[n - 1].1) {
            let at = leaders.partition_point(|&(_, kept)| kept >= l);
            leaders.insert(at, (id as Token, l));
            leaders.truncate(n);
        }
    }
    let log_norm = max + sum.ln() as f32;
    let logprob_of = |l: f32| finite(l) - log_norm;
    let logprob = usize::try_from(token)
        .ok()
        .and_then(|i| logits.get(i))
        .map_or(f32::NEG_INFINITY, |&l| logprob_of(l));
    TokenLogprob {
        token,
        logprob,
        top: leaders.into_iter().map(|(id, l)| (id, logprob_of(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook formula, in f64, sorted by hand.
    fn reference(logits: &[f32], token: Token, top: usize) -> (f64, Vec<(Token, f64)>) {
        let norm: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let mut all: Vec<(Token, f64)> =
            logits.iter().enumerate().map(|(i, &l)| (i as Token, f64::from(l) - norm)).collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(top);
        (f64::from(logits[token as usize]) - norm, all)
    }

    #[test]
    fn matches_the_softmax_and_orders_ties_by_id() {
        let logits = [1.0, 3.5, -2.0, 3.5, 0.25, 7.0, -30.0, 3.5];
        for top in [0, 1, 3, 5, 8] {
            let got = token_logprob(&logits, 4, top);
            let (logprob, leaders) = reference(&logits, 4, top as usize);
            assert!(
                (f64::from(got.logprob) - logprob).abs() < 1e-5,
                "{} vs {logprob}",
                got.logprob
            );
            assert_eq!(
                got.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                leaders.iter().map(|t| t.0).collect::<Vec<_>>()
            );
            for (g, r) in got.top.iter().zip(&leaders) {
                assert!((f64::from(g.1) - r.1).abs() < 1e-5);
            }
        }
        // The ties at 3.5: ids 1, 3, 7 in that order after the leader 5.
        assert_eq!(
            token_logprob(&logits, 0, 4).top.iter().map(|t| t.0).collect::<Vec<_>>(),
            [5, 1, 3, 7]
        );
    }

    #[test]
    fn large_logits_do_not_overflow_and_probabilities_add_up() {
        let logits: Vec<f32> = (0..1000).map(|i| 1000.0 + (i % 17) as f32).collect();
        let all = token_logprob(&logits, 999, MAX_TOP_LOGPROBS);
        assert!(all.logprob.is_finite() && all.logprob < 0.0);
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| f64::from(token_logprob(&logits, i as Token, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-3, "{total}");
        assert_eq!(all.top.len(), MAX_TOP_LOGPROBS as usize, "capped at the bound");
    }

    #[test]
    fn nan_counts_as_no_chance_and_an_empty_distribution_is_minus_infinity() {
        let got = token_logprob(&[f32::NAN, 0.0, 0.0], 0, 3);
        assert_eq!(got.logprob, f32::NEG_INFINITY);
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 0]);
        assert!((got.top[0].1 - 0.5f32.ln()).abs() < 1e-6);
        let none = token_logprob(&[f32::NEG_INFINITY; 4], 2, 2);
        assert_eq!((none.logprob, none.top.len()), (f32::NEG_INFINITY, 0));
        // An id outside the logits (never from the sampler) is no chance, not a panic.
        assert_eq!(token_logprob(&[0.0, 1.0], 7, 1).logprob, f32::NEG_INFINITY);
    }
}
