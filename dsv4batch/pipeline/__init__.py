"""The scoring pipeline on Ray Data.

`score(dataset, config)` appends the stages (tokenize -> `ScoringActor`) to any Ray Data dataset,
`score_tokenized(dataset, config)` the scoring stage alone to a dataset of token-id requests;
`run(config)` is the whole job behind `dsv4batch score` (read, score, write, metrics).
Ray and torch are imported only when these are called.
"""

from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError

__all__ = ["ScoreConfig", "UsageError", "run", "score", "score_tokenized"]


def score(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import score as _score

    return _score(dataset, config, **kwargs)


def score_tokenized(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import score_tokenized as _score_tokenized

    return _score_tokenized(dataset, config, **kwargs)


def run(config):
    from dsv4batch.pipeline.runner import run as _run

    return _run(config)
