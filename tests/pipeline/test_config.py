"""ScoreConfig / GenerateConfig validation and the CLI generated from them (no Ray, no torch)."""


import pytest

from dsv4batch.jobs.cli import build_parser, parse_config
from dsv4batch.jobspec.config import GenerateConfig, ScoreConfig, cli_fields
from dsv4batch.jobspec.errors import UsageError


@pytest.mark.parametrize("cls", [ScoreConfig, GenerateConfig])
def test_defaults_are_valid_and_every_field_is_documented(cls):
    cfg = cls()
    for name, f in cls.model_fields.items():
        if name != "task":
            assert len(f.description) > 15 and f.json_schema_extra["group"], name
    assert cfg.model == "tiny" and cfg.text_column == "prompt" and cfg.id_column == "id"
    assert not {"planner", "sort_by_length"} & set(cli_fields(cls))  # benchmark knobs: Python only


@pytest.mark.parametrize("bad, match", [
    ({"replica": 2}, "did you mean 'replicas'"),
    ({"replicas": 0}, "must be >= 1"),
    ({"replicas": "2"}, "expected int"),
    ({"max_block_mib": float("nan")}, "finite number"),
    ({"batch_timeout_s": float("inf")}, "finite number"),
    ({"planner": "greedy"}, "not one of"),
    ({"dtype": "int8"}, "not one of"),
    ({"token_logprobs": 1}, "expected bool"),
    ({"gpus_per_replica": -1}, "must be >= 0"),
    ({"target_column": "prompt"}, "must differ"),
    ({"keep_columns": ["logprob_sum"]}, "clash"),
    ({"keep_columns": ["key"], "id_column": "key"}, "always written"),
    ({"keep_columns": ["truncated_tokens"]}, "clash"),
    ({"truncate": "middle"}, "not one of"),
    ({"max_batch_attempts": 0}, "must be >= 1"),
    ({"max_actor_restarts": -2}, "must be >= -1"),
    ({"max_errored_rows": -1}, "must be >= 0"),
    ({"resume": True, "overwrite": True}, "give one of them"),
])
def test_rejects_bad_values(bad, match):
    with pytest.raises(UsageError, match=match):
        ScoreConfig.from_dict(bad)


def test_normalizes_and_round_trips():
    cfg = ScoreConfig(keep_columns="a, b", gpus_per_replica=1, cpus_per_replica=1)
    assert cfg.keep_columns == ("a", "b") and cfg.gpus_per_replica == 1.0
    assert ScoreConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(ScoreConfig.from_dict(cfg.to_dict()))
    assert cfg.replace(replicas=3).replicas == 3
    with pytest.raises(UsageError):
        cfg.replace(replicas=-1)


def test_engine_kwargs_build_the_model_engine_config():
    from dsv4batch.model import EngineConfig

    eng = EngineConfig(**ScoreConfig(max_batched_tokens=512, prefill_chunk_size=2).engine_kwargs())
    assert eng.max_num_batched_tokens == 512 and eng.prefill_chunk_size == 2
    EngineConfig(**ScoreConfig().engine_kwargs())
    cfg = ScoreConfig(head_precision="bf16")
    assert EngineConfig(**cfg.engine_kwargs()).head_precision == "bf16"
    assert cfg.result_fields()["head_precision"] == "bf16"  # resume refuses a run in the other precision


def test_cli_has_an_option_per_field_and_parses_them():
    help_text = build_parser().format_help()
    assert "score" in help_text
    cfg = parse_config(["score", "in.parquet", "out", "--replicas", "2", "--gpus-per-replica", "0.5",
                        "--target-column", "t", "--keep-columns", "a,b", "--token-logprobs",
                        "--attn-backend", "torch", "--prefill-chunk-size", "none"])
    assert (cfg.input, cfg.output, cfg.replicas, cfg.gpus_per_replica) == ("in.parquet", "out", 2, 0.5)
    assert cfg.keep_columns == ("a", "b") and cfg.token_logprobs and cfg.attn_backend == "torch"
    assert cfg.engine_kwargs()["attn_backend"] == "torch"  # reaches every replica with the config
    assert cfg.prefill_chunk_size is None and cfg.target_column == "t"
    cfg = parse_config(["in", "out", "--resume", "--truncate", "left", "--max-errored-rows", "none",
                        "--max-actor-restarts", "-1", "--max-batch-attempts", "5"])
    assert cfg.resume and cfg.truncate == "left" and cfg.max_errored_rows is None
    assert (cfg.max_actor_restarts, cfg.max_batch_attempts) == (-1, 5)
    assert "truncate" in cfg.result_fields() and "max_errored_rows" not in cfg.result_fields()
    sub_help = build_parser()._subparsers._group_actions[0].choices["score"].format_help()
    assert "0.1% of the rows" in sub_help  # a literal % survives argparse's %-formatting
    # `python -m dsv4batch.jobs.score INPUT OUTPUT` (no subcommand word) means the same
    assert parse_config(["in", "out"]) == ScoreConfig(input="in", output="out")
    sub = build_parser()._subparsers._group_actions[0].choices["score"]
    dests = {a.dest for a in sub._actions}
    assert set(cli_fields(ScoreConfig)) <= dests


def test_import_is_light(run_python):
    code = ("import sys, dsv4batch, dsv4batch.pipeline, dsv4batch.jobs.cli, dsv4batch.jobs.score; "
            "print(sorted(m for m in ('torch', 'ray', 'pyarrow', 'transformers') if m in sys.modules))")
    out = run_python(code, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv, code, message", [
    (["score", "/nonexistent/in.parquet", "out"], 2, "does not exist"),
    (["score", "in.parquet", "out", "--replicas", "0"], 2, "must be >= 1"),
    (["score", "in.parquet", "out", "--bogus"], 2, "unrecognized arguments"),
    (["score", "--help"], 0, "--max-batched-tokens"),
])
def test_cli_exit_codes(argv, code, message, tmp_path, run_cli):
    out = run_cli(*argv, cwd=tmp_path, timeout=120)
    assert out.returncode == code, out.stderr
    assert message in out.stdout + out.stderr


def test_input_format_and_top_logprobs_options():
    cfg = parse_config(["in.csv", "out", "--input-format", "csv", "--top-logprobs", "5"])
    assert cfg.input_format == "csv" and cfg.top_logprobs == 5
    assert parse_config(["in", "out", "--input-format", "none"]).input_format is None
    assert cfg.result_fields()["top_logprobs"] == 5  # resume refuses another K
    with pytest.raises(UsageError, match="'input_format': 'xml' is not one of"):
        ScoreConfig(input_format="xml")
    with pytest.raises(UsageError, match="must be >= 0"):
        ScoreConfig(top_logprobs=-1)
    with pytest.raises(UsageError, match=r"clash with output columns"):
        ScoreConfig(keep_columns=("top_ids",))


def test_generate_cli_and_config():
    cfg = parse_config(["generate", "in.jsonl", "out", "--max-tokens", "64", "--temperature", "0.7",
                        "--stop", "###,\n\n", "--stop-token-ids", "1,2", "--sampling-params-column", "params",
                        "--logprobs", "--top-logprobs", "3", "--max-cache-mib", "512", "--seed", "7"])
    assert isinstance(cfg, GenerateConfig) and cfg.task == "generate" and cfg.batch_size == 256
    assert (cfg.max_tokens, cfg.temperature, cfg.stop, cfg.stop_token_ids) == (64, 0.7, ("###", "\n\n"), (1, 2))
    assert cfg.row_columns() == ("params",) and cfg.engine_kwargs()["max_cache_mib"] == 512
    assert cfg.sampling_defaults().top_logprobs == 3
    assert cfg.result_fields()["task"] == "generate" and cfg.result_fields()["seed"] == 7
    assert GenerateConfig.from_dict(cfg.to_dict()) == cfg
    assert "generated_text" in cfg.output_columns() and "generated_logprobs" in cfg.output_columns()


@pytest.mark.parametrize("bad, match", [
    ({"temperature": -1.0}, "'temperature': must be >= 0"),
    ({"top_p": 0.0}, "'top_p': must be > 0"),
    ({"top_p": 1.5}, "'top_p': must be <= 1"),
    ({"max_tokens": 0}, "'max_tokens': must be >= 1"),
    ({"stop": ["ok", ""]}, "stop must be a list of non-empty strings"),
    ({"stop_token_ids": "1,x"}, "comma-separated integers"),
    ({"sampling_params_column": "prompt"}, "must differ"),
    ({"keep_columns": ["generated_text"]}, "clash"),
    ({"target_column": "t"}, "unknown config field 'target_column'"),
])
def test_generate_config_refuses_bad_values(bad, match):
    with pytest.raises(UsageError, match=match):
        GenerateConfig.from_dict(bad)


def test_generate_cli_refuses_a_bad_default_before_start(tmp_path, capsys):
    from dsv4batch.jobs.generate import main

    assert main([str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "'temperature': must be >= 0" in err, err
