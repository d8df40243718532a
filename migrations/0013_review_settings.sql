-- distlab schema, version 13: each profile's scheduling settings.
--
-- desired_retention: the recall probability FSRS schedules for (0.9 unless chosen).
-- parameters: FSRS's parameters fitted to the profile's log, a JSON array (NULL: the
-- defaults); fit: the latest fit with its scores before and after, JSON (NULL: none).

ALTER TABLE profiles ADD COLUMN desired_retention DOUBLE PRECISION NOT NULL DEFAULT 0.9
  CHECK (desired_retention >= 0.7 AND desired_retention <= 0.97);
ALTER TABLE profiles ADD COLUMN parameters TEXT;
ALTER TABLE profiles ADD COLUMN fit TEXT;
