"""`capacity.plan_capacity` on the real V4-Flash and V4-Pro shapes, against hand arithmetic.

The checkpoints are header-only (sparse) files of the native layout (`test_quant_layout`), so the
plan reads 160 GB / 865 GB "checkpoints" without a byte of weights. Expected bytes below are
written from the config dimensions alone: FP8 = 1 byte + one ue8m0 byte per 128x128 block, FP4 =
1/2 byte + one ue8m0 byte per 32 columns, BF16 weights in the bf16 compute dtype, and the fp32
tensors the model keeps fp32 (norms, hc_*, attn_sink, ape, router bias) at 4 bytes.
"""

import math

import pytest

from dsv4batch.model.capacity import GIB, model_tensor_bytes, plan_capacity, replica_fits
from tests.model.test_quant_layout import FLASH, PRO, write_header_only

L, MNBT = 8192, 2048  # the score defaults


def fp8(out, inp):
    return out * inp + math.ceil(out / 128) * math.ceil(inp / 128)


def hand(c):
    """Per split group and replicated: resident bytes of `c` held as stored in bf16."""
    H, V, hc, D, heads, ql = c["hidden_size"], c["vocab_size"], c["hc_mult"], c["head_dim"], \
        c["num_attention_heads"], c["q_lora_rank"]
    G, ol, I, E, ih, Ih = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"], c["n_routed_experts"], \
        c["index_n_heads"], c["index_head_dim"]
    ratios = c["compress_ratios"][: c["num_hidden_layers"]]
    n, n4, n128 = len(ratios), ratios.count(4), ratios.count(128)
    hashed = c["num_hash_layers"]
    split = {
        "vocab": 2 * V * H * 2,
        "heads": n * (fp8(heads * D, ql) + heads * 4),
        "groups": n * fp8(G * ol, heads * D // G),
        "row_parallel": n * fp8(H, G * ol),
        "experts": n * E * 3 * (I * H // 2 + I * H // 32),
        "shared_expert": n * 3 * fp8(I, H),
    }
    mix = (2 + hc) * hc
    per_layer = (2 * (mix * hc * H + mix + 3) * 4 + 2 * H * 4 + ql * 4 + D * 4 + fp8(ql, H) + fp8(D, H) + E * H * 2)
    csa = (4 * 2 * D * 4 + 2 * 2 * D * H * 2 + D * 4) + (4 * 2 * Ih * 4 + 2 * 2 * Ih * H * 2 + Ih * 4) \
        + fp8(ih * Ih, ql) + ih * H * 2
    hca = 128 * D * 4 + 2 * D * H * 2 + D * 4
    router = hashed * V * c["num_experts_per_tok"] * 8 + (n - hashed) * E * 4
    replicated = n * per_layer + n4 * csa + n128 * hca + router + H * 4 + (hc * hc * H + hc + 1) * 4
    return split, replicated


@pytest.fixture(scope="module", params=["flash", "pro"])
def shaped(request, tmp_path_factory):
    cfg = {"flash": FLASH, "pro": PRO}[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    write_header_only(path, cfg)
    return request.param, cfg, path, model_tensor_bytes(path)


def test_plan_matches_hand_arithmetic(shaped):
    name, cfg, _, (config, sizes, stored) = shaped
    plan = plan_capacity(config, sizes, gpu_memory_bytes=141 * GIB, max_model_len=L, max_batched_tokens=MNBT)
    split, replicated = hand(cfg)
    assert plan["weights"]["split"] == split
    assert plan["weights"]["replicated"] == replicated
    # ~1.00x the checkpoint: quantized tensors as stored, only the BF16 norms widened to fp32
    total, on_file = plan["weights"]["total"], stored["checkpoint_bytes"] - stored["ignored_bytes"]
    assert on_file < total < 1.001 * on_file
    # the pool is the CSA layers' reservation: 4 * (ceil(L/4) + W + mnbt) rows of 512 bf16
    assert plan["workspace"]["reserved"] == 4 * (L // 4 + 128 + MNBT) * 512 * 2
    for rank in plan["ranks"]:
        t = rank["tp"]
        assert rank["weight_bytes"] == replicated + math.ceil(sum(split.values()) / t)
        assert rank["total_bytes"] == rank["weight_bytes"] + rank["workspace_bytes"] + rank["activation_bytes"]
        assert rank["fits"] == (rank["total_bytes"] <= 0.9 * 141 * GIB)
    assert plan["smallest_tp"] == {"flash": 2, "pro": 8}[name]


def test_smaller_gpus_and_no_fit(shaped):
    name, _, _, (config, sizes, _) = shaped
    kw = dict(max_model_len=L, max_batched_tokens=MNBT)
    assert plan_capacity(config, sizes, gpu_memory_bytes=80 * GIB, **kw)["smallest_tp"] == \
        {"flash": 4, "pro": None}[name]
    plan = plan_capacity(config, sizes, gpu_memory_bytes=16 * GIB, **kw)
    assert plan["smallest_tp"] is None and "tp 8: a rank needs" in plan["reason"]
    # a 1M-token context: the indexer scores one query slice against L/4 entries in fp32
    long = plan_capacity(config, sizes, gpu_memory_bytes=141 * GIB, max_model_len=2**20, max_batched_tokens=8192)
    assert long["ranks"][-1]["activations"]["indexer"] == (1024 * 64 * 2**18 + 8192 * 64 * 128) * 4


# the message logic on one shape: each call reads the checkpoint's header, and V4-Pro's (~430k
# tensors) costs ~10 s a read; its numbers are checked by the two tests above
@pytest.mark.parametrize("shaped", ["flash"], indirect=True)
def test_replica_fits_names_the_numbers(shaped):
    name, _, path, _ = shaped
    ok, why = replica_fits(path, 8, 141 * GIB, L, MNBT)
    assert ok and why.startswith("tp 8: a rank needs")
    ok, why = replica_fits(path, 1, 141 * GIB, L, MNBT)
    assert not ok and "> 126.9 GiB usable" in why
    assert why.endswith("the smallest tp that fits is 2")


def test_unsplittable_sizes_and_tiny():
    config, sizes, stored = model_tensor_bytes("tiny", "float32")
    assert stored == {"checkpoint_bytes": 0, "ignored_bytes": 0}
    plan = plan_capacity(config, sizes, gpu_memory_bytes=GIB, max_model_len=L, max_batched_tokens=MNBT,
                         dtype="float32")
    problems = {r["tp"]: r["problems"] for r in plan["ranks"]}
    assert problems[1] == problems[2] == [] and plan["smallest_tp"] == 1
    assert problems[4] == ["o_groups 2 is not divisible by tp 4"]
    assert problems[8][0] == "num_attention_heads 4 is not divisible by tp 8"
    # tiny in fp32: 129,280 x 128 embed and head dominate its weights
    assert plan["weights"]["split"]["vocab"] == 2 * 129280 * 128 * 4


# One step of 1024 tokens (one request) on a small native model in fp32 on the CPU, measured in
# a fresh process after a warm-up step (VmHWM reset just before; fixed mmap threshold: see
# test_quant_memory). The plan's activations + workspace must bound it.
STEP_PROBE = """
import gc, json, sys, numpy as np
from dsv4batch.model import Engine, EngineConfig

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

engine = Engine.from_pretrained(sys.argv[1], config=EngineConfig(max_num_batched_tokens=1024, max_model_len=4096))
batch = [[0] + np.random.default_rng(0).integers(3, 4096, size=1024).tolist()]
engine.score_tokens(batch)
gc.collect()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
engine.score_tokens(batch)
print(json.dumps({"step": status("VmHWM") - before}))
"""


def test_activation_estimate_bounds_a_measured_step(tmp_path, run_python):
    import json
    import os

    from tests.model.test_quant import SMALL
    from tests.model.test_quant_layout import write_native

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    write_native(str(tmp_path), dict(SMALL, vocab_size=4096, index_topk=64), seed=1, fp4_codes=True)
    out = run_python(STEP_PROBE, tmp_path, cwd=root,
                     env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    step = json.loads(out.stdout.strip().splitlines()[-1])["step"]
    config, sizes, _ = model_tensor_bytes(str(tmp_path), "float32")
    rank = plan_capacity(config, sizes, gpu_memory_bytes=GIB, max_model_len=4096, max_batched_tokens=1024,
                         dtype="float32", tp=1)["ranks"][0]
    planned = rank["activation_bytes"] + rank["workspace_bytes"]
    assert 0.5 * planned < step <= planned, (step, rank)
