"""Local lm-eval tasks written by the tests (JSONL data + task YAML, `dataset_path: json`), and
the checkpoint folder lm-eval's `hf` backend loads (the DSv4 tokenizer with its config)."""

import json
import os

from dsv4batch.model.tokenizer import packaged_tokenizer_path

MC_DOCS = [
    {"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b),
                                                        "none of these"], "label": i % 4}
    for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)])]
PPL_DOCS = [
    "Offline batch scoring reads many rows and writes their scores back to files.",
    "A short one.",
    # longer than the max_length the tests use: scored in several rolling windows
    " ".join(f"Sentence {i} says that Ray Data streams blocks between tasks and actors, and "
             "that every row comes out exactly once." for i in range(6)),
]


def hf_folder(checkpoint: str, path) -> str:
    """`checkpoint`'s files linked into `path`, plus the tokenizer_config.json AutoTokenizer
    reads (bos/eos tokens), so lm-eval's hf backend loads the same DSv4 tokenizer.json."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(checkpoint):
        os.symlink(os.path.join(checkpoint, name), os.path.join(path, name))
    config = os.path.join(os.path.dirname(packaged_tokenizer_path()), "tokenizer_config.json")
    with open(config) as f, open(os.path.join(path, "tokenizer_config.json"), "w") as out:
        out.write(f.read())
    return str(path)


def _write(folder, name: str, docs: list[dict], yaml_body: str) -> None:
    data = os.path.join(folder, f"{name}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {data}\ntest_split: test\n{yaml_body}")


def write_tasks(folder, greedy_docs: list[dict]) -> list[str]:
    """tiny_mc (multiple_choice: acc, acc_norm), tiny_greedy (loglikelihood: perplexity and acc,
    i.e. is_greedy), tiny_ppl (loglikelihood_rolling: word/byte perplexity, bits per byte) and
    tiny_gen (generate_until) in `folder`; returns the names of the first three."""
    os.makedirs(folder, exist_ok=True)
    _write(folder, "tiny_mc", MC_DOCS,
           'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
           'doc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
           "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    _write(folder, "tiny_greedy", greedy_docs,
           'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
           'doc_to_target: "{{continuation}}"\n'
           "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    _write(folder, "tiny_ppl", [{"text": t} for t in PPL_DOCS],
           "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
           'doc_to_target: "{{text}}"\n'
           "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
           "  - metric: bits_per_byte\n")
    _write(folder, "tiny_gen", [{"q": "Say hi"}],
           'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "hi"\n'
           "generation_kwargs:\n  until: ['\\n']\nmetric_list:\n  - metric: exact_match\n")
    return ["tiny_mc", "tiny_greedy", "tiny_ppl"]


def greedy_docs(model, tokenizer) -> list[dict]:
    """loglikelihood docs: continuations that are the hf model's greedy next token (when the
    text round-trips through the tokenizer) and continuations that are not."""
    import torch

    docs = []
    for context in ("The capital of France is", "Ray Data streams", "One, two, three,",
                    "Offline batch", "The quick brown fox"):
        ids = tokenizer.encode(context)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        token = int(logits.argmax())
        text = tokenizer.decode([token])
        if text.strip() and tokenizer.encode(context + text) == ids + [token]:
            docs.append({"context": context, "continuation": text})
        docs.append({"context": context, "continuation": " and the rest"})
    assert any(d["continuation"] != " and the rest" for d in docs), "no greedy doc round-trips"
    return docs


# gsm8k-style problems (few-shot examples from "train", evaluated on "test"). The random test
# model never writes "#### N", so strict-match's answer is always "[invalid]" (the regex filter's
# fallback): the problems whose answer is "#### [invalid]" make exact_match non-zero, and the
# flexible filter's "last number" of the garbage text decides theirs there.
GSM_TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "He has 3 + 4 = 7 apples.\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 2 boxes?",
     "answer": "2 boxes hold 2 * 12 = 24 eggs.\n#### 24"},
    {"question": "Sara reads 5 pages a day. How many pages does she read in a week?",
     "answer": "A week has 7 days, so 7 * 5 = 35 pages.\n#### 35"},
    {"question": "A cat sleeps 15 hours a day. How many hours is it awake?",
     "answer": "A day has 24 hours: 24 - 15 = 9.\n#### 9"},
    {"question": "Ann had 20 dollars and spent 8. How much is left?",
     "answer": "20 - 8 = 12 dollars.\n#### 12"},
    {"question": "Six friends share 18 cookies equally. How many each?",
     "answer": "18 / 6 = 3 cookies.\n#### 3"},
]
GSM_TEST = [
    {"question": f"A shop sells {a} pens on Monday and {b} pens on Tuesday. How many pens "
                 "does it sell in total?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a, b in ((3, 9), (12, 30), (7, 7), (101, 99), (15, 4))
] + [
    {"question": "What is the answer?", "answer": "No number.\n#### [invalid]"},
    {"question": "Ben has 4 bags with 6 marbles each. How many marbles?",
     "answer": "4 * 6 = 24\n#### [invalid]"},
    {"question": "A train travels 60 miles in an hour. How far in 3 hours?",
     "answer": "60 * 3 = 180\n#### 180"},
    {"question": "If x + 2 = 5, what is x?", "answer": "x = 3\n#### [invalid]"},
    {"question": "Long story: " + " ".join(f"On day {i} the farmer planted {i} trees." for i in
                                           range(1, 31)) + " How many trees in all?",
     "answer": "465\n#### 465"},  # longer than max_length - max_gen_toks: cut on the left
]
GSM_YAML = """output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
num_fewshot: 2
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>", "\\n\\n", UNTIL]
  do_sample: false
  temperature: 0.0
  max_gen_toks: MAX_GEN_TOKS
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"
      - function: take_first
"""


def write_gsm_task(folder, name: str = "tiny_gsm", until: str = "ing",
                   max_gen_toks: int = 16) -> str:
    """A gsm8k-style generate_until task (`GSM_YAML`: 2-shot, gsm8k's stops plus `until`, its
    strict and flexible filters, exact_match) over local train/test JSONL files; its name."""
    os.makedirs(folder, exist_ok=True)
    files = {}
    for split, docs in (("train", GSM_TRAIN), ("test", GSM_TEST)):
        files[split] = os.path.join(folder, f"{name}_{split}.jsonl")
        with open(files[split], "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    body = GSM_YAML.replace("UNTIL", json.dumps(until)).replace("MAX_GEN_TOKS", str(max_gen_toks))
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    train: {files['train']}\n    test: {files['test']}\n{body}")
    return name


def write_gsm8k(folder, name: str = "gsm8k_local", test_docs: int = 4) -> str:
    """lm-eval's own `gsm8k` task (its YAML included as it ships: 5-shot, its stops, filters
    and metric) with the dataset swapped for local JSONL files (`GSM_TRAIN`, the first
    `test_docs` of `GSM_TEST`); its name."""
    import lm_eval.tasks

    os.makedirs(folder, exist_ok=True)
    files = {}
    for split, docs in (("train", GSM_TRAIN), ("test", GSM_TEST[:test_docs])):
        files[split] = os.path.join(folder, f"{name}_{split}.jsonl")
        with open(files[split], "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    gsm8k = os.path.join(os.path.dirname(lm_eval.tasks.__file__), "gsm8k", "gsm8k.yaml")
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(f"include: {gsm8k}\ntask: {name}\ntag: []\ndataset_path: json\n"
                f"dataset_name: null\ndataset_kwargs:\n  data_files:\n"
                f"    train: {files['train']}\n    test: {files['test']}\n")
    return name
