-- distlab schema, version 14: the validation loss of a step.
--
-- The mean loss on held-out data after the steps `train.eval_every` names (and the last);
-- NULL for the other steps and for runs before it was measured.

ALTER TABLE metrics ADD COLUMN val_loss DOUBLE PRECISION;
