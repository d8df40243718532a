-- distlab schema, version 20: a teacher's grades of the students' text answers.
--
-- One row per graded answer: the submission, the question's index, whether it is right,
-- who graded it and when. Grading the same answer again replaces the row. The answers a
-- run checks are never stored: their verdicts come from the run's measurements.

CREATE TABLE assignment_grades (
    submission_id  BIGINT NOT NULL REFERENCES assignment_submissions (id),
    question       BIGINT NOT NULL,
    is_right       BIGINT NOT NULL CHECK (is_right IN (0, 1)),
    graded_by      TEXT NOT NULL,
    graded_at      TEXT NOT NULL,
    PRIMARY KEY (submission_id, question)
);
