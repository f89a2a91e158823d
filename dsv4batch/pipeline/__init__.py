"""The scoring pipeline on Ray Data.

`score(dataset, config)` appends the stages (tokenize -> `ScoringActor`) to any Ray Data dataset;
`run(config)` is the whole job behind `dsv4batch score` (read, score, write, metrics).
Ray and torch are imported only when these are called.
"""

from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError

__all__ = ["ScoreConfig", "UsageError", "run", "score"]


def score(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import score as _score

    return _score(dataset, config, **kwargs)


def run(config):
    from dsv4batch.pipeline.runner import run as _run

    return _run(config)
