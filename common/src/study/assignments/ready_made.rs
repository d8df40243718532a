//! The assignments a teacher can hand out as they are (or start from): each a run a
//! student changes in one or two fields, and questions their own run answers.

use super::{ChoiceOption, NewAssignment, Quantity, Question, QuestionKind};
use crate::spec::*;

/// A rank of the ZeRO-2 assignment's model must stay under this many MiB: dp = 4 is the
/// smallest that does. The busiest rank's peak, measured (the planner within 0.3 MiB):
/// 56.7 MiB at dp = 2, 47.2 at dp = 4, 42.5 at dp = 8.
pub const ZERO2_LIMIT_MIB: f64 = 50.0;

/// The compression assignment's run with plain DDP ends at this loss (measured: 1.4799 after
/// its 300 steps; top-k at 5% ends at 1.4987, PowerSGD at rank 4 at 1.5043, both sending
/// about a tenth of DDP's 441,344 bytes per step. At 100 steps both were 13-26% above DDP:
/// error feedback needs the steps to catch up).
pub const DDP_FINAL_LOSS: f64 = 1.480;

/// Every ready-made assignment, in the order a course would hand them out.
pub fn ready_made() -> Vec<NewAssignment> {
    vec![zero2_memory(), pipeline_bubble(), compressed_gradients()]
}

fn question(prompt: &str, answer: QuestionKind) -> Question {
    Question { prompt: prompt.into(), answer }
}

fn option(label: String, value: f64) -> ChoiceOption {
    ChoiceOption { label, value }
}

/// "Find the smallest dp at which ZeRO-2 fits a rank under N MiB."
fn zero2_memory() -> NewAssignment {
    let mut spec = ExperimentSpec { name: "zero2-memory".into(), ..ExperimentSpec::default() };
    spec.model = ModelSpec::dense(4, 256, 4, 128, 256);
    spec.parallel.dp = 2;
    spec.parallel.sharding = Sharding::Zero2;
    spec.train.micro_batch = 2;
    spec.train.steps = 3;
    spec.train.warmup_steps = 1;
    let limit = ZERO2_LIMIT_MIB;
    NewAssignment {
        title: format!("ZeRO-2: the smallest dp that fits a rank under {limit:.0} MiB"),
        instructions: format!(
            "A 4-layer GPT (d_model 256, about 3.3 million parameters) trains in fp32 with AdamW \
             under **ZeRO-2**: every rank keeps all the parameters, but only its 1/dp share of \
             the gradients and of Adam's two moments.\n\n\
             1. Work out, before you run, what one rank holds at dp = 2, 4 and 8 \
             (parameters, gradients, optimizer state, activations), and what one device \
             would hold alone. The planner page helps.\n\
             2. Choose the **smallest dp** at which a rank stays under **{limit:.0} MiB**, run \
             it, and answer. Your run's memory page shows what every rank really held.\n\n\
             You may change only `parallel.dp`."
        ),
        spec,
        editable: vec!["parallel.dp".into()],
        due: None,
        questions: vec![
            question(
                "Predict the busiest rank's peak memory at your dp, in MiB (within 10%).",
                QuestionKind::Number { quantity: Quantity::PeakMemoryMib, tolerance: 0.10 },
            ),
            question(
                &format!("Does a rank of your run stay under {limit:.0} MiB?"),
                QuestionKind::Choice {
                    quantity: Quantity::PeakMemoryMib,
                    // The option nearest the measurement wins: the line between them is the limit.
                    options: vec![
                        option(format!("yes, under {limit:.0} MiB"), limit - 1.0),
                        option(format!("no, over {limit:.0} MiB"), limit + 1.0),
                    ],
                },
            ),
            question(
                "Which part of a rank's memory stops shrinking as dp grows, and what would shrink it?",
                QuestionKind::Text,
            ),
        ],
    }
}

/// "Measure the 1F1B bubble at M = 4 and M = 16 and say which formula it follows." Measured
/// on 2 cores: 43.8%, 45.9% and 49.6% at M = 4, 20.1% and 18.7% at M = 16 (the stages' passes
/// are not all equally long, and the slowest sets the pace), so a prediction by
/// (P-1)/(M+P-1) is right at both, one by (P-1)/M only where the two agree within the
/// tolerance (M = 16).
fn pipeline_bubble() -> NewAssignment {
    let mut spec = ExperimentSpec { name: "1f1b-bubble".into(), ..ExperimentSpec::default() };
    spec.model = ModelSpec::dense(4, 64, 4, 32, 64);
    spec.parallel.pp = 4;
    spec.parallel.pp_schedule = PpSchedule::OneFOneB;
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 4;
    spec.train.steps = 6;
    spec.train.warmup_steps = 1;
    NewAssignment {
        title: "1F1B: measure the bubble at M = 4 and M = 16".into(),
        instructions: "Four pipeline stages (P = 4) run the 1F1B schedule. A stage idles while the \
             pipeline fills and drains: that is the **bubble**.\n\n\
             Run the assignment twice, with `train.micro_batches` M = 4 and then M = 16, and \
             answer each time (every submission is kept). The run's pipeline page draws the \
             schedule it ran and measures the bubble, replaying each stage's passes with a core \
             of its own, as the formulas assume.\n\n\
             Two formulas are in circulation: (P-1)/M and (P-1)/(M+P-1). At M = 4 they are 75% \
             and 42.9%; at M = 16, 18.8% and 15.8%."
            .into(),
        spec,
        editable: vec!["train.micro_batches".into()],
        due: None,
        questions: vec![
            question(
                "Before you run: predict the bubble at your M, in percent, with the formula you \
                 trust (right within 25% of what your run measures).",
                QuestionKind::Number { quantity: Quantity::BubblePercent, tolerance: 0.25 },
            ),
            question(
                "Which formula does the bubble follow, what does the other one count instead, and \
                 why does the measurement at M = 16 sit a little above it?",
                QuestionKind::Text,
            ),
        ],
    }
}

/// "Compress DDP's gradients 10x and keep the final loss within 5% of DDP's."
fn compressed_gradients() -> NewAssignment {
    let mut spec = ExperimentSpec { name: "compressed-ddp".into(), ..ExperimentSpec::default() };
    spec.parallel.dp = 2;
    spec.parallel.grad_compression = GradCompression::Topk;
    spec.parallel.compression_ratio = 0.5;
    spec.train.micro_batch = 4;
    spec.train.steps = 300;
    let loss = DDP_FINAL_LOSS;
    NewAssignment {
        title: "Compress DDP's gradients 10x, keep the loss within 5%".into(),
        instructions: format!(
            "Two data-parallel ranks train the same model as the `ddp-2-ranks` preset. With plain \
             DDP its final loss is **{loss:.3}**.\n\n\
             Compress the gradients the ranks exchange so that a rank sends **about 10x fewer \
             bytes** per step than plain DDP does, and keep the final loss **within 5%** of \
             {loss:.3} at the same 300 steps. Choose the method (`topk` sends each kept value with its index; \
             `powersgd` sends two thin matrices per weight matrix) and its setting.\n\n\
             You may change `parallel.grad_compression`, `parallel.compression_ratio` and \
             `parallel.compression_rank`."
        ),
        spec,
        editable: vec![
            "parallel.grad_compression".into(),
            "parallel.compression_ratio".into(),
            "parallel.compression_rank".into(),
        ],
        due: None,
        questions: vec![
            question(
                "Predict the data-parallel bytes your busiest rank sends per step (within 10%).",
                QuestionKind::Number { quantity: Quantity::DpBytesPerStep, tolerance: 0.10 },
            ),
            question(
                &format!("Is your run's final loss within 5% of plain DDP's {loss:.3}?"),
                QuestionKind::Choice {
                    quantity: Quantity::FinalLoss,
                    // The option nearest the measurement wins: the line between them is 1.05x.
                    options: vec![
                        option("yes, within 5% (or lower)".into(), loss),
                        option("no, more than 5% higher".into(), loss * 1.10),
                    ],
                },
            ),
            question("Why does compressing the gradients cost so little loss here (or so much)?", QuestionKind::Text),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::validate::Limits;

    #[test]
    fn every_ready_made_assignment_is_valid_and_runs_on_the_default_limits() {
        for a in ready_made() {
            assert!(a.problems().is_empty(), "{}: {:?}", a.title, a.problems());
            assert!(
                a.spec.validate(&Limits::default()).is_ok(),
                "{}: {:?}",
                a.title,
                a.spec.validate(&Limits::default())
            );
            for field in &a.editable {
                assert!(!super::super::editable_fields(&a.spec, &[field.clone()]).is_empty(), "{field}");
            }
        }
    }
}
