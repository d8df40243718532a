-- distlab schema, version 11: the share of the logit gradients stored as 0 in a step.
--
-- Sampled on the step's first backward (its first 64 tokens) by a rank holding the LM
-- head; NULL from runs before it was measured and from ranks without the head. In fp16
-- without loss scaling it is the share that underflowed.

ALTER TABLE metrics ADD COLUMN logit_grad_zero_share DOUBLE PRECISION
  CHECK (logit_grad_zero_share IS NULL OR (logit_grad_zero_share >= 0 AND logit_grad_zero_share <= 1));
