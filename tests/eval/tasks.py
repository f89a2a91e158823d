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
