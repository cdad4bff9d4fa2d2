"""Grading: rewards for candidate programs, run in forked sandboxes.

- grade.py: `UnitTestReward`, `PropertyReward`, `grade`, `grade_batch`, `extract_code`,
  `GradeResult`, `trl_reward_func` (asserts and properties over a candidate's functions);
- iotest.py: `IOTestReward`, `outputs_match` (stdin/stdout cases, competitive-programming style);
- grade_many.py: `grade_many`, one batch over specs of any kind, in input order;
- pool.py: prepared templates, a spec's setup and grader checkpointed once and forked per candidate;
- harness.py and iotest_guest.py: the in-guest sides of grade.py and iotest.py (stdlib only: their
  source is sent into the sandbox, never imported on the host).

integrations/ (TRL, veRL, score_rows) sits on top of these. Nothing is imported here (no cycles,
cheap imports); the public names are re-exported from `collimate_core`.
"""
