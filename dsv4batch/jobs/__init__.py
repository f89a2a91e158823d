"""Job entry points: `dsv4batch score` / `python -m dsv4batch.jobs.score` (also under `ray job submit`)."""
