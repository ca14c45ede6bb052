//! Rollback on a bad step: the judgement of a step, the count of rollbacks in a row,
//! and the test faults that poison a rank's state (a NaN, a flipped bit).
//!
//! Every rank judges a step from what the world agreed on (the all-gathered
//! parameters, the all-reduced loss), so every rank reaches the same verdict without
//! another collective. A bad step is not applied: the generation settles its save in
//! flight and ends, and [`run_supervised`](super::run_supervised) starts again in the
//! same processes from the newest healthy commit, with that commit's data position
//! (the step). The same commit reached more than `max_rollbacks` times in a row stops
//! the job with [`TrainError::Diverged`] instead of looping.

use std::sync::atomic::{AtomicBool, Ordering};

use super::{Context, TrainConfig, TrainError, say};

/// Losses before a step whose mean a spike is measured against.
pub(super) const SPIKE_WINDOW: usize = 10;

/// Why the step after `losses` is bad, if it is: non-finite parameters (as gathered
/// for it), a non-finite loss, or a loss above `spike_factor` times the mean of the
/// (up to [`SPIKE_WINDOW`]) losses before it.
pub(super) fn judge(
    config: &TrainConfig,
    losses: &[f64],
    loss: f64,
    parameters_finite: bool,
) -> Option<String> {
    let step = losses.len() as u64 + 1;
    if !parameters_finite {
        return Some(format!("non-finite parameters entering step {step}"));
    }
    if !loss.is_finite() {
        return Some(format!("the loss of step {step} is {loss}"));
    }
    let factor = config.spike_factor?;
    let window = &losses[losses.len().saturating_sub(SPIKE_WINDOW)..];
    if window.is_empty() {
        return None;
    }
    let mean = window.iter().sum::<f64>() / window.len() as f64;
    (loss > factor * mean).then(|| {
        format!(
            "the loss of step {step} ({loss:.6}) is more than {factor} times the mean of the {} steps before ({mean:.6})",
            window.len()
        )
    })
}

/// The rollbacks of one [`run_supervised`](super::run_supervised) call.
#[derive(Debug, Default)]
pub(super) struct Rollbacks {
    /// The rollback asked for and not yet done: the step it leaves, and why.
    pub(super) pending: Option<(u64, String)>,
    /// The step of the commit the last rollback reached.
    to: Option<u64>,
    /// Rollbacks in a row that reached it.
    in_a_row: u32,
    /// The checkpoint generation of the last start: a rollback saves in a newer one,
    /// so that its attempts never take the names of the ones it leaves.
    pub(super) generation: u64,
}

impl Rollbacks {
    /// The world has loaded step `to` for the pending rollback (if any): counts it,
    /// stops the job when it is one too many, logs it otherwise.
    pub(super) fn arrived(&mut self, ctx: Context<'_>, to: u64) -> Result<(), TrainError> {
        let Some((from, reason)) = self.pending.take() else {
            return Ok(());
        };
        if self.to == Some(to) {
            self.in_a_row += 1;
        } else {
            self.to = Some(to);
            self.in_a_row = 1;
        }
        let max = ctx.config.max_rollbacks;
        if self.in_a_row > max {
            return Err(TrainError::Diverged(if max == 0 {
                format!("step {from} went bad ({reason}); stopping (--max-rollbacks 0)")
            } else {
                format!(
                    "step {from} went bad again after {max} rollbacks in a row to step {to} ({reason}); stopping (--max-rollbacks {max})"
                )
            }));
        }
        if ctx.rank == 0 {
            say(format_args!(
                "rolled back from step {from} to step {to}: {reason}"
            ));
        }
        Ok(())
    }
}

/// Whether a once-per-process NaN fault has fired.
static NAN_FIRED: AtomicBool = AtomicBool::new(false);

/// A test's fault ([`TrainConfig::nan`]): after step `step`, writes a NaN into
/// element 0 of this rank's rows of the last tensor it holds rows of (the output
/// layer where it can: a NaN there reaches the loss at once).
pub(super) fn inject_nan(ctx: Context<'_>, names: &[String], params: &mut [Vec<f32>], step: u64) {
    let Some(fault) = ctx.config.nan else {
        return;
    };
    if (fault.step, fault.rank) != (step, ctx.rank)
        || (!fault.persistent && NAN_FIRED.swap(true, Ordering::SeqCst))
    {
        return;
    }
    let Some(i) = params.iter().rposition(|p| !p.is_empty()) else {
        return;
    };
    params[i][0] = f32::NAN;
    say(format_args!(
        "fault: rank {} wrote a NaN into param/{} after step {step}",
        ctx.rank, names[i]
    ));
}

/// A test's fault ([`TrainConfig::sdc`]): before the save of step `step`, flips bit 0
/// of element 0 of this rank's rows of the first tensor it holds rows of. Returns the
/// tensor flipped, for [`flip`] to flip it back once the save has staged it.
pub(super) fn inject_sdc(
    ctx: Context<'_>,
    names: &[String],
    params: &mut [Vec<f32>],
    step: u64,
) -> Option<usize> {
    if ctx.config.sdc != Some((step, ctx.rank)) {
        return None;
    }
    let i = params.iter().position(|p| !p.is_empty())?;
    flip(&mut params[i]);
    say(format_args!(
        "fault: rank {} (replica {} of shard {}) flipped a bit of param/{} before saving step {step}",
        ctx.rank, ctx.place.replica, ctx.place.shard, names[i]
    ));
    Some(i)
}

/// Flips bit 0 of element 0 (an involution: twice restores it).
pub(super) fn flip(rows: &mut [f32]) {
    rows[0] = f32::from_bits(rows[0].to_bits() ^ 1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use std::time::Duration;

    fn config(spike_factor: Option<f64>) -> TrainConfig {
        TrainConfig {
            preset: Preset::named("tiny").unwrap(),
            seed: 0,
            steps: 10,
            deterministic: true,
            ckpt_every: 0,
            snapshot_every: 0,
            host_memory_budget: None,
            snapshot_vote_against: None,
            keep: 1,
            cooperative_load: true,
            max_failed_saves: 0,
            retention_grace: Duration::ZERO,
            resume: false,
            log_every: 1,
            generation: 0,
            run_id: None,
            hold: None,
            step_pause: Duration::ZERO,
            device_error: None,
            rot_copy: None,
            save_stage: None,
            memory_copies: false,
            overlapped_staging: false,
            check_staging: false,
            replicas: 1,
            replica_mismatch: ckpt::ReplicaPolicy::Warn,
            spike_factor,
            max_rollbacks: 3,
            nan: None,
            sdc: None,
        }
    }

    #[test]
    fn a_step_is_bad_when_not_finite_or_a_spike() {
        let off = config(None);
        assert_eq!(judge(&off, &[1.0], 0.5, true), None);
        assert_eq!(judge(&off, &[1.0], 100.0, true), None, "spikes off");
        let nan = judge(&off, &[1.0, 0.9], f64::NAN, true).unwrap();
        assert!(nan.contains("step 3") && nan.contains("NaN"), "{nan}");
        let params = judge(&off, &[], 0.5, false).unwrap();
        assert!(
            params.contains("non-finite parameters entering step 1"),
            "{params}"
        );
        let on = config(Some(2.0));
        assert_eq!(
            judge(&on, &[], 100.0, true),
            None,
            "nothing to compare with"
        );
        assert_eq!(judge(&on, &[1.0, 3.0], 3.9, true), None);
        let spike = judge(&on, &[1.0, 3.0], 4.1, true).unwrap();
        assert!(spike.contains("more than 2 times the mean"), "{spike}");
        // Only the last SPIKE_WINDOW losses count.
        let mut losses = vec![100.0; 5];
        losses.extend([1.0; SPIKE_WINDOW]);
        assert!(judge(&on, &losses, 2.5, true).is_some());
    }

    #[test]
    fn a_flipped_bit_flips_back() {
        let mut rows = vec![0.75f32, 2.0];
        flip(&mut rows);
        assert_ne!(rows[0], 0.75);
        flip(&mut rows);
        assert_eq!(rows, [0.75, 2.0]);
    }
}
