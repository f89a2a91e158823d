"""The per-row steps of the Ray Data graph that own no model: `Tokenize` (CPU actors).

The steps that own a model replica (`ScoringActor`, `GenerateActor`) are in `dsv4batch.actors`.
A stage is a stateful class (heavy state in `__init__`) with a `spec` of the columns it reads
and writes. Stages import only what a job is (`dsv4batch.jobspec`: config, schema, errors), the
pipeline's `openai_batch` and the model; never the driver's (`graph`, `runner`, `metrics`, ...).
"""
