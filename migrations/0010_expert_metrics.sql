-- distlab schema, version 10: Mixture-of-Experts routing in the metrics.
--
-- All NULL for dense models: the mean of the routers' load-balancing losses in a step,
-- the token-to-expert assignments they made and how many of those were dropped because
-- the expert's capacity was full.

ALTER TABLE metrics ADD COLUMN expert_balance DOUBLE PRECISION;
ALTER TABLE metrics ADD COLUMN expert_assignments BIGINT CHECK (expert_assignments >= 0);
ALTER TABLE metrics ADD COLUMN expert_dropped BIGINT CHECK (expert_dropped >= 0);
