-- distlab schema, version 21: what a step's FP8 casts saw.
--
-- `train.fp8`: the step's casts of the blocks' linear inputs, weights and output gradients
-- (amax, scales, saturated and flushed elements), as the JSON of `Fp8Metrics`; NULL for
-- runs without FP8.

ALTER TABLE metrics ADD COLUMN fp8 TEXT;
