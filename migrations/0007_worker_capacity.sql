-- distlab schema, version 7: what a worker's machine has, as it reports it when it
-- registers (NULL from a worker that does not say). Submissions whose ranks need more
-- memory than the largest live worker has are refused.

ALTER TABLE workers ADD COLUMN memory_bytes BIGINT;
ALTER TABLE workers ADD COLUMN cores BIGINT;
ALTER TABLE workers ADD COLUMN gpus BIGINT;
