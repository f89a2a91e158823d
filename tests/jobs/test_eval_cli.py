"""`dsv4batch eval` refusals (exit 2 with the reason, before the model is loaded), and the
tiny model running a scoring and a generative task with the chat template."""

import pytest

from dsv4batch.jobs.score import main
from tests.eval.tasks import write_tasks


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder, [{"context": "a", "continuation": " b"}])
    return str(folder)


def run(capsys, *argv):
    code = main(["eval", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_usage_errors_exit_2(tasks, checkpoint, capsys, tmp_path):
    code, text = run(capsys, "--help")
    assert code == 0 and "--include-path" in text and "--log-samples" in text
    code, text = run(capsys, "--model", "tiny")
    assert code == 2 and "--tasks" in text
    code, text = run(capsys, "--model", "tiny", "--tasks", "tiny_mcq", "--include-path", tasks)
    assert code == 2 and "unknown task(s): tiny_mcq (did you mean 'tiny_mc'?)" in text
    code, text = run(capsys, "--model", "tiny", "--tasks", "tiny_gen", "--fewshot-as-multiturn")
    assert code == 2 and "--fewshot-as-multiturn needs --apply-chat-template" in text
    code, text = run(capsys, "--model", "tiny", "--tasks", "tiny_gen", "--gen-kwargs",
                     "max_gen_toks=4,repetition_penalty=1.1")
    assert code == 2 and "--gen-kwargs" in text and "['repetition_penalty']" in text
    code, text = run(capsys, "--model", str(tmp_path / "nope"), "--tasks", "tiny_mc",
                     "--include-path", tasks)
    assert code == 2 and "model" in text and "nope" in text


def test_tiny_model_runs_tasks_and_prints_the_table(tasks, capsys):
    code, text = run(capsys, "--model", "tiny", "--tasks", "tiny_mc,tiny_gen", "--include-path",
                     tasks, "--limit", "2", "--apply-chat-template", "--gen-kwargs",
                     "max_gen_toks=4")
    assert code == 0, text
    table = text.replace(" ", "")
    assert "|tiny_mc|" in table and "acc_norm" in text
    assert "|tiny_gen|" in table and "exact_match" in text  # generated, in chat form
