-- distlab schema, version 4: dynamic loss scaling (fp16) in the metrics.
--
-- Both are NULL for runs without loss scaling: the factor a step's loss was multiplied
-- by, and how many steps had been skipped by then because their gradients overflowed.

ALTER TABLE metrics ADD COLUMN loss_scale DOUBLE PRECISION;
ALTER TABLE metrics ADD COLUMN skipped_steps BIGINT CHECK (skipped_steps >= 0);
