-- distlab schema, version 19: a teacher's assignments and the students' submissions.
--
-- An assignment is its title, who wrote it and when, and its content as JSON
-- (distlab_common::assignments::NewAssignment: instructions, the starting spec, the fields
-- students may change, the due time, the questions). A submission is a student's run (an
-- experiment of theirs) with their answers as JSON; every submission is kept, so a
-- resubmission adds a row. Verdicts are not stored: they are computed from the run's own
-- measurements whenever a submission is shown.

CREATE TABLE assignments (
    id          INTEGER PRIMARY KEY,
    title       TEXT NOT NULL,
    created_by  TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    content     TEXT NOT NULL
);

CREATE TABLE assignment_submissions (
    id             INTEGER PRIMARY KEY,
    assignment_id  BIGINT NOT NULL REFERENCES assignments (id),
    student        TEXT NOT NULL,
    experiment_id  BIGINT NOT NULL,
    answers        TEXT NOT NULL,
    late           BIGINT NOT NULL CHECK (late IN (0, 1)),
    submitted_at   TEXT NOT NULL
);

CREATE INDEX assignment_submissions_by_assignment ON assignment_submissions (assignment_id, student);
