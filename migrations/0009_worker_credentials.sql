-- distlab schema, version 9: each worker gets its own credential when it registers (the
-- shared worker token only registers); the SHA-256 of it is kept, never the credential.
-- And the memory of a worker's smallest GPU, for admission control of CUDA runs.

ALTER TABLE workers ADD COLUMN credential_sha256 TEXT;
ALTER TABLE workers ADD COLUMN gpu_memory_bytes BIGINT;
CREATE UNIQUE INDEX workers_by_credential ON workers (credential_sha256);
