"""The replica side: every Ray actor that owns a DSv4 model replica, and what only they use.

`ReplicaActor` (`replica`: load once, guard each batch, report its stats) and its Ray Data steps
`ScoringActor` (`score`) and `GenerateActor` (`generate`); the replica's model (`engine`:
`load_engine`, on the device and dtype of `device`), a --tp replica's rank workers in a placement
group (`shards`), the actor's half of fault handling (`guard`), the hang `watchdog` and the
Prometheus `telemetry`.

The pipeline's driver places these actors (`pipeline.graph`); they import only what a job is
(`jobspec`: its config, schema, errors and statistics records) and the model, never the pipeline.
Importing this package loads neither torch nor Ray.
"""
