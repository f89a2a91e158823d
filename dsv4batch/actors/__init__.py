"""Ray actors of the pipeline: `ScoringActor` (one DSv4 model replica per actor)."""
