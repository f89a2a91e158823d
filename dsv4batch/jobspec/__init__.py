"""What a job is, shared by the driver and the replica actors: its validated configuration
(`config`: `ScoreConfig`, `GenerateConfig`; what they share: `config_base`), its columns and
output schema (`schema`), its errors and what Ray retries (`errors`), and its statistics records
(`stats`: `BatchStats`, what an actor did per batch; `Written`, what the sink wrote).

It sits below the pipeline and the actors and above the model: it imports only the model's
torch-free `model.config` / `model.stats` and the planner's names. Importing it loads neither
torch, Ray nor pyarrow.
"""
