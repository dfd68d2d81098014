//! The scheduler: which rows the next step of a batch decodes. Pure policy over what the
//! members want and what earlier steps did; it makes no native call, so every rule has
//! a unit test of its own here. The batch's thread (`batch/thread.rs`) asks it for each
//! step's [`Plan`] and tells it how the step went ([`Scheduler::stepped`]).
//!
//! As vLLM keeps them apart, three rooms share the work: serve's queue policy
//! (`serve/admission.rs`: who runs at all), this scheduler (whose rows each step takes)
//! and the sequences (`batch/sequences.rs`: which KV stream a seat gets, what it reuses).
//!
//! What a step takes:
//! 1. one row for every generating seat (its next token);
//! 2. prompt rows, within the step's row budget (the rows of about `step_target`, from
//!    the measured speed of earlier steps): each group of the top class first up to its
//!    weight's part of the budget, then what they leave, both in this order:
//!    - the higher priority class first ([`Claim::priority`]);
//!    - short prompts before long ones (more than `long_prompt_rows` rows left);
//!    - a group with no stream running before groups whose streams run;
//!    - the group furthest below its weighted share of step rows (start-time fair
//!      queuing: rows computed / [`Claim::weight`]; a group that comes back starts at
//!      the least of the groups that kept waiting, so idling banks nothing);
//!    - within a group (or groups at the same share), a short prompt passed over
//!      [`PASSED_OVER_STEPS`] steps in a row first: one tenant's many waiting prompts
//!      must not all jump ahead of another tenant's first one;
//!    - the shortest; then the earliest deadline; then the seat that joined first.
//! 3. long prompts get rows beside other work only on time they earned
//!    (`long_prompt_share` of the others' step time); alone they run in big steps that
//!    yield to an arrival, and what a yield threw away is made good before the next;
//!    any other step with prompt rows yields to the arrival of a group that would go
//!    first in share and that its plan did not weigh ([`YieldTo::AllBut`]), within a
//!    debt of its own;
//! 4. while several groups generate, none of them keeps more than its weight's part of
//!    what the lightest of them costs, by count and by time ([`Scheduler::share_rows`];
//!    where another group streams beside the lightest, what the lightest's token rows
//!    take alone and what another's row adds are measured, one step in
//!    [`PROBE_EVERY`] running them alone; prompt-only groups are held by the fit):
//!    its last prompt rows are cut first, then its tokens, whose seats take turns; a
//!    group with prompts only is held to that part too, except a newcomer's first step
//!    (no rows in the last computed plan, streaming what it asks for, and ahead in
//!    share by no more than the others' rows in the step make up), beside which the
//!    others' rows take at most half its rows' time plus what they are behind it, and
//!    the groups ahead of it get no prompt rows; rows a cut frees go to the prompts of
//!    groups it did not hold;
//! 5. a group whose cancels keep rolling back steps shared with others is quarantined:
//!    its rows run in steps of their own, at most one in `QUARANTINE_WAIT + 1` while
//!    others have rows, each as short as the others' last step.
//!
//! How to add a policy: give [`Candidate`] what it needs to know (a field filled by
//! `Steps::plan` from the member), order or filter in [`Scheduler::plan`], settle what
//! it learns from each step in [`Scheduler::stepped`], and test it here with plain
//! candidates. The batch's thread changes only if the policy needs new facts.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::batch::BatchPolicy;

/// A run's claim on the shared cores, fixed when the run starts: its share, its class
/// and its deadline. Serve makes it from the tenant ([`crate::RunOptions::weight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Claim {
    /// Its fair share of step rows grows with this (at least 1).
    pub weight: u32,
    /// A higher class's prompt rows go before any lower class's.
    pub priority: u8,
    /// When the run is stopped: of equals, the earliest goes first.
    pub deadline: Option<Instant>,
}

impl Default for Claim {
    fn default() -> Self {
        Self { weight: 1, priority: 0, deadline: None }
    }
}

impl Claim {
    /// A claim of `weight` (0 counts as 1) in class `priority`, stopped at `deadline`.
    pub fn new(weight: u32, priority: u8, deadline: Option<Instant>) -> Self {
        Self { weight: weight.max(1), priority, deadline }
    }
}

/// What a member would compute in the next step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Want {
    /// A generation's next token: one row.
    Token,
    /// A prompt (a decode's batch, a generation's prompt) with this many rows left.
    Prompt(usize),
}

impl Want {
    /// A prompt with more than `long_prompt_rows` rows left.
    fn is_long(self, long_prompt_rows: usize) -> bool {
        matches!(self, Want::Prompt(left) if left > long_prompt_rows)
    }
}

/// A member with rows to compute, as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate<'a> {
    /// The seat (ids grow in the order seats joined).
    pub id: u64,
    /// Its tenant and plugin: shares and rollbacks are counted per group.
    pub group: &'a str,
    pub claim: Claim,
    pub want: Want,
}

/// Rows of one member in the next step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pick {
    pub id: u64,
    pub rows: usize,
    /// Rows of a long prompt.
    pub long: bool,
}

/// What the next step decodes.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub picks: Vec<Pick>,
    /// Whose call, arriving while the step computes, ends it (rolled back, to run again
    /// after the newcomer's rows).
    pub yields: YieldTo,
}

/// Whose arrival a step in flight yields to.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) enum YieldTo {
    /// Nobody's: it runs to its end.
    #[default]
    Nobody,
    /// Anyone's: long prompts alone, in big steps.
    Anyone,
    /// The call of a group that would go before the step's rows: any group but these
    /// (those in the step, those still ahead of them in fair share once it is computed,
    /// the quarantined).
    AllBut(HashSet<String>),
}

/// How a planned step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepEnd {
    /// Its rows are computed.
    Computed,
    /// A member's cancel stopped it: rolled back for every member.
    RolledBack,
    /// It yielded to an arrival: rolled back, to run again after the newcomer.
    Yielded,
    /// It failed: its members' calls end with the error.
    Failed,
}

/// One member of a step that ran, for [`Scheduler::stepped`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Stepped<'a> {
    pub group: &'a str,
    pub weight: u32,
    pub rows: usize,
    pub long: bool,
    /// Its own cancel (token or abandoned call) was set when the step stopped.
    pub cancelled: bool,
}

/// A short prompt passed over this many steps in a row (others kept taking the budget)
/// goes before the other short prompts of its group: the order cannot starve it. Across
/// groups fair share decides first, so a tenant with many passed-over prompts cannot
/// put them all ahead of another tenant's first prompt (a group passed over keeps its
/// share while the others' grow, so it still comes first in time).
pub(super) const PASSED_OVER_STEPS: u32 = 8;

/// Whoever rolls back shared steps pays for it. A group's cancels that roll back a
/// step while another group's rows waited (in it, or left out of it: a newcomer's
/// first step is its own) add 1 each to its score, which fades by this
/// factor every step (half of it gone after ~69 steps). Above 1 (a second such
/// rollback before the first has faded) the group is *quarantined*: its rows run only
/// in steps no other group has rows in, so its next hang-up rolls back its own work
/// alone. A single hang-up (a user closing a tab) costs its group nothing.
const ROLLBACK_FADE: f64 = 0.99;
/// While others have rows, quarantined members get a step of their own after this many
/// steps of the others (one member each time, the one that waited longest), of about
/// the time the others' last step took: quarantine slows them, never starves them, and
/// costs the others' pace at most one step in this many.
pub(super) const QUARANTINE_WAIT: u32 = 3;

/// Fewest prompt rows a step offers (when it has room): below this a step's fixed cost
/// (a graph, the weights read once more) outweighs its rows, and the estimate is noise.
const MIN_CHUNK_ROWS: usize = 16;

/// A newcomer (or a group back from a pause) starts this many rows per weight below the
/// least share of the groups that kept waiting: of equals it goes first, and as the one
/// behind it sets the part of a step the others are held to (`share_rows`), so its first
/// prompt's step is not filled with another tenant's prompt rows. One row: idling banks
/// nothing worth leaving for.
const NEWCOMER_LEAD: f64 = 1.0;

/// In a newcomer's first step the other groups' rows take at most this part of the time
/// its own rows take: its first token comes in about 1.5× its prompt's own time (after
/// the step in flight), however many streams the others run.
const NEWCOMER_STRETCH: f64 = 0.5;
/// A group is a newcomer (whose first step is its own) only while the token rows it had
/// computed are at least this part of its prompt rows: a chat streams what it asked
/// for; calls hung up at their first token, or streams never read, do not, and would
/// otherwise come back as newcomers step after step beside another's stream.
const STREAMED_PART: f64 = 0.1;
/// How much the rows in [`Scheduler::asked`] fade with every later step (half gone
/// after ~230 steps).
const ASKED_FADE: f64 = 0.997;

/// A yield's loss is made good in steps of at most this part of the step target: they
/// do not yield, so whoever arrives meanwhile waits for one. Whole-target repayments
/// held a saturating tenant's next chat ~280 ms (traced at 2 threads: a 512-row step
/// yielded to its first chat after 340 ms, and its second chat, 3 ms after the first's
/// last token, waited for the 67-row repayment). The debt and its guarantee are the
/// same; only the pieces are smaller.
const REPAY_STEP_PART: f64 = 0.25;

/// Groups whose share is remembered while they have no rows: beyond this (an open
/// server's many addresses), only the groups waiting now are kept.
const MAX_IDLE_GROUPS: usize = 1024;
/// How many times the lightest group's sampling time per token row another group's must
/// be for its rows to count as heavier (held to the lightest's time, not row count):
/// above the noise of timing a plain sampler's fraction of a millisecond.
const HEAVIER_SAMPLING: f64 = 2.0;

/// Up to `most` more of prompt `id`'s rows (`left` in all) in `picks`, added to its pick or
/// as a new one; how many were added.
fn add_rows(picks: &mut Vec<Pick>, id: u64, left: usize, long: bool, most: usize) -> usize {
    let at = picks.iter().position(|p| p.id == id);
    let rows = (left - at.map_or(0, |i| picks[i].rows)).min(most);
    match at {
        _ if rows == 0 => {}
        Some(i) => picks[i].rows += rows,
        None => picks.push(Pick { id, rows, long }),
    }
    rows
}

/// The speed of earlier steps, in rows per second, for the next step's row budget.
/// Steps too small to time well are left out; each timed one moves the estimate
/// halfway, so one disturbed by a busy machine does not swing it.
#[derive(Debug, Default)]
struct StepPace {
    rows_per_sec: Option<f64>,
}

impl StepPace {
    fn observe(&mut self, rows: usize, elapsed: Duration) {
        if rows < MIN_CHUNK_ROWS || elapsed.is_zero() {
            return;
        }
        let rate = rows as f64 / elapsed.as_secs_f64();
        self.rows_per_sec = Some(self.rows_per_sec.map_or(rate, |old| (old + rate) / 2.0));
    }

    /// Rows a step of about `target` takes, however few (at least 1; before any step
    /// was timed: no bound).
    fn rows_within(&self, target: Duration) -> usize {
        self.rows_per_sec.map_or(usize::MAX, |rate| ((rate * target.as_secs_f64()) as usize).max(1))
    }

    /// Rows a step of about `target` takes (before any step was timed: no bound but
    /// the step's own, so the first big step measures the speed).
    fn rows(&self, target: Duration) -> usize {
        match self.rows_per_sec {
            None => usize::MAX,
            Some(rate) => ((rate * target.as_secs_f64()) as usize).max(MIN_CHUNK_ROWS),
        }
    }
}

/// What a step costs by its rows, fitted from the steps so far: `fixed + per_row ×
/// rows` (least squares, each step weighing [`COST_FADE`] as much as the next). On a
/// CPU a row costs about as much as a step's fixed part (weights read once, a graph);
/// on a GPU next to nothing.
#[derive(Debug, Default)]
struct StepCost {
    /// Faded sums of 1, rows, seconds, rows², rows × seconds.
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// How much a step's weight in [`StepCost`] fades with every later step.
const COST_FADE: f64 = 0.97;

impl StepCost {
    fn observe(&mut self, rows: usize, elapsed: Duration) {
        let (x, y) = (rows as f64, elapsed.as_secs_f64());
        self.n = self.n * COST_FADE + 1.0;
        self.x = self.x * COST_FADE + x;
        self.y = self.y * COST_FADE + y;
        self.xx = self.xx * COST_FADE + x * x;
        self.xy = self.xy * COST_FADE + x * y;
    }

    /// `(fixed, per_row)` in seconds, once the steps seen differ enough in rows to tell.
    fn fit(&self) -> Option<(f64, f64)> {
        if self.n < 4.0 {
            return None;
        }
        let (mean_x, mean_y) = (self.x / self.n, self.y / self.n);
        let variance = self.xx / self.n - mean_x * mean_x;
        if variance < 1.0 {
            return None;
        }
        let per_row = (self.xy / self.n - mean_x * mean_y) / variance;
        (per_row > 0.0).then(|| ((mean_y - per_row * mean_x).max(0.0), per_row))
    }

    /// Rows of a step that takes about `time` by the fit, its fixed part included (at
    /// least one), once there is a fit.
    fn rows_within(&self, time: Duration) -> Option<usize> {
        let (fixed, per_row) = self.fit()?;
        Some(((time.as_secs_f64() - fixed) / per_row).max(1.0) as usize)
    }
}

/// Every this many shared steps, the lightest generating group's token rows run in a
/// step of their own (a *probe*), so that what others may add beside them is measured,
/// not fitted: a line through steps of token rows and of prompt rows put the cost of
/// another sequence's token row into its fixed part, and the time rule handed that part
/// out (bench/ATTACKS.md). Costs the others' rows one step's wait in this many.
const PROBE_EVERY: u32 = 32;
/// Shared steps before a probe when the lightest's row count has not been measured
/// alone yet: soon, but not at every change of it.
const PROBE_GAP: u32 = 4;
/// Row counts whose time alone is remembered (the lightest groups' few sizes).
const SOLO_SIZES: usize = 8;

/// What token rows of one group cost in a step of their own, and what a row of another
/// group adds beside them, measured: from steps that held one group's token rows only
/// (probes, and steps nobody else had rows for) and the shared steps after them.
#[derive(Debug, Default)]
struct SoloCost {
    /// Decode seconds of a step of that many token rows of one group alone.
    alone: BTreeMap<usize, f64>,
    /// Decode seconds one row of another group adds to such a step.
    marginal: Option<f64>,
    /// Shared steps since the last step alone.
    since: u32,
}

impl SoloCost {
    /// Whether the next shared step with `rows` token rows of the lightest should be a
    /// probe.
    fn due(&self, rows: usize) -> bool {
        self.since >= PROBE_EVERY || (self.since >= PROBE_GAP && !self.alone.contains_key(&rows))
    }

    /// A step of `rows` token rows of one group alone took `secs`.
    fn alone(&mut self, rows: usize, secs: f64) {
        let time = self.alone.entry(rows).or_insert(secs);
        *time = (*time + secs) / 2.0;
        self.since = 0;
        while self.alone.len() > SOLO_SIZES {
            let far = *(self.alone.keys()).max_by_key(|&&n| n.abs_diff(rows)).expect("not empty");
            self.alone.remove(&far);
        }
    }

    /// A step of the lightest's `rows` token rows and `others` rows of other groups took
    /// `secs`: what each of those rows added, moving the estimate a quarter of the way.
    fn beside(&mut self, rows: usize, others: usize, secs: f64) {
        self.since += 1;
        let Some(&alone) = self.alone.get(&rows) else { return };
        let added = ((secs - alone) / others as f64).max(0.0);
        self.marginal = Some(self.marginal.map_or(added, |m| 0.75 * m + 0.25 * added));
    }

    /// `(alone, marginal)` for a step beside `rows` token rows of the lightest, once
    /// measured (the marginal falls back to `per_row`).
    fn beside_cost(&self, rows: usize, per_row: Option<f64>) -> Option<(f64, f64)> {
        Some((*self.alone.get(&rows)?, self.marginal.or(per_row)?))
    }
}

/// What the last plan's step measures for [`SoloCost`].
#[derive(Debug)]
enum Measure {
    /// One group's token rows alone, this many.
    Alone(usize),
    /// The lightest group's token rows (this many) beside other groups' rows.
    Beside(String, usize),
}

/// A member's standing across steps.
#[derive(Debug, Default)]
struct Turns {
    /// Steps in a row its prompt had rows left and got none.
    passed_over: u32,
    /// When its token row was last taken (in token rows taken by the scheduler, from 1;
    /// 0: never): a capped group's members take turns in this order.
    token_served: u64,
    /// Steps in a row it had rows and was kept out because its group is quarantined.
    quarantine_wait: u32,
}

/// The scheduler of one batch: the policy's knobs and what it learned from its steps.
pub(super) struct Scheduler {
    step_rows: usize,
    step_target: Duration,
    long_prompt_rows: usize,
    long_prompt_share: f64,
    pace: StepPace,
    cost: StepCost,
    solo: SoloCost,
    /// What the step planned last measures, if anything.
    measure: Option<Measure>,
    /// Each group's token rows and prompt rows in the step planned last, to be added to
    /// `asked` once it is computed.
    last_rows: HashMap<String, (f64, f64)>,
    /// Each group's token rows and prompt rows computed, fading by [`ASKED_FADE`] a
    /// step: whether it streams what it asks for (see [`STREAMED_PART`]).
    asked: HashMap<String, (f64, f64)>,
    /// Token rows taken so far, for [`Turns::token_served`].
    tokens_taken: u64,
    turns: HashMap<u64, Turns>,
    /// Each group's rows computed per unit of weight, less the least of the groups that
    /// waited (see `share_floor`).
    served: HashMap<String, f64>,
    /// Each group's time per token row spent outside the decode (sampling: a grammar's
    /// masks, say), in seconds, from its last token rows; kept for the groups in
    /// `served`.
    sampling: HashMap<String, f64>,
    /// The groups that had rows in the last plan.
    waiting: HashSet<String>,
    /// The groups in this plan that had no rows in the last one (a plan that yielded
    /// does not count: its rows were thrown away).
    newcomers: HashSet<String>,
    /// The last plan's step yielded to an arrival.
    yielded: bool,
    /// The newcomer whose first step the last plan is.
    favored: Option<String>,
    /// Each group's score of shared steps it rolled back (see [`ROLLBACK_FADE`]).
    rollbacks: HashMap<String, f64>,
    /// Seconds of step time long prompts have earned while they waited for others
    /// (at `long_prompt_share`), less what they spent; they get rows once it covers a
    /// step target. Back to 0 whenever no long prompt waits.
    long_credit: f64,
    /// Seconds of long prompts' work thrown away by yields and not yet made good: while
    /// above 0, their steps take one target's worth of rows and do not yield, so the
    /// time they compute for good is at least the time arrivals made them lose (a flood
    /// of calls, even ones that fail, costs a long prompt at most half its speed).
    yield_debt: f64,
    /// Seconds of steps thrown away by yields to another group's arrival and not yet
    /// made good by steps computed since: while above 0, no step yields to one, so a
    /// flood of arrivals (many addresses, calls that fail) costs the others at most half
    /// their time.
    arrival_debt: f64,
    /// The last plan yields to another group's arrival (not to anyone's).
    yields_to_others: bool,
    /// The last plan left a long prompt waiting beside other work.
    long_waiting: bool,
    /// Steps of the others since quarantined members last had one of their own.
    since_alone: u32,
    /// The last plan is a quarantined member's step of its own while others wait.
    alone_beside_others: bool,
    /// How long the last step computed without a quarantined member alone took: how
    /// long such a member's own step may take.
    shared_step: Option<Duration>,
}

impl Scheduler {
    /// A scheduler for steps of `policy` (after the batch's own adjustments).
    pub fn new(policy: &BatchPolicy) -> Self {
        Self {
            step_rows: policy.step_rows as usize,
            step_target: policy.step_target,
            long_prompt_rows: policy.long_prompt_rows as usize,
            long_prompt_share: policy.long_prompt_share,
            pace: StepPace::default(),
            cost: StepCost::default(),
            solo: SoloCost::default(),
            measure: None,
            last_rows: HashMap::new(),
            asked: HashMap::new(),
            tokens_taken: 0,
            turns: HashMap::new(),
            served: HashMap::new(),
            sampling: HashMap::new(),
            waiting: HashSet::new(),
            newcomers: HashSet::new(),
            yielded: false,
            favored: None,
            rollbacks: HashMap::new(),
            long_credit: 0.0,
            yield_debt: 0.0,
            arrival_debt: 0.0,
            yields_to_others: false,
            long_waiting: false,
            since_alone: 0,
            alone_beside_others: false,
            shared_step: None,
        }
    }

    /// The member `id` left: its standing goes with it.
    pub fn forget(&mut self, id: u64) {
        self.turns.remove(&id);
    }

    /// Which members' rows the next step takes, and how many (see the module's doc).
    pub fn plan(&mut self, candidates: &[Candidate<'_>]) -> Plan {
        self.measure = None;
        self.favored = None;
        let left_out = self.quarantine(candidates);
        let candidates: Vec<&Candidate<'_>> =
            candidates.iter().filter(|c| !left_out.contains(&c.id)).collect();
        self.share_floor(&candidates);

        let mut picks = self.token_rows(&candidates);
        let generating = picks.len();
        let mut prompts: Vec<(&Candidate<'_>, usize, bool)> = (candidates.iter())
            .filter_map(|c| match c.want {
                Want::Prompt(left) => Some((*c, left, left > self.long_prompt_rows)),
                Want::Token => None,
            })
            .collect();
        let streaming: HashSet<&str> =
            (candidates.iter()).filter(|c| c.want == Want::Token).map(|c| c.group).collect();
        prompts.sort_by(|a, b| self.order(a, b, &streaming));

        let others = generating > 0 || prompts.iter().any(|&(_, _, long)| !long);
        // Long prompts alone run in big steps that a newcomer ends; so does one chat's
        // prompt alone, which is all its owner waits for (it yields as a chat's does):
        // a 500-row tail of a 2000-token prompt in 30-row steps of a target each took
        // twice the time per row, as below 64 query rows ggml's CPU attention is untiled.
        // Prompts alone making good what a yield threw away get that much time and no
        // more (whoever arrives meanwhile waits for it: a whole target's worth kept a
        // chat that came after its own last turn waiting ~250 ms for its first token);
        // anything else gets one target's worth.
        let alone = !others || (generating == 0 && prompts.len() == 1);
        let alone_yields = !others && self.yield_debt <= 0.0;
        let budget = if alone && self.yield_debt <= 0.0 {
            self.step_rows
        } else if alone {
            let most = self.step_target.mul_f64(REPAY_STEP_PART);
            self.pace.rows_within(Duration::from_secs_f64(self.yield_debt).min(most))
        } else {
            self.pace.rows(self.step_target)
        };
        let mut budget = budget.min(self.step_rows.saturating_sub(generating));
        if let (true, Some(shared)) = (self.alone_beside_others, self.shared_step) {
            // As long as the others' step, not a step target: they wait for it. Its
            // rows by the fitted cost, fixed part included where one is measured: at the
            // big steps' pace, 2-3 rows beside a stream's 10 ms step took 13-23 ms, the
            // victim's ITL p99 (traced at 2 threads beside first-token hang-ups).
            let rows = self.cost.rows_within(shared);
            budget = budget.min(rows.unwrap_or_else(|| self.pace.rows_within(shared)));
        }
        let long_may = !others
            || self.long_credit >= self.step_target.as_secs_f64()
            || self.long_prompt_share >= 1.0;
        // Of the top class, each group with prompts first takes at most its weight's part
        // of the budget, so that the one first in order (the furthest behind in share,
        // catching up) cannot leave another group's prompt no row for seconds; what they
        // leave goes in prompt order.
        let mut part = Self::parts(&prompts, budget);
        for capped in [true, false] {
            for &(c, left, long) in &prompts {
                if budget == 0 || (long && !long_may) {
                    continue;
                }
                let most = if capped { part.get(c.group).copied().unwrap_or(0) } else { budget };
                let rows = add_rows(&mut picks, c.id, left, long, most.min(budget));
                budget -= rows;
                if let Some(left) = part.get_mut(c.group) {
                    *left = left.saturating_sub(rows);
                }
            }
        }
        // (Token picks are other members: a prompt's id is among the prompt picks only.)
        for &(c, _, _) in &prompts {
            let picked = picks.iter().any(|p| p.id == c.id);
            let turns = self.turns.entry(c.id).or_default();
            turns.passed_over = if picked { 0 } else { turns.passed_over + 1 };
        }
        let (held, freed) = self.share_rows(&mut picks, &candidates, &streaming);
        self.refill(&mut picks, &prompts, &held, freed, long_may);
        self.note_rows(&picks, &candidates);
        if !long_may {
            self.bank_no_throttled_share(&picks, &candidates);
        }
        let any_long = prompts.iter().any(|&(_, _, long)| long);
        self.long_waiting = any_long && others;
        if !any_long {
            // What a yield cost a prompt that has ended (or got short) is not the next one's.
            self.yield_debt = 0.0;
        }
        let yields = if picks.is_empty() {
            YieldTo::Nobody
        } else if alone_yields {
            YieldTo::Anyone
        } else if prompts.iter().any(|(c, _, _)| picks.iter().any(|p| p.id == c.id))
            && self.arrival_debt <= 0.0
            && self.yield_debt <= 0.0
        {
            // A step with prompt rows (one of tokens alone is short) yields to a group
            // that would go first: its first token does not wait for the step in flight.
            YieldTo::AllBut(self.first_in_line(&picks, &candidates))
        } else {
            YieldTo::Nobody
        };
        self.yields_to_others = matches!(yields, YieldTo::AllBut(_));
        Plan { yields, picks }
    }

    /// Whether `group`'s computed rows stream what it asked for (no record: yes).
    fn streams_what_it_asks(&self, group: &str) -> bool {
        self.asked.get(group).is_none_or(|&(tokens, prompts)| tokens >= STREAMED_PART * prompts)
    }

    /// Each group's token and prompt rows in the plan's `picks`, for `asked` once the
    /// step is computed; and a step of one group's token rows only measures what they
    /// cost alone ([`SoloCost`]), whether a probe or nobody else had rows.
    fn note_rows(&mut self, picks: &[Pick], candidates: &[&Candidate<'_>]) {
        let of: HashMap<u64, &Candidate<'_>> = candidates.iter().map(|c| (c.id, *c)).collect();
        self.last_rows.clear();
        for p in picks {
            let c = of[&p.id];
            let rows = self.last_rows.entry(c.group.to_string()).or_default();
            match c.want {
                Want::Token => rows.0 += p.rows as f64,
                Want::Prompt(_) => rows.1 += p.rows as f64,
            }
        }
        let mut groups = self.last_rows.values();
        if let (Some(&(tokens, prompts)), None) = (groups.next(), groups.next()) {
            if prompts == 0.0 {
                self.measure = Some(Measure::Alone(tokens as usize));
            }
        }
    }

    /// The groups whose arrival a step of `picks` does not yield to: those in it, those
    /// the plan weighed and left out (another of their calls would be left out too: a
    /// newcomer's first step yielded to each hang-up of a tenant it had held to no
    /// rows), those still ahead in fair share of every group in it once it is computed
    /// (its rows are all owed to groups behind them, theirs to wait for), and the
    /// quarantined (whose hang-ups must not cost others' steps). A group ahead by less
    /// than the step gives does not wait for it: a saturating tenant's next chat waited
    /// for another's whole 250 ms prompt step after each of its streams (traced at 2
    /// threads beside n=4 grammars: 270 of its 400 ms to a first token).
    fn first_in_line(&self, picks: &[Pick], candidates: &[&Candidate<'_>]) -> HashSet<String> {
        let of: HashMap<u64, &Candidate<'_>> = candidates.iter().map(|c| (c.id, *c)).collect();
        let mut after: HashMap<&str, f64> = HashMap::new();
        for p in picks {
            let c = of[&p.id];
            let share = after
                .entry(c.group)
                .or_insert_with(|| self.served.get(c.group).copied().unwrap_or(0.0));
            *share += p.rows as f64 / f64::from(c.claim.weight.max(1));
        }
        let most = after.values().copied().reduce(f64::max).unwrap_or(0.0);
        let ahead = self.served.iter().filter(|(_, &share)| share > most + 0.5).map(|(g, _)| g);
        let quarantined = self.rollbacks.iter().filter(|(_, &score)| score > 1.0).map(|(g, _)| g);
        (after.into_keys().chain(candidates.iter().map(|c| c.group)).map(str::to_string))
            .chain(ahead.cloned())
            .chain(quarantined.cloned())
            .collect()
    }

    /// A group whose only rows are long prompts held back for time not yet earned waits
    /// by design, and banks no share for it: it is kept level with the least of the
    /// groups in the step. Otherwise, once its prompt's tail is short, it would be so far
    /// behind that it took whole steps beside the others' streams until it caught up.
    fn bank_no_throttled_share(&mut self, picks: &[Pick], candidates: &[&Candidate<'_>]) {
        let picked: HashSet<u64> = picks.iter().map(|p| p.id).collect();
        let in_step: HashSet<&str> =
            candidates.iter().filter(|c| picked.contains(&c.id)).map(|c| c.group).collect();
        let level = (in_step.iter()).filter_map(|g| self.served.get(*g)).copied().reduce(f64::min);
        let Some(level) = level else { return };
        for c in candidates.iter().filter(|c| !in_step.contains(c.group)) {
            if c.want.is_long(self.long_prompt_rows) {
                let share = self.served.entry(c.group.to_string()).or_default();
                *share = share.max(level);
            }
        }
    }

    /// Each group's part of a step's `budget` of prompt rows, by weight, among the groups
    /// of the highest class with prompts waiting (a lower class gets only what they leave).
    fn parts<'c>(
        prompts: &[(&Candidate<'c>, usize, bool)],
        budget: usize,
    ) -> HashMap<&'c str, usize> {
        let top = prompts.iter().map(|(c, _, _)| c.claim.priority).max().unwrap_or(0);
        let mut weights: HashMap<&'c str, usize> = HashMap::new();
        for (c, _, _) in prompts.iter().filter(|(c, _, _)| c.claim.priority == top) {
            let w = weights.entry(c.group).or_insert(1);
            *w = (*w).max(c.claim.weight as usize);
        }
        let total: usize = weights.values().sum();
        (weights.into_iter())
            .map(|(g, w)| (g, budget.saturating_mul(w).div_ceil(total.max(1))))
            .collect()
    }

    /// One token row for every generating member, the one whose token was taken
    /// longest ago first (the order in which [`Scheduler::share_rows`] keeps them).
    fn token_rows(&self, candidates: &[&Candidate<'_>]) -> Vec<Pick> {
        let mut tokens: Vec<&Candidate<'_>> =
            candidates.iter().copied().filter(|c| c.want == Want::Token).collect();
        let served = |c: &Candidate<'_>| self.turns.get(&c.id).map_or(0, |t| t.token_served);
        tokens.sort_by_key(|c| (served(c), c.id));
        tokens.into_iter().map(|c| Pick { id: c.id, rows: 1, long: false }).collect()
    }

    /// While several groups generate, none of them keeps more rows in a step (tokens
    /// and prompt rows) than its weight's part of what the lightest of them costs
    /// (fewest rows per weight, of the highest class): as many rows per weight, or more
    /// where rows are cheap beside a step's fixed part: for a group that streams beside
    /// the lightest's stream measured ([`SoloCost`]), else fitted from earlier steps. On
    /// a CPU, where a row costs about a step's fixed part, one tenant's sixteen streams
    /// and their prompts beside another's lone stream make that stream's steps about
    /// twice its own, not seventeen rows long; on a GPU nothing is
    /// cut. A group's picks are cut from its last: prompt rows first, then the tokens
    /// taken most recently, so its seats take turns.
    ///
    /// A group with prompts only is held to the same part: a flood of prompts (or of
    /// hang-ups at the first token) beside another tenant's stream costs that stream's
    /// steps no more than its weight's part either, and a group behind in share catches
    /// up by its part of each step. Except in a newcomer's first step (a group with no
    /// rows in the last plan, prompts only, not ahead): it sets the part, and the groups
    /// ahead of it get no prompt rows beside it, which is most of what it would wait for
    /// its first token.
    ///
    /// Returns the groups it cut, and how many prompt rows it cut.
    fn share_rows<'c>(
        &mut self,
        picks: &mut Vec<Pick>,
        candidates: &[&Candidate<'c>],
        streaming: &HashSet<&str>,
    ) -> (HashSet<&'c str>, usize) {
        let of: HashMap<u64, &Candidate<'c>> = candidates.iter().map(|c| (c.id, *c)).collect();
        let (mut held, mut freed) = (HashSet::new(), 0);
        // Each group's (rows, weight at least 1, class) in this step.
        let mut groups: HashMap<&str, (usize, u32, u8)> = HashMap::new();
        for p in picks.iter() {
            let c = of[&p.id];
            let g = groups.entry(c.group).or_insert((0, 1, 0));
            *g = (g.0 + p.rows, g.1.max(c.claim.weight), g.2.max(c.claim.priority));
        }
        let generating = |group: &str| streaming.contains(group);
        let top = groups.values().map(|g| g.2).max().unwrap_or(0);
        let served = |group: &str| self.served.get(group).copied().unwrap_or(0.0);
        // A newcomer's first step (a group with no rows in the last plan, prompts only):
        // the groups ahead of it get no prompt rows beside it, only their tokens (within
        // their part), so its first token waits for its own rows; those behind it catch
        // up in it (below). So a newcomer ahead in share keeps its first step where the
        // others' rows in it can make up the difference: a tenant whose chats follow each
        // other is a few rows ahead at each one's start, and lost its first step to a
        // whole step of the other's (traced at 2 threads beside n=4 grammars: 12 rows
        // ahead, its first token after a 322 ms step). Further ahead (beside a stream's
        // one row) it is held to the others' part, as any group is.
        let within_reach = |group: &str| {
            (groups.iter()).filter(|(_, v)| v.2 == top).all(|(&g, &(rows, weight, _))| {
                (served(group) - served(g)) * f64::from(weight) <= rows as f64 + 0.5
            })
        };
        let firsts: HashSet<&str> = (groups.iter())
            .filter(|(&g, v)| {
                v.2 == top
                    && !generating(g)
                    && self.newcomers.contains(g)
                    && self.streams_what_it_asks(g)
                    && within_reach(g)
            })
            .map(|(&g, _)| g)
            .collect();
        let first_step = !firsts.is_empty();
        // The part is set by the newcomer of a first step, else by the lightest
        // generating group, of the top class.
        let light = (groups.iter())
            .filter(|(g, v)| {
                v.2 == top && if first_step { firsts.contains(*g) } else { generating(g) }
            })
            .map(|(&g, &(rows, weight, _))| (rows, weight as usize, g))
            .min_by(|a, b| (a.0 * b.1).cmp(&(b.0 * a.1)));
        // Held to it: every other group. One behind in share catches up by its part of
        // each step, not in a step that stalls another's stream.
        groups.retain(|g, _| !firsts.contains(g));
        if let Some((light_rows, light_weight, light_group)) = light {
            // Beside a newcomer's first step: its share, which those behind it catch up to
            // in the step and those ahead of it (by more than float noise) get no prompt
            // rows beside.
            let first_share = first_step.then(|| served(light_group));
            if first_step {
                self.favored = Some(light_group.to_string());
            }
            let behind_first = |group: &str, weight: usize| {
                first_share
                    .map_or(0, |share| ((share - served(group)) * weight as f64).max(0.0) as usize)
            };
            let ahead_of_first =
                |group: &str| first_share.is_some_and(|share| served(group) > share + 0.5);
            let cost = self.cost.fit();
            let sampling = |group: &str| self.sampling.get(group).copied().unwrap_or(0.0);
            // The lightest streams (token rows only): what its rows cost alone and what
            // another's row adds is measured (`SoloCost`), and now and then probed.
            let light_tokens = generating(light_group)
                && (picks.iter())
                    .filter(|p| of[&p.id].group == light_group)
                    .all(|p| of[&p.id].want == Want::Token);
            // Another group streams beside the lightest (the measure is of token rows).
            let others = (picks.iter())
                .any(|p| of[&p.id].group != light_group && of[&p.id].want == Want::Token);
            let solo = (light_tokens && others)
                .then(|| self.solo.beside_cost(light_rows, cost.map(|(_, per_row)| per_row)))
                .flatten();
            let probe = light_tokens
                && others
                && !first_step
                && !self.alone_beside_others
                && self.solo.due(light_rows);
            if light_tokens && others && !probe {
                self.measure = Some(Measure::Beside(light_group.to_string(), light_rows));
            }
            let mut room: HashMap<&str, usize> = (groups.iter())
                .map(|(&group, &(rows, weight, _))| {
                    if probe && group != light_group {
                        return (group, 0);
                    }
                    let weight = weight as usize;
                    let by_count = (light_rows * weight).div_ceil(light_weight);
                    // Rows of the time the lightest's rows (sampling included) take alone
                    // (a step's fixed part with them), at this group's time per row beside
                    // them: measured where the lightest streams, else fitted.
                    let token = (picks.iter())
                        .any(|p| of[&p.id].group == group && of[&p.id].want == Want::Token);
                    // The measure is of streams beside a stream: a group with prompts only
                    // (a long prompt on its earned time, an embedding) keeps the fitted
                    // rule, under which its rows already run at most as long as the
                    // stream's.
                    let solo = solo.filter(|_| token);
                    let (light_time, row_time) = match (solo, cost) {
                        // A newcomer's first step: half its prompt rows' time, no fixed
                        // part; another's token row as measured beside a stream.
                        (_, Some((_, per_row))) if first_step => {
                            let beside = self.solo.marginal.unwrap_or(per_row);
                            (
                                NEWCOMER_STRETCH * light_rows as f64 * per_row,
                                if token { beside + sampling(group) } else { per_row },
                            )
                        }
                        (Some((alone, marginal)), _) => (
                            alone + light_rows as f64 * sampling(light_group),
                            marginal + sampling(group),
                        ),
                        (None, Some((fixed, per_row))) => (
                            fixed + light_rows as f64 * (per_row + sampling(light_group)),
                            per_row + sampling(group),
                        ),
                        (None, None) => (0.0, 1.0),
                    };
                    let by_time = (light_time * weight as f64 / light_weight as f64 / row_time)
                        .min(rows as f64) as usize;
                    // A group whose rows cost more than the lightest's (a grammar's masks
                    // on each token) is held to the lightest's time, not its row count;
                    // so is every group beside a newcomer's first step.
                    let heavier = (solo.is_some() || cost.is_some())
                        && (first_step
                            || sampling(group) > HEAVIER_SAMPLING * sampling(light_group));
                    let room = if heavier { by_time } else { by_count.max(by_time) };
                    (group, (room + behind_first(group, weight)).clamp(1, rows))
                })
                .collect();
            // What the part was set by and each group held to it, beside the step's own
            // trace line ("batch step"): what a slow shared step is read from.
            tracing::trace!(
                light = light_group,
                light_rows,
                fixed_ms = cost.map(|(fixed, _)| fixed * 1e3),
                per_row_ms = cost.map(|(_, per_row)| per_row * 1e3),
                alone_ms = solo.map(|(alone, _)| alone * 1e3),
                beside_ms = solo.map(|(_, marginal)| marginal * 1e3),
                probe,
                sampling_ms = ?(self.sampling.iter()).map(|(g, s)| (g, s * 1e3)).collect::<Vec<_>>(),
                ?room,
                "step shares"
            );
            for p in picks.iter_mut() {
                let c = of[&p.id];
                let mut no_room = 0;
                if let Some(left) = room.get_mut(c.group) {
                    let prompt = matches!(c.want, Want::Prompt(_));
                    let left = if prompt && ahead_of_first(c.group) { &mut no_room } else { left };
                    if p.rows > *left {
                        held.insert(c.group);
                        if prompt && !probe {
                            freed += p.rows - *left;
                        }
                    }
                    p.rows = p.rows.min(*left);
                    *left -= p.rows;
                }
            }
            for p in picks.iter().filter(|p| p.rows == 0) {
                if let Want::Prompt(_) = of[&p.id].want {
                    self.turns.entry(p.id).or_default().passed_over += 1;
                }
            }
            picks.retain(|p| p.rows > 0);
        }
        for p in picks.iter() {
            if of[&p.id].want == Want::Token {
                self.tokens_taken += 1;
                self.turns.entry(p.id).or_default().token_served = self.tokens_taken;
            }
        }
        (held, freed)
    }

    /// The `free` prompt rows [`Scheduler::share_rows`] cut from the groups it `held` to
    /// their part go to the prompts of the other groups, in prompt order: a cut must not
    /// leave a step short while a group under its part has rows waiting.
    fn refill(
        &mut self,
        picks: &mut Vec<Pick>,
        prompts: &[(&Candidate<'_>, usize, bool)],
        held: &HashSet<&str>,
        mut free: usize,
        long_may: bool,
    ) {
        for &(c, left, long) in prompts {
            if free == 0 {
                return;
            }
            if held.contains(c.group) || (long && !long_may) {
                continue;
            }
            let more = add_rows(picks, c.id, left, long, free);
            if more > 0 {
                free -= more;
                self.turns.entry(c.id).or_default().passed_over = 0;
            }
        }
    }

    /// The order prompts get rows in: class, short before long, groups with no stream
    /// before streaming ones (a first token before more of a group whose streams already
    /// run: its rows cut by `share_rows` must not turn into a lead in prompt order), the
    /// group's share, the passed over first, length, deadline, arrival.
    fn order(
        &self,
        (a, a_left, a_long): &(&Candidate<'_>, usize, bool),
        (b, b_left, b_long): &(&Candidate<'_>, usize, bool),
        streaming: &HashSet<&str>,
    ) -> Ordering {
        let starved = |c: &Candidate<'_>| {
            self.turns.get(&c.id).is_some_and(|t| t.passed_over >= PASSED_OVER_STEPS)
        };
        let served = |c: &Candidate<'_>| self.served.get(c.group).copied().unwrap_or(0.0);
        Reverse(a.claim.priority)
            .cmp(&Reverse(b.claim.priority))
            .then(a_long.cmp(b_long))
            .then(streaming.contains(a.group).cmp(&streaming.contains(b.group)))
            .then(served(a).total_cmp(&served(b)))
            .then(starved(b).cmp(&starved(a)))
            .then(a_left.cmp(b_left))
            .then(a.claim.deadline.is_none().cmp(&b.claim.deadline.is_none()))
            .then(a.claim.deadline.cmp(&b.claim.deadline))
            .then(a.id.cmp(&b.id))
    }

    /// Quarantined groups' rows stay out of steps others have rows in; after
    /// `QUARANTINE_WAIT` of the others' steps, the member that waited longest gets a step
    /// of its own. Returns the members left out.
    fn quarantine(&mut self, candidates: &[Candidate<'_>]) -> HashSet<u64> {
        let quarantined: HashSet<u64> = (candidates.iter())
            .filter(|c| self.rollbacks.get(c.group).is_some_and(|&score| score > 1.0))
            .map(|c| c.id)
            .collect();
        let others = candidates.iter().any(|c| !quarantined.contains(&c.id));
        if !quarantined.is_empty() {
            tracing::trace!(members = quarantined.len(), others, "quarantined members wait");
        }
        self.alone_beside_others = false;
        if quarantined.is_empty() || !others {
            // Nobody to keep apart: the quarantined (if any) run together.
            self.since_alone = 0;
            for id in &quarantined {
                self.turns.entry(*id).or_default().quarantine_wait = 0;
            }
            return HashSet::new();
        }
        let wait = |id: &u64| self.turns.get(id).map_or(0, |t| t.quarantine_wait);
        let alone = (self.since_alone >= QUARANTINE_WAIT)
            .then(|| quarantined.iter().max_by_key(|id| (wait(id), Reverse(**id))).copied())
            .flatten();
        let left_out: HashSet<u64> = (candidates.iter())
            .map(|c| c.id)
            .filter(|id| match alone {
                Some(only) => *id != only,
                None => quarantined.contains(id),
            })
            .collect();
        self.alone_beside_others = alone.is_some();
        self.since_alone = if alone.is_some() { 0 } else { self.since_alone + 1 };
        for &id in &quarantined {
            let turns = self.turns.entry(id).or_default();
            turns.quarantine_wait =
                if left_out.contains(&id) { turns.quarantine_wait + 1 } else { 0 };
        }
        left_out
    }

    /// Start-time fair queuing's floor: every waiting group's share is at least the least
    /// share of the groups that kept waiting since the last plan, and shares are kept
    /// relative to it. A newcomer, or a group back after a pause, starts
    /// [`NEWCOMER_LEAD`] below it.
    fn share_floor(&mut self, candidates: &[&Candidate<'_>]) {
        let now: HashSet<&str> = candidates.iter().map(|c| c.group).collect();
        let floor = (now.iter())
            .filter(|g| self.waiting.contains(**g))
            .filter_map(|g| self.served.get(*g))
            .copied()
            .reduce(f64::min)
            .unwrap_or(0.0);
        for g in &now {
            let share = self.served.entry((*g).to_string()).or_insert(f64::MIN);
            if *share < floor {
                *share = floor - NEWCOMER_LEAD;
            }
        }
        self.served.retain(|g, share| {
            *share -= floor;
            now.contains(g.as_str()) || *share > 0.0
        });
        if self.served.len() > MAX_IDLE_GROUPS {
            self.served.retain(|g, _| now.contains(g.as_str()));
        }
        self.sampling.retain(|g, _| self.served.contains_key(g));
        // A group's history outlives its share (a caller whose calls hang up falls
        // behind the floor and out of `served` between two of them), until it fades.
        self.asked
            .retain(|g, &mut (tokens, prompts)| now.contains(g.as_str()) || tokens + prompts > 1.0);
        if self.asked.len() > MAX_IDLE_GROUPS {
            self.asked.retain(|g, _| now.contains(g.as_str()));
        }
        let now: HashSet<String> = now.into_iter().map(str::to_string).collect();
        // A newcomer whose first step yielded (to another's arrival) still has its first
        // step to come: traced at 2 threads, a chat whose first step yielded at once to
        // a hang-up's arrival then waited for a 270 ms step of the other tenant's prompts.
        let fresh = now.difference(&self.waiting).cloned();
        if std::mem::take(&mut self.yielded) {
            self.newcomers.retain(|g| now.contains(g));
            self.newcomers.extend(fresh);
        } else {
            self.newcomers = fresh.collect();
        }
        self.waiting = now;
    }

    /// One of `group`'s token rows took `took` after the decode (its sampling): what its
    /// next token rows will cost beside others, on top of the decode. Each moves the
    /// estimate halfway.
    pub fn sampled(&mut self, group: &str, took: Duration) {
        let took = took.as_secs_f64();
        match self.sampling.get_mut(group) {
            Some(cost) => *cost = (*cost + took) / 2.0,
            None if self.served.contains_key(group) => {
                self.sampling.insert(group.to_string(), took);
            }
            None => {}
        }
    }

    /// Settle what the step planned last did: its pace, the groups' shares, the long
    /// prompts' account, a yield's debt and who rolled back whose work.
    pub fn stepped(&mut self, members: &[Stepped<'_>], elapsed: Duration, end: StepEnd) {
        let measure = self.measure.take();
        let favored = self.favored.take();
        self.yielded = end == StepEnd::Yielded;
        let rows: usize = members.iter().map(|m| m.rows).sum();
        if rows == 0 {
            return;
        }
        self.charge_rollbacks(members, end == StepEnd::RolledBack);
        let long_rows: usize = members.iter().filter(|m| m.long).map(|m| m.rows).sum();
        // Long prompts' part of the step: its time split by rows.
        let long_time = elapsed.as_secs_f64() * long_rows as f64 / rows as f64;
        self.account_long(long_time, elapsed);
        match end {
            StepEnd::Yielded if self.yields_to_others => self.arrival_debt += elapsed.as_secs_f64(),
            StepEnd::Yielded => self.yield_debt += elapsed.as_secs_f64(),
            StepEnd::Computed => {
                self.arrival_debt = (self.arrival_debt - elapsed.as_secs_f64()).max(0.0);
                if !self.alone_beside_others {
                    self.shared_step = Some(elapsed);
                }
                // A debt left under a tenth of a millisecond (float dust once it is paid
                // in pieces) is not worth a step of its own.
                let left = self.yield_debt - long_time;
                self.yield_debt = if left > 1e-4 { left } else { 0.0 };
                self.pace.observe(rows, elapsed);
                self.cost.observe(rows, elapsed);
                self.measured(measure, members, elapsed);
                for (tokens, prompts) in self.asked.values_mut() {
                    (*tokens, *prompts) = (*tokens * ASKED_FADE, *prompts * ASKED_FADE);
                }
                for (group, (tokens, prompts)) in self.last_rows.drain() {
                    let asked = self.asked.entry(group).or_default();
                    (asked.0, asked.1) = (asked.0 + tokens, asked.1 + prompts);
                }
                for m in members {
                    *self.served.entry(m.group.to_string()).or_default() +=
                        m.rows as f64 / f64::from(m.weight.max(1));
                }
                self.forgive_first_step(favored, members);
            }
            StepEnd::RolledBack | StepEnd::Failed => {}
        }
    }

    /// A newcomer's first step is a favor, not a loan: the newcomer leaves it no further
    /// ahead in share than the others in it. Charged in full, the half of its time the
    /// others gave up came back as a lead at its tenant's next chat, which they then
    /// caught up in that chat's first step: beside n=4 grammars at 1 thread, 16-18 of
    /// their rows beside its 15, its first token after twice its prompt's time, not 1.5x.
    fn forgive_first_step(&mut self, favored: Option<String>, members: &[Stepped<'_>]) {
        let Some(favored) = favored else { return };
        let others = (members.iter())
            .filter(|m| m.group != favored)
            .filter_map(|m| self.served.get(m.group))
            .copied()
            .reduce(f64::max);
        if let (Some(others), Some(share)) = (others, self.served.get_mut(&favored)) {
            *share = share.min(others);
        }
    }

    /// What a computed step that the plan marked tells [`SoloCost`] (if it held what the
    /// plan said: a member's rows may differ from the plan's only if its seat changed).
    fn measured(&mut self, measure: Option<Measure>, members: &[Stepped<'_>], elapsed: Duration) {
        let rows_of = |group: &str| -> usize {
            members.iter().filter(|m| m.group == group).map(|m| m.rows).sum()
        };
        let all: usize = members.iter().map(|m| m.rows).sum();
        match measure {
            Some(Measure::Alone(rows)) if all == rows => {
                self.solo.alone(rows, elapsed.as_secs_f64());
            }
            Some(Measure::Beside(light, rows)) if rows_of(&light) == rows && all > rows => {
                self.solo.beside(rows, all - rows, elapsed.as_secs_f64());
            }
            _ => {}
        }
    }

    /// Fade every group's rollback score by a step, and charge the groups whose cancel
    /// rolled back a step while another group had rows waiting (in it or not: the
    /// others waited for it either way). A quarantined member's step of its own is not
    /// charged: the others were left out of its plan. (A yield is the newcomer's, and
    /// the yield debts settle it.)
    fn charge_rollbacks(&mut self, members: &[Stepped<'_>], rolled_back: bool) {
        self.rollbacks.retain(|_, score| {
            *score *= ROLLBACK_FADE;
            *score > 0.05
        });
        if !rolled_back {
            return;
        }
        let culprits: HashSet<&str> =
            members.iter().filter(|m| m.cancelled).map(|m| m.group).collect();
        let others_in_step = members.iter().any(|m| !culprits.contains(m.group));
        if others_in_step || self.waiting.iter().any(|g| !culprits.contains(g.as_str())) {
            for culprit in culprits {
                *self.rollbacks.entry(culprit.to_string()).or_default() += 1.0;
            }
        }
    }

    /// Long prompts beside other work earn `long_prompt_share` of the time the others'
    /// rows took, and spend `long_time`, what theirs took; with nobody waiting beside
    /// them, the account is settled at 0. So they run beside others only on time earned
    /// first, one step target at a time.
    fn account_long(&mut self, long_time: f64, elapsed: Duration) {
        if !self.long_waiting {
            self.long_credit = 0.0;
            return;
        }
        let share = self.long_prompt_share.clamp(0.0, 0.99);
        let other_time = elapsed.as_secs_f64() - long_time;
        let target = self.step_target.as_secs_f64();
        self.long_credit =
            (self.long_credit + share / (1.0 - share) * other_time - long_time).min(target);
    }
}

/// How long work beside the batch (a context of its own, a media encode) keeps the
/// cores while the batch waits ([`super::cores::Cores::set_turn`]). While a token is awaited (a
/// member streams, or a step holds a chat's prompt): half the last step that computed a
/// token (at least [`BesideTurn::MIN`]), so a stream's gap is its step plus one such
/// turn, about 1.5× its pace alone however long the work beside it is, and that work
/// still gets a third of the time. Not half the last step of any kind: after a chat's
/// 89 ms prompt step the work beside it kept the cores 45 ms before that chat's second
/// token (traced, an embedding beside a stream at 2 threads; one gap in 31, the p99).
/// Otherwise (long prompts alone, or nothing to do) a step target, as prompts get.
#[derive(Debug, Default)]
pub struct BesideTurn {
    /// How long the last step that computed a generation's token took.
    token_step: Duration,
}

impl BesideTurn {
    /// The shortest turn beside a streaming batch: a pass costs a hand-over of the
    /// cores, so much shorter turns would spend more on passing than on computing.
    pub const MIN: Duration = Duration::from_millis(2);

    /// A computed step took `elapsed`; `tokens`: it computed a generation's token.
    pub fn stepped(&mut self, elapsed: Duration, tokens: bool) {
        if tokens {
            self.token_step = elapsed;
        }
    }

    /// The turn beside the batch now: `awaited` whether a token waits for its steps,
    /// `target` the batch's step target.
    pub fn length(&self, awaited: bool, target: Duration) -> Duration {
        if awaited {
            (self.token_step / 2).max(Self::MIN).min(target)
        } else {
            target
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A scheduler whose steps compute 1000 rows a second (a 100 ms target: 100 rows).
    fn scheduler() -> Scheduler {
        let mut policy = BatchPolicy::new(8, 256, 1);
        policy.step_target = 100 * MS;
        policy.long_prompt_rows = 200;
        let mut s = Scheduler::new(&policy);
        s.pace.observe(1000, 1000 * MS);
        s
    }

    fn prompt(id: u64, group: &str, left: usize) -> Candidate<'_> {
        Candidate { id, group, claim: Claim::default(), want: Want::Prompt(left) }
    }

    fn token(id: u64, group: &str) -> Candidate<'_> {
        Candidate { id, group, claim: Claim::default(), want: Want::Token }
    }

    fn rows_of(plan: &Plan) -> Vec<(u64, usize)> {
        plan.picks.iter().map(|p| (p.id, p.rows)).collect()
    }

    /// `rows` of `group` (weight 1) in a step that ran.
    fn member(group: &str, rows: usize) -> Stepped<'_> {
        Stepped { group, weight: 1, rows, long: false, cancelled: false }
    }

    /// [`scheduler`] after steps of 1 ms a row: a fitted 1 ms a row, no fixed part.
    fn fitted_scheduler() -> Scheduler {
        let mut s = scheduler();
        for rows in [4, 16, 40, 16, 4, 40] {
            s.stepped(&[member("x", rows)], rows as u32 * MS, StepEnd::Computed);
        }
        s
    }

    /// The rows `plan` gives `group`, every member in `group_of` its group.
    fn group_rows(plan: &Plan, group_of: impl Fn(u64) -> &'static str, group: &str) -> usize {
        plan.picks.iter().filter(|p| group_of(p.id) == group).map(|p| p.rows).sum()
    }

    /// Run `plan`'s step as computed in `elapsed`, every member in `group_of` its group.
    fn computed(s: &mut Scheduler, plan: &Plan, group_of: impl Fn(u64) -> &'static str) {
        let weight = 1;
        let members: Vec<Stepped<'_>> = (plan.picks.iter())
            .map(|p| Stepped {
                group: group_of(p.id),
                weight,
                rows: p.rows,
                long: p.long,
                cancelled: false,
            })
            .collect();
        let rows: usize = plan.picks.iter().map(|p| p.rows).sum();
        s.stepped(&members, rows as u32 * MS, StepEnd::Computed);
    }

    #[test]
    fn generating_seats_get_a_row_and_prompts_fill_the_budget_shortest_first() {
        let mut s = scheduler();
        let plan = s.plan(&[prompt(1, "a", 60), token(2, "a"), prompt(3, "a", 30)]);
        // 100 prompt rows a step: the token, then the 30-row prompt, then the 60-row one.
        assert_eq!(rows_of(&plan), [(2, 1), (3, 30), (1, 60)]);
        let plan = s.plan(&[prompt(1, "a", 90), token(2, "a"), prompt(3, "a", 30)]);
        assert_eq!(rows_of(&plan), [(2, 1), (3, 30), (1, 70)]);
        let own: HashSet<String> = ["a".to_string()].into();
        assert_eq!(plan.yields, YieldTo::AllBut(own), "only another group's arrival ends it");
    }

    #[test]
    fn a_higher_class_goes_first_and_deadlines_settle_ties() {
        let mut s = scheduler();
        let at = Instant::now();
        let with = |id, priority, deadline_s: u64| Candidate {
            claim: Claim::new(1, priority, Some(at + Duration::from_secs(deadline_s))),
            ..prompt(id, "a", 60)
        };
        // Class 1 before class 0 although longer; equals by deadline, not by arrival.
        let high = Candidate { claim: Claim::new(1, 1, None), ..prompt(9, "b", 90) };
        let plan = s.plan(&[with(1, 0, 30), with(2, 0, 10), high]);
        assert_eq!(rows_of(&plan), [(9, 90), (2, 10)]);
        // A claim without a deadline goes after those with one.
        let plan = s.plan(&[prompt(1, "a", 60), with(2, 0, 10)]);
        assert_eq!(rows_of(&plan)[0], (2, 60));
    }

    #[test]
    fn a_prompt_passed_over_for_eight_steps_goes_first() {
        let mut s = scheduler();
        // Shorter prompts keep arriving (new ids) and fill every step's 100 rows.
        for step in 0..u64::from(PASSED_OVER_STEPS) {
            let plan = s.plan(&[
                prompt(1, "a", 90),
                prompt(10 + 2 * step, "a", 50),
                prompt(11 + 2 * step, "a", 50),
            ]);
            assert_eq!(rows_of(&plan), [(10 + 2 * step, 50), (11 + 2 * step, 50)]);
        }
        let plan = s.plan(&[prompt(1, "a", 90), prompt(98, "a", 50), prompt(99, "a", 50)]);
        assert_eq!(rows_of(&plan), [(1, 90), (98, 10)]);
    }

    #[test]
    fn one_tenants_passed_over_prompts_do_not_go_before_anothers_first() {
        let mut s = scheduler();
        let group_of = |id: u64| match id {
            9 => "v",
            100.. => "x",
            _ => "a",
        };
        let a = [token(1, "a"), prompt(2, "a", 40), prompt(3, "a", 40), prompt(4, "a", 40)];
        // Tenant a streams and has three prompts waiting; newcomers of tenant x, a higher
        // class, take every step's prompt rows until all of a's prompts have been passed
        // over.
        let x = |id| Candidate { claim: Claim::new(1, 1, None), ..prompt(id, "x", 200) };
        for step in 0..u64::from(PASSED_OVER_STEPS) {
            let mut candidates = a.to_vec();
            candidates.push(x(100 + step));
            let plan = s.plan(&candidates);
            assert_eq!(rows_of(&plan)[..2], [(1, 1), (100 + step, 100)]);
            assert_eq!(plan.picks.len(), 2, "a's prompts get none: {:?}", rows_of(&plan));
            computed(&mut s, &plan, group_of);
        }
        // Tenant v's first prompt arrives: its rows come in the very next step, not
        // after a's passed-over prompts (which would take the whole step).
        let mut candidates = a.to_vec();
        candidates.push(prompt(9, "v", 15));
        let plan = s.plan(&candidates);
        assert_eq!(rows_of(&plan)[..2], [(1, 1), (9, 15)]);
    }

    #[test]
    fn weights_divide_prompt_rows_between_saturating_groups() {
        let mut s = scheduler();
        let heavy = Claim::new(3, 0, None);
        let group_of = |id: u64| if id < 100 { "light" } else { "heavy" };
        let (mut light_rows, mut heavy_rows) = (0, 0);
        // Both always want more rows than a step takes: two 50-row prompts each.
        for _ in 0..200 {
            let plan = s.plan(&[
                prompt(1, "light", 50),
                prompt(2, "light", 50),
                Candidate { claim: heavy, ..prompt(101, "heavy", 50) },
                Candidate { claim: heavy, ..prompt(102, "heavy", 50) },
            ]);
            for p in &plan.picks {
                *(if p.id < 100 { &mut light_rows } else { &mut heavy_rows }) += p.rows;
            }
            // Weight 3's rows are charged at a third.
            let members: Vec<Stepped<'_>> = (plan.picks.iter())
                .map(|p| Stepped {
                    group: group_of(p.id),
                    weight: if p.id < 100 { 1 } else { 3 },
                    rows: p.rows,
                    long: false,
                    cancelled: false,
                })
                .collect();
            s.stepped(&members, 100 * MS, StepEnd::Computed);
        }
        let heavy_share = heavy_rows as f64 / (light_rows + heavy_rows) as f64;
        assert!((heavy_share - 0.75).abs() < 0.05, "heavy got {heavy_share:.3} of the rows");
    }

    #[test]
    fn a_group_back_from_a_pause_starts_at_the_others_share_and_banks_nothing() {
        let mut s = scheduler();
        let group_of = |id: u64| if id < 100 { "a" } else { "b" };
        // a runs alone for 50 steps; then b arrives: a long head start for a must not make
        // b win every step until it has caught up on rows it never asked for.
        for _ in 0..50 {
            let plan = s.plan(&[prompt(1, "a", 100)]);
            computed(&mut s, &plan, group_of);
        }
        let (mut a, mut b) = (0, 0);
        for _ in 0..20 {
            let plan = s.plan(&[prompt(1, "a", 100), prompt(101, "b", 100)]);
            for p in &plan.picks {
                *(if p.id < 100 { &mut a } else { &mut b }) += p.rows;
            }
            computed(&mut s, &plan, group_of);
        }
        assert!((a as f64 / (a + b) as f64 - 0.5).abs() < 0.1, "a {a} rows, b {b} rows");
    }

    /// One chat's prompt alone runs in a step as big as a long prompt's, since its owner
    /// waits for all of it, and yields as a chat's step does; beside a stream or another
    /// prompt it gets a target's worth (100 rows at 1 ms a row).
    #[test]
    fn a_chats_prompt_alone_runs_in_big_steps_and_beside_others_in_target_ones() {
        let chat = prompt(1, "a", 180); // under the 200 rows of a long prompt
        let plan = scheduler().plan(&[chat]);
        assert_eq!(rows_of(&plan), [(1, 180)]);
        assert!(matches!(plan.yields, YieldTo::AllBut(_)), "{:?}", plan.yields);
        for beside in [token(2, "b"), prompt(2, "b", 180)] {
            let plan = scheduler().plan(&[chat, beside]);
            let rows = plan.picks.iter().find(|p| p.id == 1).map_or(0, |p| p.rows);
            assert!((1..=100).contains(&rows), "beside {beside:?}: {rows} rows");
        }
    }

    #[test]
    fn long_prompts_beside_others_run_only_on_time_earned_and_alone_they_yield() {
        let mut s = scheduler();
        let long = prompt(1, "a", 1000);
        let plan = s.plan(&[long]);
        assert_eq!(plan.yields, YieldTo::Anyone, "long prompts alone yield to arrivals");
        assert_eq!(plan.picks[0].rows, s.step_rows);
        // Beside a generation: nothing until a quarter of the others' time is earned
        // (100 ms target at share 0.25: 300 ms of others' steps).
        let mut waited = 0;
        loop {
            let plan = s.plan(&[long, token(2, "b")]);
            if plan.picks.iter().any(|p| p.id == 1) {
                break;
            }
            s.stepped(
                &[Stepped { group: "b", weight: 1, rows: 1, long: false, cancelled: false }],
                50 * MS,
                StepEnd::Computed,
            );
            waited += 1;
            assert!(waited < 100, "the long prompt never earned its turn");
        }
        // 100 ms of credit at a third of the others' 50 ms steps: about 6 steps.
        assert!((5..=7).contains(&waited), "{waited} steps");
        // A yield's loss is made good before the next big step.
        let mut s = scheduler();
        let plan = s.plan(&[long]);
        let member = [Stepped {
            group: "a",
            weight: 1,
            rows: plan.picks[0].rows,
            long: true,
            cancelled: false,
        }];
        s.stepped(&member, 40 * MS, StepEnd::Yielded);
        let plan = s.plan(&[long]);
        assert_eq!(plan.yields, YieldTo::Nobody);
        assert_eq!(plan.picks[0].rows, 25, "a quarter target's rows, not the whole debt's");
        let member = [Stepped { group: "a", weight: 1, rows: 25, long: true, cancelled: false }];
        s.stepped(&member, 25 * MS, StepEnd::Computed);
        let plan = s.plan(&[long]);
        assert_eq!(plan.yields, YieldTo::Nobody, "15 ms still owed");
        assert_eq!(plan.picks[0].rows, 15, "the rest of the debt's rows");
        let member = [Stepped { group: "a", weight: 1, rows: 15, long: true, cancelled: false }];
        s.stepped(&member, 15 * MS, StepEnd::Computed);
        let plan = s.plan(&[long]);
        assert_eq!(plan.yields, YieldTo::Anyone, "paid: a big step again");
        assert_eq!(plan.picks[0].rows, s.step_rows);
    }

    #[test]
    fn a_group_that_rolls_back_shared_steps_twice_gets_steps_of_its_own() {
        let mut s = scheduler();
        let step = [prompt(1, "victim", 20), prompt(2, "attacker", 20)];
        let rolled = |s: &mut Scheduler| {
            let members = [
                Stepped { group: "victim", weight: 1, rows: 20, long: false, cancelled: false },
                Stepped { group: "attacker", weight: 1, rows: 20, long: false, cancelled: true },
            ];
            s.stepped(&members, 10 * MS, StepEnd::RolledBack);
        };
        // One hang-up costs nothing.
        assert_eq!(s.plan(&step).picks.len(), 2);
        rolled(&mut s);
        assert_eq!(s.plan(&step).picks.len(), 2);
        rolled(&mut s);
        // Quarantined: left out beside the victim for QUARANTINE_WAIT steps, then alone.
        for _ in 0..QUARANTINE_WAIT {
            assert_eq!(rows_of(&s.plan(&step)), [(1, 20)]);
        }
        assert_eq!(rows_of(&s.plan(&step)), [(2, 20)]);
        // Its own rollback alone charges nobody.
        let before = s.rollbacks["attacker"];
        s.stepped(
            &[Stepped { group: "attacker", weight: 1, rows: 20, long: false, cancelled: true }],
            MS,
            StepEnd::RolledBack,
        );
        assert!(s.rollbacks["attacker"] < before);
    }

    /// A step with prompt rows yields to the arrival of a group that would go first (a
    /// newcomer, or one ahead by less than the step gives), not to its own, to a group
    /// still ahead of it in share once it is computed or to a quarantined one; and what
    /// a yield threw away is made good before the next.
    #[test]
    fn a_step_of_prompts_yields_only_to_a_group_that_would_go_first() {
        let mut s = scheduler();
        quarantine(&mut s, "victim", "hangups");
        s.stepped(&[member("ahead", 50), member("victim", 10)], 60 * MS, StepEnd::Computed);
        let step = [prompt(1, "victim", 30)];
        let mut except: HashSet<String> =
            ["victim", "ahead", "hangups"].into_iter().map(str::to_string).collect();
        assert_eq!(s.plan(&step).yields, YieldTo::AllBut(except.clone()));
        assert_eq!(s.plan(&[token(1, "victim")]).yields, YieldTo::Nobody, "tokens alone");
        assert_eq!(s.plan(&step).yields, YieldTo::AllBut(except.clone()));
        s.stepped(&[member("victim", 30)], 40 * MS, StepEnd::Yielded);
        for made_good in [20, 30] {
            assert_eq!(s.plan(&step).yields, YieldTo::Nobody, "in debt");
            s.stepped(&[member("victim", 30)], made_good * MS, StepEnd::Computed);
        }
        // The victim has now computed more than "ahead": its arrival would go first.
        except.remove("ahead");
        assert_eq!(s.plan(&step).yields, YieldTo::AllBut(except));

        // Ahead by 10 rows, beside a step of 30: not all of it is owed, so it yields.
        let mut s = scheduler();
        s.stepped(&[member("ahead", 20), member("victim", 10)], 30 * MS, StepEnd::Computed);
        let only_victim = HashSet::from(["victim".to_string()]);
        assert_eq!(s.plan(&step).yields, YieldTo::AllBut(only_victim));
        // A step of 5 is all owed: the group ahead waits for it.
        let short = [prompt(1, "victim", 5)];
        let both = HashSet::from(["victim".to_string(), "ahead".to_string()]);
        assert_eq!(s.plan(&short).yields, YieldTo::AllBut(both));
    }

    /// Two of `culprit`'s hang-ups rolled back steps with `victim`'s rows in them: it is
    /// quarantined.
    fn quarantine(s: &mut Scheduler, victim: &str, culprit: &str) {
        for _ in 0..2 {
            let members = [member(victim, 20), Stepped { cancelled: true, ..member(culprit, 20) }];
            s.stepped(&members, 10 * MS, StepEnd::RolledBack);
        }
    }

    /// `steps` plans of a stream (`token(1, "victim")`) beside eight quarantined prompts
    /// of "attacker", every step computed in `step`: which ran ('v' the stream's, 'a' a
    /// quarantined member's own, always one member alone) and the rows of each 'a'.
    fn beside_quarantined(s: &mut Scheduler, steps: usize, step: Duration) -> (String, Vec<usize>) {
        let mut candidates = vec![token(1, "victim")];
        candidates.extend((10..18).map(|id| prompt(id, "attacker", 50)));
        let (mut pattern, mut own) = (String::new(), Vec::new());
        for _ in 0..steps {
            let picks = rows_of(&s.plan(&candidates));
            if picks == [(1, 1)] {
                pattern.push('v');
                s.stepped(&[member("victim", 1)], step, StepEnd::Computed);
            } else {
                assert_eq!(picks.len(), 1, "one quarantined member alone: {picks:?}");
                pattern.push('a');
                own.push(picks[0].1);
                s.stepped(&[member("attacker", picks[0].1)], step, StepEnd::Computed);
            }
        }
        (pattern, own)
    }

    /// Many quarantined members beside a stream: one step of their own in every
    /// `QUARANTINE_WAIT + 1`, one member at a time, no longer than the stream's step.
    #[test]
    fn many_quarantined_members_get_one_short_step_in_four_beside_a_stream() {
        let mut s = scheduler();
        quarantine(&mut s, "victim", "attacker");
        // The pace: a row a millisecond.
        s.stepped(&[member("victim", 100)], 100 * MS, StepEnd::Computed);
        let (pattern, own) = beside_quarantined(&mut s, 12, 4 * MS);
        assert_eq!(pattern, "vvvavvvavvva");
        assert!(
            own.iter().all(|&rows| rows <= 4),
            "no longer than the stream's 4 ms step: {own:?}"
        );
    }

    /// A quarantined member's step of its own is as long as the stream's step by the
    /// fitted cost, its fixed part included: on a CPU (7 ms + 4 ms a row) one row beside
    /// an 11 ms stream step, not the two or three the big steps' pace reads.
    #[test]
    fn a_quarantined_members_own_step_is_as_long_as_the_streams_by_its_cost() {
        let mut s = scheduler();
        for rows in [1, 4, 16, 40, 16, 4] {
            s.stepped(&[member("x", rows)], (7 + 4 * rows as u32) * MS, StepEnd::Computed);
        }
        quarantine(&mut s, "victim", "attacker");
        let (_, own) = beside_quarantined(&mut s, 8, 11 * MS);
        assert_eq!(own, [1, 1], "one row, 11 ms");
    }

    /// One group's many streams beside another's one: each step takes as many of its
    /// token rows per weight as the lighter group has, its seats in turn.
    #[test]
    fn a_group_with_many_streams_gets_its_weights_part_of_the_token_rows() {
        for (weight, per_step) in [(1, 1), (3, 3)] {
            let mut s = scheduler();
            let heavy = Claim::new(weight, 0, None);
            let mut candidates = vec![token(1, "light")];
            candidates.extend((10..18).map(|id| Candidate { claim: heavy, ..token(id, "heavy") }));
            let mut served: HashMap<u64, usize> = HashMap::new();
            for _ in 0..8 {
                let plan = s.plan(&candidates);
                assert!(plan.picks.iter().any(|p| p.id == 1), "the light stream in every step");
                let heavy: Vec<u64> =
                    plan.picks.iter().map(|p| p.id).filter(|&id| id != 1).collect();
                assert_eq!(heavy.len(), per_step, "weight {weight}: {:?}", rows_of(&plan));
                for id in heavy {
                    *served.entry(id).or_default() += 1;
                }
            }
            // In turns: 8 steps of `per_step` rows over 8 seats, each seat as often.
            assert_eq!(served.len(), 8, "weight {weight}: {served:?}");
            assert!(served.values().all(|&n| n == per_step), "weight {weight}: {served:?}");
        }
        // A group alone: every stream in every step.
        let alone: Vec<Candidate<'_>> = (10..18).map(|id| token(id, "heavy")).collect();
        assert_eq!(scheduler().plan(&alone).picks.len(), 8);
    }

    /// A generating group's prompt rows count too: beside another group's lone stream
    /// it keeps one row, its token. A newcomer with prompts only (here level in share)
    /// is not cut (its prompt keeps the prompt order's rows) and sets the part
    /// of those that are held: the newcomer's first step is not filled by another
    /// tenant's prompt rows.
    #[test]
    fn a_generating_groups_prompt_rows_count_in_its_part() {
        let mut s = scheduler();
        let step = [token(1, "victim"), token(10, "attacker"), prompt(11, "attacker", 90)];
        assert_eq!(rows_of(&s.plan(&step)), [(1, 1), (10, 1)]);
        let mut s = scheduler();
        let step = [token(1, "victim"), prompt(11, "attacker", 90)];
        assert_eq!(rows_of(&s.plan(&step)), [(1, 1), (11, 90)]);
        let mut s = scheduler();
        let step = [prompt(1, "victim", 30), token(10, "attacker"), prompt(11, "attacker", 90)];
        assert_eq!(rows_of(&s.plan(&step)), [(10, 1), (1, 30), (11, 29)]);
    }

    /// A group with prompts only that is ahead in fair share is held to a generating
    /// group's part beside its stream (a flood of prompts, or of hang-ups at the first
    /// token); one that is behind, as a newcomer's prompt is, keeps its rows.
    #[test]
    fn a_prompt_only_group_ahead_of_a_stream_is_held_to_its_part() {
        let mut s = scheduler();
        // The attacker has computed more rows than the victim.
        s.stepped(&[member("attacker", 80), member("victim", 10)], 90 * MS, StepEnd::Computed);
        let step = [token(1, "victim"), prompt(11, "attacker", 90), prompt(12, "attacker", 90)];
        assert_eq!(rows_of(&s.plan(&step)), [(1, 1), (11, 1)]);
        // The victim's next chat, behind in share, beside the attacker's streams: its
        // first step is its own rows and the attacker's tokens.
        s.plan(&[token(10, "attacker"), token(11, "attacker")]);
        let step = [token(10, "attacker"), token(11, "attacker"), prompt(1, "victim", 60)];
        assert_eq!(rows_of(&s.plan(&step)), [(10, 1), (11, 1), (1, 60)]);
        // Its first step only: a group behind catches up by its part of each step
        // beside another's streams (here, as many rows as the attacker's two).
        assert_eq!(rows_of(&s.plan(&step)), [(10, 1), (11, 1), (1, 2)]);
        // What the cut frees goes to the prompts of a group it did not hold back.
        let step = [token(1, "victim"), prompt(2, "victim", 30), prompt(11, "attacker", 90)];
        assert_eq!(rows_of(&s.plan(&step)), [(1, 1), (11, 31), (2, 30)]);
    }

    /// A group far behind in share (a long prompt's tenant that waited on earned time,
    /// its tail now short) catches up by weight, not by taking every row: another
    /// group's prompt beside it gets its part of each step. (Traced: a victim's chat
    /// waited 4 s beside the tail of an attacker's 1551-token prompt.)
    #[test]
    fn a_group_catching_up_leaves_the_others_their_part_of_each_step() {
        let mut s = scheduler();
        // The victim has computed far more rows than the attacker.
        s.stepped(&[member("victim", 900), member("attacker", 10)], 900 * MS, StepEnd::Computed);
        let step = [prompt(1, "victim", 15), prompt(11, "attacker", 180)];
        // Both have waited (not newcomers, whose first step is their own).
        s.plan(&step);
        assert_eq!(rows_of(&s.plan(&step)), [(11, 85), (1, 15)]);
    }

    /// A long prompt held back for time it has not earned banks no share: when its tail
    /// is short it is level with the others, not so far behind that it takes whole steps
    /// beside their streams.
    #[test]
    fn a_throttled_long_prompt_banks_no_share() {
        let mut s = scheduler();
        let group_of = |id: u64| if id < 100 { "victim" } else { "attacker" };
        for _ in 0..20 {
            let plan = s.plan(&[token(1, "victim"), prompt(101, "attacker", 1000)]);
            assert_eq!(rows_of(&plan), [(1, 1)], "the long prompt waits for earned time");
            computed(&mut s, &plan, group_of);
        }
        let (victim, attacker) = (s.served["victim"], s.served["attacker"]);
        assert!(attacker >= victim - 1.0, "victim {victim}, attacker {attacker}");
    }

    /// A newcomer's first step is its own: another tenant's prompts, which kept waiting
    /// and are ahead in share, take no row of it.
    #[test]
    fn a_newcomers_first_step_is_not_filled_with_another_tenants_prompt_rows() {
        let mut s = scheduler();
        let group_of = |id: u64| if id < 100 { "victim" } else { "attacker" };
        let flood: Vec<Candidate<'_>> = (101..105).map(|id| prompt(id, "attacker", 150)).collect();
        for _ in 0..3 {
            let plan = s.plan(&flood);
            computed(&mut s, &plan, group_of);
        }
        let mut step = flood.clone();
        step.push(prompt(1, "victim", 15));
        assert_eq!(rows_of(&s.plan(&step)), [(1, 15)]);
        // Its first step only: then each gets its part of the budget (no stream to stall).
        assert_eq!(rows_of(&s.plan(&[prompt(1, "victim", 15), flood[0]])), [(1, 15), (101, 85)]);
    }

    /// A newcomer a few rows ahead in share (a tenant whose chats follow each other)
    /// keeps its first step: the group behind it catches up in it by the difference, on
    /// top of half its rows' time, and no more. (It held to the other's part, and its
    /// first token waited for a whole step of the other's: 322 ms, traced.) Further
    /// ahead than the others' rows can make up, it is held to their part
    /// (`a_prompt_only_group_ahead_of_a_stream_is_held_to_its_part`).
    #[test]
    fn a_newcomer_a_few_rows_ahead_keeps_its_first_step_and_the_others_catch_up_in_it() {
        let group_of = |id: u64| if id < 100 { "victim" } else { "attacker" };
        let mut s = fitted_scheduler();
        // The victim's last chat left it 5 rows ahead of the attacker.
        s.stepped(&[member("victim", 4)], 4 * MS, StepEnd::Computed);
        let mut attacker: Vec<Candidate<'_>> = (100..104).map(|id| token(id, "attacker")).collect();
        attacker.push(prompt(110, "attacker", 60));
        s.plan(&attacker);
        let mut step = attacker.clone();
        step.push(prompt(1, "victim", 20));
        let plan = s.plan(&step);
        let rows = |group: &str| group_rows(&plan, group_of, group);
        // Half of 20 ms at 1 ms a row, and the 5 rows it is behind.
        assert_eq!((rows("victim"), rows("attacker")), (20, 15));
    }

    /// A newcomer whose first step yielded (to another's arrival) still has its first
    /// step to come: the step that yielded computed nothing.
    #[test]
    fn a_newcomers_first_step_that_yielded_is_still_its_first() {
        let group_of = |id: u64| if id < 100 { "victim" } else { "attacker" };
        let mut s = fitted_scheduler();
        let mut step: Vec<Candidate<'_>> = (100..116).map(|id| token(id, "attacker")).collect();
        s.plan(&step);
        step.push(prompt(1, "victim", 20));
        let rows = |plan: &Plan, group: &str| group_rows(plan, group_of, group);
        let plan = s.plan(&step);
        assert_eq!((rows(&plan, "victim"), rows(&plan, "attacker")), (20, 10));
        let members: Vec<Stepped<'_>> =
            (plan.picks.iter()).map(|p| member(group_of(p.id), p.rows)).collect();
        s.stepped(&members, MS, StepEnd::Yielded);
        let plan = s.plan(&step);
        assert_eq!((rows(&plan, "victim"), rows(&plan, "attacker")), (20, 10));
        // Computed, it was its first step: the next one holds it to the streams' part.
        computed(&mut s, &plan, group_of);
        let plan = s.plan(&step);
        assert!(rows(&plan, "victim") < 20, "{:?}", rows_of(&plan));
    }

    /// A newcomer's first step is a favor, not a loan: its tenant's next chat, after a
    /// stream that kept even with the other's, gets the same first step, not one in
    /// which the other catches up on the half it gave up.
    #[test]
    fn a_newcomers_first_step_is_not_caught_up_in_its_tenants_next_one() {
        let group_of = |id: u64| if id < 100 { "victim" } else { "attacker" };
        let mut s = fitted_scheduler();
        let attacker: Vec<Candidate<'_>> = (100..116).map(|id| token(id, "attacker")).collect();
        let rows = |plan: &Plan, group: &str| group_rows(plan, group_of, group);
        s.plan(&attacker);
        // Rows the victim's stream got ahead by (a probe step runs its row alone).
        let mut probes = 0;
        for chat in 0..3 {
            let mut step = attacker.clone();
            step.push(prompt(chat, "victim", 20));
            let plan = s.plan(&step);
            // Half its time, and what its last stream got ahead: not its first step's half.
            let expected = (20, 10 + probes);
            assert_eq!((rows(&plan, "victim"), rows(&plan, "attacker")), expected, "chat {chat}");
            probes = 0;
            computed(&mut s, &plan, group_of);
            // Its stream, a row beside one of the attacker's each step (none in a probe).
            let mut step = attacker.clone();
            step.push(token(chat, "victim"));
            for _ in 0..32 {
                let plan = s.plan(&step);
                assert_eq!(rows(&plan, "victim"), 1);
                assert!(rows(&plan, "attacker") <= 1, "{:?}", rows_of(&plan));
                probes += 1 - rows(&plan, "attacker");
                computed(&mut s, &plan, group_of);
            }
            s.forget(chat);
            // The attacker's step in flight when the next chat comes yields to it.
            let plan = s.plan(&attacker);
            let members: Vec<Stepped<'_>> =
                (plan.picks.iter()).map(|p| member(group_of(p.id), p.rows)).collect();
            s.stepped(&members, MS, StepEnd::Yielded);
        }
    }

    /// A step does not yield to the arrival of a group its plan weighed and left out: a
    /// newcomer's first step yielded to each new call of a tenant it held to no rows
    /// (traced: hang-ups at the first token, each one ending the victim's first step).
    #[test]
    fn a_step_does_not_yield_to_a_group_its_plan_left_out() {
        let mut s = scheduler();
        // The attacker is a little ahead (by less than the victim's step will give).
        s.stepped(&[member("attacker", 3)], 3 * MS, StepEnd::Computed);
        s.plan(&[prompt(110, "attacker", 60)]);
        let plan = s.plan(&[prompt(110, "attacker", 60), prompt(1, "victim", 16)]);
        assert_eq!(rows_of(&plan), [(1, 16)], "a newcomer's first step: nobody ahead beside it");
        let except: HashSet<String> = ["victim".to_string(), "attacker".to_string()].into();
        assert_eq!(plan.yields, YieldTo::AllBut(except));
    }

    /// A group whose streams run waits with its next prompt behind a group with none,
    /// whatever their shares: the victim of a capped flood gets its first token first
    /// (though no more than its weight's part of the step's prompt rows while the other
    /// has prompts waiting too).
    #[test]
    fn a_group_with_no_stream_gets_its_prompt_before_a_streaming_groups() {
        let mut s = scheduler();
        // The victim has computed more rows than the attacker.
        s.stepped(&[member("victim", 80), member("attacker", 10)], 90 * MS, StepEnd::Computed);
        let step = [token(10, "attacker"), prompt(11, "attacker", 60), prompt(1, "victim", 60)];
        assert_eq!(rows_of(&s.plan(&step)), [(10, 1), (1, 50), (11, 50)]);
    }

    /// Beside a newcomer's first step, another tenant's streams keep at most half its
    /// prompt rows' time: its first token comes in about 1.5x its own. A caller whose
    /// calls computed prompts and streamed (almost) nothing, as hang-ups at the first
    /// token do, is no newcomer: its prompt is held to the stream's part.
    #[test]
    fn beside_a_newcomers_first_step_others_keep_half_its_time_unless_it_streams_nothing() {
        let group_of = |id: u64| match id {
            ..100 => "victim",
            100..200 => "attacker",
            _ => "hangup",
        };
        let streams: Vec<Candidate<'_>> = (100..116).map(|id| token(id, "attacker")).collect();
        let mut s = fitted_scheduler();
        for _ in 0..3 {
            let plan = s.plan(&streams);
            computed(&mut s, &plan, group_of);
        }
        let mut step = streams.clone();
        step.push(prompt(1, "victim", 20));
        let plan = s.plan(&step);
        let rows = |plan: &Plan, group: &str| group_rows(plan, group_of, group);
        // Half of 20 ms, at 1 ms an attacker's token row: 10 of its 16 streams.
        assert_eq!((rows(&plan, "victim"), rows(&plan, "attacker")), (20, 10));

        // The same arrival from a caller that streamed nothing of the 400 prompt rows it
        // had computed: the stream's part, one row (a newcomer's would be all 20).
        let mut s = fitted_scheduler();
        for id in 200..220 {
            let plan = s.plan(&[prompt(id, "hangup", 20)]);
            computed(&mut s, &plan, group_of);
            s.forget(id);
        }
        // Long enough that the stream has computed more: the caller is not ahead.
        for _ in 0..450 {
            let plan = s.plan(&[token(1, "victim")]);
            computed(&mut s, &plan, group_of);
        }
        assert!(!s.served.contains_key("hangup"), "behind, its share is not kept");
        let plan = s.plan(&[token(1, "victim"), prompt(300, "hangup", 20)]);
        assert_eq!((rows(&plan, "victim"), rows(&plan, "hangup")), (1, 1));
    }

    /// The time rule: where a row costs next to nothing beside a step's fixed part (a
    /// GPU) no group is capped; where it costs about as much (a CPU), the count rule holds.
    #[test]
    fn token_rows_are_capped_where_rows_cost_and_not_where_they_are_cheap() {
        let mut candidates = vec![token(1, "light")];
        candidates.extend((10..26).map(|id| token(id, "heavy")));
        for (fixed_us, per_row_us, picked) in [(20_000, 100, 17), (5_000, 8_000, 2)] {
            let mut s = scheduler();
            for rows in (1..=64).step_by(3) {
                let elapsed = Duration::from_micros(fixed_us + per_row_us * rows as u64);
                s.stepped(&[member("x", rows)], elapsed, StepEnd::Computed);
            }
            let (fixed, per_row) = s.cost.fit().expect("a fit from steps of 1 to 64 rows");
            assert!((fixed * 1e6 - fixed_us as f64).abs() < 1.0, "{fixed}");
            assert!((per_row * 1e6 - per_row_us as f64).abs() < 0.1, "{per_row}");
            assert_eq!(s.plan(&candidates).picks.len(), picked, "fixed {fixed_us} us");
        }
    }

    /// Sampling runs after the decode (a grammar's masks on each token): a group whose
    /// token rows cost more there is held to the time of the lightest's rows, so its
    /// streams cannot make another's steps several times that stream's own.
    #[test]
    fn a_group_whose_tokens_cost_more_to_sample_is_held_to_the_lightests_time() {
        let mut candidates = vec![token(1, "light")];
        candidates.extend((10..26).map(|id| token(id, "heavy")));
        let mut s = scheduler();
        for rows in (1..=64).step_by(3) {
            let elapsed = Duration::from_micros(20_000 + 100 * rows as u64);
            s.stepped(&[member("x", rows)], elapsed, StepEnd::Computed);
        }
        assert_eq!(s.plan(&candidates).picks.len(), 17, "rows are cheap to decode: no cut");
        s.sampled("light", Duration::from_micros(50));
        s.sampled("heavy", 5 * MS);
        // The light's step, 20.15 ms, at 5.1 ms a heavy row: 3 of them.
        assert_eq!(s.plan(&candidates).picks.len(), 4);
    }

    /// Beside a lone stream, what another group's rows may cost is measured, not fitted:
    /// a probe step of the stream's row alone, then the shared steps after it. Where the
    /// fit is biased (a line through steps of token rows and prompt rows puts another
    /// sequence's token row into its fixed part, so the rule handed out four rows), the
    /// measure holds the other group to one; where rows are cheap (a GPU) it keeps all.
    #[test]
    fn what_rows_cost_beside_a_stream_is_measured_by_a_probe_now_and_then() {
        let mut candidates = vec![token(1, "light")];
        candidates.extend((10..26).map(|id| token(id, "heavy")));
        let group_of = |id: u64| if id == 1 { "light" } else { "heavy" };
        for (fixed_us, per_row_us, first, after) in [(3_000, 9_000, 7, 2), (10_000, 100, 17, 17)] {
            let mut s = scheduler();
            // The fit's steps: few token rows and big prompt steps, a line that reads
            // 25 ms fixed and 4.25 ms a row (CPU: 6 heavy rows beside the light one), or
            // cheap rows (GPU).
            for _ in 0..8 {
                for (rows, us) in [(4, 42_000), (20, 110_000)] {
                    let us = if per_row_us < 1_000 { fixed_us + per_row_us * rows } else { us };
                    let elapsed = Duration::from_micros(us);
                    s.stepped(&[member("x", rows as usize)], elapsed, StepEnd::Computed);
                }
            }
            let mut sizes = Vec::new();
            for _ in 0..3 * PROBE_EVERY {
                let plan = s.plan(&candidates);
                let rows: usize = plan.picks.iter().map(|p| p.rows).sum();
                sizes.push(rows);
                let members: Vec<Stepped<'_>> =
                    (plan.picks.iter()).map(|p| member(group_of(p.id), p.rows)).collect();
                let elapsed = Duration::from_micros(fixed_us + per_row_us * rows as u64);
                s.stepped(&members, elapsed, StepEnd::Computed);
            }
            assert_eq!(sizes[0], first, "fitted, {per_row_us} us a row: {sizes:?}");
            let probes = sizes.iter().filter(|&&n| n == 1).count();
            assert!((3..=4).contains(&probes), "{probes} probes in {sizes:?}");
            let shared: Vec<usize> = sizes[8..].iter().copied().filter(|&n| n > 1).collect();
            assert!(
                shared.iter().all(|&n| n == after),
                "measured, {per_row_us} us a row: {sizes:?}"
            );
        }
    }

    #[test]
    fn shares_of_many_idle_groups_are_not_kept_without_bound() {
        let mut s = scheduler();
        for i in 0..3 * MAX_IDLE_GROUPS as u64 {
            let name = format!("g{i}");
            let plan = s.plan(&[prompt(i, &name, 20), prompt(u64::MAX, "busy", 20)]);
            let members: Vec<Stepped<'_>> = (plan.picks.iter())
                .map(|p| Stepped {
                    group: if p.id == i { &name } else { "busy" },
                    weight: 1,
                    rows: p.rows,
                    long: false,
                    cancelled: false,
                })
                .collect();
            s.stepped(&members, 10 * MS, StepEnd::Computed);
            s.forget(i);
        }
        assert!(s.served.len() <= MAX_IDLE_GROUPS + 2, "{} groups kept", s.served.len());
        assert!(s.turns.len() <= 1);
    }

    /// Not a gate (timings): what planning and settling one step costs the batch's
    /// thread, by members. `cargo test --release --lib planning_cost -- --ignored
    /// --nocapture` (the Makefile's environment); figures in bench/TENANTS.md.
    #[test]
    #[ignore]
    fn planning_cost() {
        let groups: Vec<String> = (0..8).map(|g| format!("tenant-{g}/plugin")).collect();
        for members in [4u64, 16, 64, 256] {
            let mut s = scheduler();
            let candidates: Vec<Candidate<'_>> = (0..members)
                .map(|id| {
                    let group = groups[(id % 8) as usize].as_str();
                    let claim = Claim::new(1 + (id % 3) as u32, 0, None);
                    let want =
                        if id % 2 == 0 { Want::Token } else { Want::Prompt(20 + id as usize) };
                    Candidate { id, group, claim, want }
                })
                .collect();
            let mut per_step = Vec::new();
            for _ in 0..200 {
                let started = Instant::now();
                for _ in 0..50 {
                    let plan = s.plan(&candidates);
                    let stepped: Vec<Stepped<'_>> = (plan.picks.iter())
                        .map(|p| Stepped {
                            group: candidates[p.id as usize].group,
                            weight: candidates[p.id as usize].claim.weight,
                            rows: p.rows,
                            long: p.long,
                            cancelled: false,
                        })
                        .collect();
                    s.stepped(&stepped, 100 * MS, StepEnd::Computed);
                }
                per_step.push(started.elapsed().as_secs_f64() * 1e6 / 50.0);
            }
            per_step.sort_by(f64::total_cmp);
            println!(
                "{members} members (8 groups): plan + settle one step p50 {:.2} us, p99 {:.2} us",
                per_step[100], per_step[198]
            );
        }
    }

    #[test]
    fn work_beside_a_stream_gets_half_its_token_steps_whatever_came_between() {
        let hour = Duration::from_secs(3600);
        let mut turn = BesideTurn::default();
        assert_eq!(turn.length(true, hour), BesideTurn::MIN, "no token step yet");
        assert_eq!(turn.length(false, hour), hour, "nothing awaited: a step target");
        turn.stepped(10 * MS, true);
        assert_eq!(turn.length(true, hour), 5 * MS);
        // A chat's prompt step: the stream's next step is a token step again.
        turn.stepped(90 * MS, false);
        assert_eq!(turn.length(true, hour), 5 * MS);
        // Steps that carry tokens beside a prompt's rows are what the streams wait for.
        turn.stepped(30 * MS, true);
        assert_eq!(turn.length(true, hour), 15 * MS);
        assert_eq!(turn.length(true, 10 * MS), 10 * MS, "never past the step target");
        turn.stepped(MS, true);
        assert_eq!(turn.length(true, hour), BesideTurn::MIN);
    }
}
