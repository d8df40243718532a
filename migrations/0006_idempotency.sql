-- distlab schema, version 6: idempotent submissions.
--
-- A client that retries `POST /api/experiments` with the same `Idempotency-Key` header gets
-- the experiment its first request made, not a second one. Keys are per owner.

ALTER TABLE experiments ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX experiments_by_idempotency_key ON experiments (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
