"""`dsv4batch eval`: lm-evaluation-harness tasks on the dsv4batch engine (the "dsv4batch" model).

    dsv4batch eval --model PATH|tiny --tasks T1,T2 [--include-path DIR] [--num-fewshot N] \\
        [--limit N] [--output-path DIR] [--log-samples] [--batch-size N] [--max-length N] \\
        [--gen-kwargs k=v,...] [--apply-chat-template] [--fewshot-as-multiturn] \\
        [--replicas N] [--tp T] [--ray-address ADDR] [--model-args k=v,...]

Runs `lm_eval.simple_evaluate(model="dsv4batch", ...)`, prints lm-eval's results table and, with
--output-path, writes what lm-eval's own CLI writes there (`results_<time>.json`, and with
--log-samples `samples_<task>_<time>.jsonl`) through its `EvaluationTracker`. Offline: the
Hugging Face hub and datasets are switched to offline mode unless the environment says
otherwise, so local task files (`dataset_path: json` + `data_files`) are what runs. Generative
tasks (`generate_until`, e.g. gsm8k) generate on the engine; --apply-chat-template renders the
prompts with the DSv4 chat encoding. A number that is not finite or out of range is refused up
front (`LIMITS`, one line). Exit codes: 0 done, 1 the run failed, 2 bad arguments, tasks, model
folder, or lm-eval not installed (the `eval` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4batch eval", description="Evaluate a DSv4 checkpoint with lm-evaluation-harness "
        "0.4.13 tasks (loglikelihood, multiple_choice, loglikelihood_rolling, generate_until) on "
        "the dsv4batch engine, in this process or on Ray.")
    p.add_argument("--model", required=True, help="Checkpoint folder or 'tiny'.")
    p.add_argument("--tasks", required=True, help="Comma-separated task, group or tag names.")
    p.add_argument("--include-path", help="Folder of task YAML files to add to lm-eval's.")
    p.add_argument("--num-fewshot", type=int, help="Few-shot examples per request.")
    p.add_argument("--limit", type=float, help="Documents per task (< 1: a fraction).")
    p.add_argument("--output-path", help="Folder for the results JSON (and samples).")
    p.add_argument("--log-samples", action="store_true",
                   help="Keep every request and response (written with --output-path).")
    p.add_argument("--batch-size", type=int, default=64,
                   help="Requests per engine call (per actor batch on Ray). Default: 64.")
    p.add_argument("--max-length", type=int,
                   help="Tokens the model sees per request, as lm-eval's hf max_length; longer "
                        "documents are scored in rolling windows. Default: 8191.")
    p.add_argument("--gen-kwargs",
                   help="Generation arguments for generate_until tasks, k=v,... over each task's "
                        "own (e.g. max_gen_toks=64,temperature=0.6,do_sample=true).")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="Render prompts as DSv4 chat conversations (the model's chat encoding; "
                        "thinking mode with --model-args thinking=true).")
    p.add_argument("--fewshot-as-multiturn", nargs="?", const=True, default=None,
                   type=lambda v: v.lower() in ("true", "1", "yes"),
                   help="Few-shot examples as user/assistant turns (true/false); on with "
                        "--apply-chat-template unless false, as in lm-eval's CLI.")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="Compute dtype; auto = bfloat16 on CUDA, float32 on CPU.")
    p.add_argument("--replicas", type=int, help="Score on Ray Data with this many replicas.")
    p.add_argument("--ray-address", help="Score on this Ray cluster ('local': a local Ray).")
    p.add_argument("--gpus-per-replica", type=float, help="GPUs per replica (per rank with --tp) on Ray.")
    p.add_argument("--tp", type=int, help="Ranks per replica (tensor + expert parallel) on Ray.")
    p.add_argument("--model-args", default="",
                   help="More backend arguments, k=v,...: add_bos_token, prefix_token_id, "
                        "max_gen_toks, seed, thinking, max_batched_tokens, planner, "
                        "cpus_per_replica, ...")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's random seeds. Default: 0.")
    return p


# every number option: (low, high, low_open) for `cli.bad_numbers`
LIMITS = {"num_fewshot": (0, None, False), "limit": (0, None, True), "batch_size": (1, None, False),
          "max_length": (2, None, False), "replicas": (1, None, False), "gpus_per_replica": (0, None, False),
          "tp": (1, None, False), "seed": (0, 2**32 - 1, False)}


def model_args(args) -> dict:
    """The backend's model arguments from the flags (and --model-args)."""
    from lm_eval.utils import simple_parse_args_string

    out = dict(pretrained=args.model, dtype=args.dtype)
    for key in ("max_length", "replicas", "tp", "ray_address", "gpus_per_replica"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    out.update(simple_parse_args_string(args.model_args) if args.model_args else {})
    return out


def check_tasks(names: list[str], manager) -> None:
    """Unknown names are a `UsageError` (before the model loads)."""
    import difflib

    from dsv4batch.jobspec.errors import UsageError

    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not os.path.exists(n)]
    if unknown:
        hints = {n: difflib.get_close_matches(n, known, n=1) for n in unknown}
        raise UsageError("unknown task(s): " + ", ".join(
            n + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in hints.items())
            + "; add a folder of task YAML files with --include-path")


def multiturn(args) -> bool:
    """--fewshot-as-multiturn, defaulting to --apply-chat-template (lm-eval's CLI rule);
    `UsageError` when asked for without a chat template."""
    from dsv4batch.jobspec.errors import UsageError

    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise UsageError("--fewshot-as-multiturn needs --apply-chat-template")
    return bool(args.apply_chat_template if args.fewshot_as_multiturn is None
                else args.fewshot_as_multiturn)


def check_gen_kwargs(text: str | None) -> None:
    """--gen-kwargs that the backend cannot honour are a `UsageError` (before the model loads)."""
    from lm_eval.utils import simple_parse_args_string

    from dsv4batch.eval.generation import DEFAULT_MAX_GEN_TOKS, parse_gen_kwargs
    from dsv4batch.jobspec.errors import UsageError

    if not text:
        return
    try:
        parse_gen_kwargs(simple_parse_args_string(text), "", DEFAULT_MAX_GEN_TOKS)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--gen-kwargs: {exc}") from None


def evaluate(args, log) -> dict:
    """Run the evaluation; returns lm-eval's results (samples included with --log-samples)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dsv4batch.eval  # noqa: F401 - registers the "dsv4batch" model with lm-eval
    from dsv4batch.pipeline.runner import check_model

    check_model(args.model, args.tp or 1)
    as_multiturn = multiturn(args)
    check_gen_kwargs(args.gen_kwargs)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=args.include_path)
    check_tasks(names, manager)
    tracker = None
    if args.output_path:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.output_path)
    t0 = time.time()
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(
        model="dsv4batch", model_args=model_args(args), tasks=names,
        num_fewshot=args.num_fewshot, batch_size=args.batch_size, limit=limit,
        log_samples=args.log_samples, evaluation_tracker=tracker, task_manager=manager,
        gen_kwargs=args.gen_kwargs, apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=as_multiturn,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed)
    log(f"[dsv4batch] eval of {len(names)} task(s) took {time.time() - t0:.1f}s")
    if tracker is not None:
        samples = results.get("samples") if args.log_samples else None
        tracker.save_results_aggregated(
            results={k: v for k, v in results.items() if k != "samples"}, samples=samples)
        for task in results.get("configs", {}) if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def main(argv: list[str]) -> int:
    """`dsv4batch eval ARGS` (argv without "eval"); returns the exit code."""
    from dsv4batch.jobspec.errors import UsageError, one_line

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from dsv4batch.jobs.cli import bad_numbers

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    bad = bad_numbers(args, LIMITS)
    if bad:
        log(f"dsv4batch eval: error: {'; '.join(bad)}")
        return 2
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        log("dsv4batch eval: error: lm-eval is not installed; pip install 'dsv4batch[eval]'")
        return 2
    try:
        results = evaluate(args, log)
    except UsageError as exc:
        log(f"dsv4batch eval: error: {exc}")
        return 2
    except KeyboardInterrupt:
        log("dsv4batch eval: interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user, the trace in a log file
        from dsv4batch.jobs.report import trace_file

        log(f"dsv4batch eval: failed: {one_line(exc)} (full trace: {trace_file(exc)})")
        return 1
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if not args.output_path:
        log("[dsv4batch] results: " + json.dumps(results.get("results", {}), default=str))
    return 0
