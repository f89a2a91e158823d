"""lm-evaluation-harness backend: the model "dsv4batch" (`DSv4LM`), lm-eval 0.4.13.

Importing this module imports lm-eval (the `eval` extra) and registers the model with
`lm_eval.api.registry.register_model`; `import dsv4batch` alone imports neither lm-eval nor
torch. `dsv4batch eval` (`dsv4batch.jobs.eval`) imports it, then runs `lm_eval.simple_evaluate`:

    import dsv4batch.eval, lm_eval
    lm_eval.simple_evaluate(model="dsv4batch", model_args="pretrained=/models/dsv4", tasks=[...])

Parts: `tokens` (tokenization as lm-eval's `hf` backend has it), `generation` (generate_until
requests as engine requests, the vllm backend's semantics), `scorer` (requests -> scores or
generations, in-process or on Ray Data), `lm` (the `TemplateLM`).
"""

from dsv4batch.eval.lm import DSv4LM

__all__ = ["DSv4LM"]
