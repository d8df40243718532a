//! Pipeline schedules: in which order one stage runs the forward and backward passes of
//! the M micro-batches of a step. Plain functions of (P stages, this stage, M), so they can
//! be read, printed and tested on their own.
//!
//! ```text
//! GPipe, P = 3, M = 4 (F = forward, B = backward, . = idle):
//!   stage 0:  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
//!   stage 1:  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
//!   stage 2:  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
//!
//! 1F1B, P = 3, M = 4: warm-up (P - stage - 1 forwards), steady state (one forward, one
//! backward), cool-down (the remaining backwards). In order of execution:
//!   stage 0:  F0 F1 | F2 B0 F3 B1 | B2 B3
//!   stage 1:  F0    | F1 B0 F2 B1 F3 B2 | B3
//!   stage 2:        | F0 B0 F1 B1 F2 B2 F3 B3 |
//! ```
//!
//! Both leave the same bubble, (P-1)/(M+P-1) of the step on equal stages; 1F1B holds at
//! most P - stage micro-batches' activations at once where GPipe holds all M.

use crate::spec::PpSchedule;

/// One pass of one micro-batch on this stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Forward { micro: usize },
    Backward { micro: usize },
}

/// All M forwards, then all M backwards.
pub fn gpipe(micro_batches: usize) -> Vec<Action> {
    let forwards = (0..micro_batches).map(|micro| Action::Forward { micro });
    let backwards = (0..micro_batches).map(|micro| Action::Backward { micro });
    forwards.chain(backwards).collect()
}

/// One forward, one backward (PipeDream-Flush), for `stage` of `stages`.
pub fn one_f_one_b(stages: usize, stage: usize, micro_batches: usize) -> Vec<Action> {
    let warmup = warmup_forwards(stages, stage, micro_batches);
    let mut actions: Vec<Action> = (0..warmup).map(|micro| Action::Forward { micro }).collect();
    // Steady state: the forward of micro-batch warmup + i, then the backward of i.
    for i in 0..micro_batches - warmup {
        actions.push(Action::Forward { micro: warmup + i });
        actions.push(Action::Backward { micro: i });
    }
    // Cool-down: the backwards still owed.
    actions.extend((micro_batches - warmup..micro_batches).map(|micro| Action::Backward { micro }));
    actions
}

/// Forwards a 1F1B stage runs before its first backward.
fn warmup_forwards(stages: usize, stage: usize, micro_batches: usize) -> usize {
    (stages - stage - 1).min(micro_batches)
}

/// The schedule `kind` for `stage` of `stages`.
pub fn schedule(kind: PpSchedule, stages: usize, stage: usize, micro_batches: usize) -> Vec<Action> {
    match kind {
        PpSchedule::Gpipe => gpipe(micro_batches),
        PpSchedule::OneFOneB => one_f_one_b(stages, stage, micro_batches),
    }
}

/// Micro-batches whose activations a stage holds at once: GPipe all M, 1F1B one more than
/// its warm-up.
pub fn activations_in_flight(kind: PpSchedule, stages: usize, stage: usize, micro_batches: usize) -> usize {
    match kind {
        PpSchedule::Gpipe => micro_batches,
        PpSchedule::OneFOneB => (warmup_forwards(stages, stage, micro_batches) + 1).min(micro_batches),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    #[test]
    fn one_f_one_b_warms_up_then_alternates() {
        assert_eq!(
            one_f_one_b(3, 0, 4),
            vec![
                Forward { micro: 0 },
                Forward { micro: 1 },
                Forward { micro: 2 },
                Backward { micro: 0 },
                Forward { micro: 3 },
                Backward { micro: 1 },
                Backward { micro: 2 },
                Backward { micro: 3 },
            ]
        );
        // The last stage has no warm-up; a single stage is plain accumulation.
        assert_eq!(
            one_f_one_b(3, 2, 2),
            vec![Forward { micro: 0 }, Backward { micro: 0 }, Forward { micro: 1 }, Backward { micro: 1 }]
        );
        assert_eq!(one_f_one_b(1, 0, 2), one_f_one_b(3, 2, 2));
        // Fewer micro-batches than stages: every forward is warm-up.
        assert_eq!(one_f_one_b(4, 0, 2), gpipe(2));
    }

    #[test]
    fn every_micro_batch_runs_forward_then_backward_once_and_the_most_in_flight_is_the_formula() {
        for kind in [PpSchedule::Gpipe, PpSchedule::OneFOneB] {
            for stages in 1..=4 {
                for stage in 0..stages {
                    for m in 1..=9 {
                        let actions = schedule(kind, stages, stage, m);
                        assert_eq!(actions.len(), 2 * m);
                        let mut in_flight = 0;
                        let mut most = 0;
                        let mut forwarded = vec![false; m];
                        let mut done = vec![false; m];
                        for a in actions {
                            match a {
                                Forward { micro } => {
                                    assert!(!forwarded[micro], "{kind:?} P={stages} s={stage} M={m}: forward twice");
                                    forwarded[micro] = true;
                                    in_flight += 1;
                                    most = most.max(in_flight);
                                }
                                Backward { micro } => {
                                    assert!(forwarded[micro] && !done[micro], "backward of {micro} before its forward");
                                    done[micro] = true;
                                    in_flight -= 1;
                                }
                            }
                        }
                        assert_eq!(
                            most,
                            activations_in_flight(kind, stages, stage, m),
                            "{kind:?} P={stages} s={stage} M={m}"
                        );
                        assert!(done.iter().all(|&d| d));
                    }
                }
            }
        }
    }
}
