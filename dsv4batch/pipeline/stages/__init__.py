"""The per-row steps of the Ray Data graph, peers of each other: `Tokenize` (CPU actors) and
`ScoringActor` (one model replica per actor, loaded by `replica`).

A stage is a stateful class (heavy state in `__init__`) with a `spec` of the columns it reads
and writes. Stages import only the shared pipeline modules (`config`, `schema`, `errors`,
`faults`, `stats`) and the model; never the driver's (`graph`, `runner`, `metrics`, ...).
"""
