"""The course machinery: grading, checks, labs, doctor, lab reference answers."""
