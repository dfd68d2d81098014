//! Timing and the few statistics the report needs. Medians and min–max spreads, not
//! means: on a shared 2-core machine a single preempted run would drag a mean.

use std::fmt;
use std::time::{Duration, Instant};

/// Run `f` and return how long it took with its result.
pub fn timed<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed(), out)
}

/// Measurements of one quantity, in seconds.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64());
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn push_secs(&mut self, secs: f64) {
        self.0.push(secs);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The `q`-quantile (0 ≤ q ≤ 1), interpolated linearly between order statistics;
    /// NaN when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n => {
                let at = q.clamp(0.0, 1.0) * (n - 1) as f64;
                let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
                v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
            }
        }
    }

    pub fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    pub fn min(&self) -> f64 {
        self.quantile(0.0)
    }

    pub fn max(&self) -> f64 {
        self.quantile(1.0)
    }

    /// Median, min and max in milliseconds, for a table cell.
    pub fn ms(&self) -> Spread {
        Spread { median: self.median() * 1e3, min: self.min() * 1e3, max: self.max() * 1e3 }
    }

    /// `per_unit / value` for each sample (e.g. tokens per second), as a spread.
    pub fn rate(&self, per: f64) -> Spread {
        // The fastest run has the highest rate: min and max swap.
        Spread { median: per / self.median(), min: per / self.max(), max: per / self.min() }
    }

    /// (max − min) / median: how noisy these runs were.
    pub fn relative_spread(&self) -> f64 {
        (self.max() - self.min()) / self.median()
    }

    /// Run by run ratios to `base` (run i of both came from the same round), as
    /// samples: pairs taken moments apart share the machine's load of the moment.
    pub fn ratios_to(&self, base: &Samples) -> Samples {
        Samples(self.0.iter().zip(&base.0).map(|(a, b)| a / b).collect())
    }
}

/// Timed runs of one way of doing some work, with a digest of each run's output.
#[derive(Default)]
pub struct Runs {
    pub times: Samples,
    pub digests: Vec<u64>,
}

impl Runs {
    pub fn push(&mut self, time: Duration, digest: u64) {
        self.times.push(time);
        self.digests.push(digest);
    }

    /// Whether every run gave `digest`.
    pub fn all_equal(&self, digest: u64) -> bool {
        !self.digests.is_empty() && self.digests.iter().all(|&d| d == digest)
    }
}

/// Measure `ways` in `rounds` rounds: one run of each way per round, the order rotating
/// from round to round, so that load changing on a shared machine falls on every way
/// alike and run i of every way comes from round i. `run` does one timed run of a way.
pub fn in_rounds<W: Copy>(
    rounds: usize,
    ways: &[W],
    mut run: impl FnMut(W, usize) -> anyhow::Result<(Duration, u64)>,
) -> anyhow::Result<Vec<Runs>> {
    let mut out: Vec<Runs> = ways.iter().map(|_| Runs::default()).collect();
    for round in 0..rounds {
        for k in 0..ways.len() {
            let i = (round + k) % ways.len();
            let (time, digest) = run(ways[i], round)?;
            out[i].push(time, digest);
        }
    }
    Ok(out)
}

/// A median with its min–max range, printed as `12.3 (11.9–13.0)`.
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digits = decimals(self.median);
        write!(f, "{:.*} ({:.*}–{:.*})", digits, self.median, digits, self.min, digits, self.max)
    }
}

/// Enough decimals for three significant figures, at most three.
pub fn decimals(x: f64) -> usize {
    match x.abs() {
        v if v >= 10.0 => 1,
        v if v >= 1.0 => 2,
        _ => 3,
    }
}

/// A number with [`decimals`] digits.
pub fn num(x: f64) -> String {
    format!("{:.*}", decimals(x), x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(v: &[f64]) -> Samples {
        let mut s = Samples::default();
        v.iter().for_each(|&x| s.push_secs(x));
        s
    }

    #[test]
    fn quantiles_interpolate_between_order_statistics() {
        let s = samples(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(s.median(), 2.5);
        assert_eq!(s.min(), 1.0);
        assert_eq!(s.max(), 4.0);
        assert!((s.quantile(0.9) - 3.7).abs() < 1e-12);
        assert!(samples(&[]).median().is_nan());
    }

    #[test]
    fn rounds_rotate_and_keep_runs_per_way() {
        let mut order = Vec::new();
        let runs = in_rounds(3, &['a', 'b'], |w, round| {
            order.push(w);
            Ok((Duration::from_millis(round as u64 + 1), w as u64))
        })
        .unwrap();
        assert_eq!(order, ['a', 'b', 'b', 'a', 'a', 'b']);
        assert_eq!(runs[1].times.max(), 0.003);
        assert!(runs[1].all_equal('b' as u64));
        assert_eq!(runs[0].times.ratios_to(&runs[1].times).median(), 1.0);
    }

    #[test]
    fn rates_swap_min_and_max() {
        let r = samples(&[1.0, 2.0, 4.0]).rate(8.0);
        assert_eq!((r.median, r.min, r.max), (4.0, 2.0, 8.0));
    }
}
