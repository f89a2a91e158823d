"""The layering, read from the imports: jobs -> (eval ->) pipeline -> actors -> jobspec -> model ->
planner/kernels; nothing imports upward.

Every `import` and `from ... import` in the package (lazy ones inside functions included) is
read with `ast`; an import that runs against the flow fails with the file and the name. `jobspec`
(what a job is: its config, columns, errors, statistics records) is what the driver and the
replica actors share, below both. One part reaches into the pipeline, and only into its shared
modules: its per-row `stages` (peers of the driver's modules), never the driver's own (`graph`,
`runner`, `metrics`, ...).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dsv4batch"
# what each part may import from the package, besides itself
ALLOWED = {
    "planner": set(),
    "kernels": set(),
    "model": {"planner", "kernels"},
    # what a job is (config, columns, errors, statistics): the model's torch-free config and stats, the planners' names
    "jobspec": {"model", "planner"},
    # the replica actors: what a job is, and the model
    "actors": {"jobspec", "model", "planner", "kernels"},
    # the stages are peers: they share the pipeline's common modules, never the driver's
    "pipeline/stages": {"jobspec", "model", "planner", "kernels", "pipeline/openai_batch"},
    "pipeline": {"actors", "jobspec", "model", "planner", "kernels", "pipeline/stages"},
    # the lm-eval backend: a client of the pipeline (and its replica loader) and the model
    "eval": {"pipeline", "pipeline/stages", "actors", "jobspec", "model", "planner", "kernels"},
    "jobs": {"eval", "pipeline", "pipeline/stages", "actors", "jobspec", "model", "planner", "kernels"},
}
# parts that may reach into the pipeline only module by module (its shared modules, listed above)
LEAF_CLIENTS = ("pipeline/stages",)


def part_of(module: str) -> str | None:
    """'dsv4batch.pipeline.stages.tokenize' -> 'pipeline/stages'; the part it belongs to."""
    parts = module.split(".")[1:]
    if parts[:2] == ["pipeline", "stages"]:
        return "pipeline/stages"
    return parts[0] if parts and parts[0] in ALLOWED else None


def imports(path: pathlib.Path, module: str):
    """Absolute names of the modules `path` (the module `module`) imports."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = ".".join([*module.split(".")[:-node.level], *filter(None, [node.module])])
            else:
                base = node.module
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                yield sub if is_module(sub) else base


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def violations(path: pathlib.Path, module: str) -> list[str]:
    mine = part_of(module)
    if mine is None:
        return []
    bad = []
    for name in imports(path, module):
        target = part_of(name) if name.startswith("dsv4batch.") else None
        if target is None or target == mine:
            continue
        if mine in LEAF_CLIENTS and target == "pipeline":
            target = "pipeline/" + (name.split(".") + ["__init__"])[2]
        if target not in ALLOWED[mine]:
            bad.append(f"{module} imports {name} ({mine} -> {target})")
    return bad


def files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "bench" not in p.parts)


@pytest.mark.parametrize("path", files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_flow(path):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    assert violations(path, module) == []


def test_the_rule_catches_imports_against_the_flow(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from dsv4batch.jobspec.config import ScoreConfig\n"
                 "def g():\n    from dsv4batch.pipeline import graph\n"
                 "    from ..metrics import start_collector\n")
    assert violations(f, "dsv4batch.pipeline.stages.x") == [
        "dsv4batch.pipeline.stages.x imports dsv4batch.pipeline.graph "
        "(pipeline/stages -> pipeline/graph)",
        "dsv4batch.pipeline.stages.x imports dsv4batch.pipeline.metrics "
        "(pipeline/stages -> pipeline/metrics)"]
    f.write_text("from dsv4batch.jobspec.config import ScoreConfig\n"
                 "from dsv4batch.pipeline.stages.tokenize import Tokenize\n"
                 "def g():\n    from dsv4batch.pipeline.runner import run\n")
    assert violations(f, "dsv4batch.actors.x") == [
        "dsv4batch.actors.x imports dsv4batch.pipeline.stages.tokenize (actors -> pipeline/stages)",
        "dsv4batch.actors.x imports dsv4batch.pipeline.runner (actors -> pipeline)"]
    f.write_text("from dsv4batch.model.config import ATTN_BACKENDS\n"
                 "from dsv4batch.pipeline.formats import FORMATS\n"
                 "def g():\n    from dsv4batch.actors.guard import Guard\n")
    assert violations(f, "dsv4batch.jobspec.x") == [
        "dsv4batch.jobspec.x imports dsv4batch.pipeline.formats (jobspec -> pipeline)",
        "dsv4batch.jobspec.x imports dsv4batch.actors.guard (jobspec -> actors)"]
    f.write_text("from dsv4batch.actors.score import ScoringActor\n")
    assert violations(f, "dsv4batch.model.x") == [
        "dsv4batch.model.x imports dsv4batch.actors.score (model -> actors)"]
    f.write_text("import dsv4batch.jobspec.errors\n")
    assert violations(f, "dsv4batch.model.x") == [
        "dsv4batch.model.x imports dsv4batch.jobspec.errors (model -> jobspec)"]
