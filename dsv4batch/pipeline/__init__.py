"""The pipeline on Ray Data: scoring and generation.

`score(dataset, config)` / `generate(dataset, config)` append the stages (tokenize -> replica
actors) to any Ray Data dataset, `score_tokenized(dataset, config)` /
`generate_tokenized(dataset, config)` the scoring / generation stage alone to a dataset of
token-id requests; `run(config)` is the whole job behind `dsv4batch score|generate` (read,
process, write, metrics). Ray and torch are imported only when these are called.
"""

from dsv4batch.jobspec.config import GenerateConfig, ScoreConfig
from dsv4batch.jobspec.errors import UsageError

__all__ = ["GenerateConfig", "ScoreConfig", "UsageError", "generate", "generate_tokenized", "run",
           "score", "score_tokenized"]


def score(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import score as _score

    return _score(dataset, config, **kwargs)


def generate(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import generate as _generate

    return _generate(dataset, config, **kwargs)


def score_tokenized(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import score_tokenized as _score_tokenized

    return _score_tokenized(dataset, config, **kwargs)


def generate_tokenized(dataset, config, **kwargs):
    from dsv4batch.pipeline.graph import generate_tokenized as _generate_tokenized

    return _generate_tokenized(dataset, config, **kwargs)


def run(config):
    from dsv4batch.pipeline.runner import run as _run

    return _run(config)
