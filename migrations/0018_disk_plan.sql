-- distlab schema, version 18: the disk an experiment's files take, for the per-account quota.
--
-- Set at submission from the spec (distlab_common::disk::DiskPlan): one complete checkpoint's
-- bytes and the model's; the model's replaced by the size of the file stored when the worker
-- hands it over. 0 for experiments submitted before (their files are not counted).

ALTER TABLE experiments ADD COLUMN disk_checkpoint_bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE experiments ADD COLUMN disk_model_bytes BIGINT NOT NULL DEFAULT 0;
