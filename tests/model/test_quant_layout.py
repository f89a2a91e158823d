"""The native DSv4 checkpoint layout, written here from the reference (not from the code under test).

`native_tensors(cfg)` lists every tensor of a native checkpoint (name -> safetensors dtype, shape)
as transformers-dsv4.md section 5 describes it: FP8 e4m3 linears with ue8m0 128x128 scales, FP4
(I8-packed) routed experts with ue8m0 per-32 scales, BF16 embed/head/norms/compressors/router,
F32 hc_*/attn_sink/ape/gate.bias, I64 tid2eid, and the `mtp.0` block. The test below checks it
against the real V4-Flash checkpoint's published tensor counts. Other tests write it as a
header-only (sparse) file (`write_header_only`) or with quantized random values (`write_native`).
"""

import json
import math
import os
import struct

import torch

BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}
COMMON = dict(num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, sliding_window=128, index_n_heads=64,
              index_head_dim=128, rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=1048576,
              rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1},
              vocab_size=129280, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, num_experts_per_tok=6,
              n_shared_experts=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
              swiglu_limit=10.0, num_hash_layers=3, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
              expert_dtype="fp4", quantization_config=QUANT_CONFIG, torch_dtype="bfloat16",
              architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4")
# dsv4-attention.md's config table
FLASH = dict(COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
             o_lora_rank=1024, o_groups=8, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], index_topk=512,
             n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5)
PRO = dict(COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
           o_lora_rank=1024, o_groups=16, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0], index_topk=1024,
           n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5)


def fp8(name, out, inp):
    return {name + ".weight": ("F8_E4M3", (out, inp)),
            name + ".scale": ("F8_E8M0", (math.ceil(out / 128), math.ceil(inp / 128)))}


def fp4(name, out, inp):
    return {name + ".weight": ("I8", (out, inp // 2)), name + ".scale": ("F8_E8M0", (out, inp // 32))}


def block(cfg, p, ratio, hash_layer):
    """One decoder layer's tensors under prefix `p` (ratio 0 sliding, 4 CSA, 128 HCA)."""
    H, hc, D, heads = cfg["hidden_size"], cfg["hc_mult"], cfg["head_dim"], cfg["num_attention_heads"]
    G, ol, ql, I, E = cfg["o_groups"], cfg["o_lora_rank"], cfg["q_lora_rank"], cfg["moe_intermediate_size"], \
        cfg["n_routed_experts"]
    t = {}
    for site in ("attn", "ffn"):
        t.update({f"{p}hc_{site}_fn": ("F32", ((2 + hc) * hc, hc * H)), f"{p}hc_{site}_base": ("F32", ((2 + hc) * hc,)),
                  f"{p}hc_{site}_scale": ("F32", (3,)), f"{p}{site}_norm.weight": ("BF16", (H,))})
    a = p + "attn."
    t.update({a + "attn_sink": ("F32", (heads,)), a + "q_norm.weight": ("BF16", (ql,)), a + "norm.weight": ("BF16", (D,))})
    t.update({**fp8(a + "wq_a", ql, H), **fp8(a + "wq_b", heads * D, ql), **fp8(a + "wkv", D, H),
              **fp8(a + "wo_a", G * ol, heads * D // G), **fp8(a + "wo_b", H, G * ol)})
    compressors = {4: [(a + "compressor.", D, 2), (a + "indexer.compressor.", cfg["index_head_dim"], 2)],
                   128: [(a + "compressor.", D, 1)]}.get(ratio, [])
    for c, dim, coff in compressors:
        t.update({c + "ape": ("F32", (ratio, coff * dim)), c + "wkv.weight": ("BF16", (coff * dim, H)),
                  c + "wgate.weight": ("BF16", (coff * dim, H)), c + "norm.weight": ("BF16", (dim,))})
    if ratio == 4:
        t.update(fp8(a + "indexer.wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], ql))
        t[a + "indexer.weights_proj.weight"] = ("BF16", (cfg["index_n_heads"], H))
    f = p + "ffn."
    t[f + "gate.weight"] = ("BF16", (E, H))
    if hash_layer:
        t[f + "gate.tid2eid"] = ("I64", (cfg["vocab_size"], cfg["num_experts_per_tok"]))
    else:
        t[f + "gate.bias"] = ("F32", (E,))
    for e in range(E):
        t.update({**fp4(f"{f}experts.{e}.w1", I, H), **fp4(f"{f}experts.{e}.w3", I, H), **fp4(f"{f}experts.{e}.w2", H, I)})
    t.update({**fp8(f + "shared_experts.w1", I, H), **fp8(f + "shared_experts.w3", I, H),
              **fp8(f + "shared_experts.w2", H, I)})
    return t


def native_tensors(cfg, mtp=True):
    """name -> (safetensors dtype, shape) of every tensor of a native checkpoint of `cfg`."""
    H, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    t = {"embed.weight": ("BF16", (V, H)), "head.weight": ("BF16", (V, H)), "norm.weight": ("BF16", (H,)),
         "hc_head_fn": ("F32", (hc, hc * H)), "hc_head_base": ("F32", (hc,)), "hc_head_scale": ("F32", (1,))}
    ratios = cfg["compress_ratios"]
    for i in range(cfg["num_hidden_layers"]):
        t.update(block(cfg, f"layers.{i}.", ratios[i], i < cfg["num_hash_layers"]))
    if mtp:  # one MTP stage: projections, norms, its own hc head and a sliding-window block
        t.update({**fp8("mtp.0.e_proj", H, H), **fp8("mtp.0.h_proj", H, H), "mtp.0.enorm.weight": ("BF16", (H,)),
                  "mtp.0.hnorm.weight": ("BF16", (H,)), "mtp.0.norm.weight": ("BF16", (H,)),
                  "mtp.0.hc_head_fn": ("F32", (hc, hc * H)), "mtp.0.hc_head_base": ("F32", (hc,)),
                  "mtp.0.hc_head_scale": ("F32", (1,))})
        t.update(block(cfg, "mtp.0.", 0, False))
    return t


def quantize_fp8(w):
    """Independent block quantizer: returns fp8 weight, ue8m0 scale and the exact dequantized value."""
    out, inp = w.shape
    scale = torch.empty((out + 127) // 128, (inp + 127) // 128)
    q = torch.empty_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = 2.0 ** torch.ceil(torch.log2(block.abs().max() / 448))
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block / s
    q8 = q.to(torch.float8_e4m3fn)
    deq = q8.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            deq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    return q8, scale.to(torch.float8_e8m0fnu), deq


def quantize_fp4(w):
    """e2m1 codes packed two per int8 (low nibble = even column), one ue8m0 scale per 32 columns."""
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    out, inp = w.shape
    scale = 2.0 ** torch.ceil(torch.log2(w.abs().view(out, inp // 32, 32).amax(-1) / 6))
    x = w / scale.repeat_interleave(32, dim=1)
    k = (x.abs().unsqueeze(-1) - torch.tensor(lut)).abs().argmin(-1)      # nearest magnitude
    codes = (k | ((x < 0).long() << 3)).to(torch.uint8)
    deq = torch.where(x < 0, -1.0, 1.0) * torch.tensor(lut)[k] * scale.repeat_interleave(32, dim=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), deq


def random_state(cfg, seed=0, mtp=False, fp4_codes=False):
    """Values for `native_tensors(cfg)`: weights ~ N(0, 1/fan_in) quantized by the independent
    quantizers above (FP8 blocks, FP4 experts), norms ~ 1, the rest small; tid2eid distinct experts.
    `fp4_codes`: FP4 experts get uniformly random codes and ue8m0 scales 2**-4..2**-2 instead (a
    valid FP4 tensor without the cost of quantizing one; for tests of memory, not of values)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, state = native_tensors(cfg, mtp=mtp), {}
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        if name.endswith(".scale"):
            continue
        if dtype == "I8" and fp4_codes:
            state[name] = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
            scale_shape = tensors[name[: -len(".weight")] + ".scale"][1]
            state[name[: -len(".weight")] + ".scale"] = torch.exp2(
                torch.randint(-4, -1, scale_shape, generator=gen).float()).to(torch.float8_e8m0fnu)
        elif dtype in ("F8_E4M3", "I8"):
            shape = (shape[0], shape[1] * (2 if dtype == "I8" else 1))
            q, scale, _ = (quantize_fp8 if dtype == "F8_E4M3" else quantize_fp4)(
                torch.randn(shape, generator=gen) / shape[1] ** 0.5)
            state[name], state[name[: -len(".weight")] + ".scale"] = q, scale
        elif dtype == "I64":
            state[name] = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(shape[0])])
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            state[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).to(getattr(torch, BF_OR_F32[dtype]))
        elif len(shape) == 2:
            state[name] = (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(getattr(torch, BF_OR_F32[dtype]))
        else:
            state[name] = (0.3 * torch.randn(shape, generator=gen)).to(getattr(torch, BF_OR_F32[dtype]))
    return state


BF_OR_F32 = {"BF16": "bfloat16", "F32": "float32"}


def write_native(path, cfg, seed=0, fp4_codes=False):
    """A native checkpoint folder of `cfg` with `random_state` values (one safetensors file)."""
    from safetensors.torch import save_file

    write_config(path, cfg)
    save_file(random_state(cfg, seed, fp4_codes=fp4_codes), os.path.join(path, "model.safetensors"))


def nbytes(dtype, shape):
    return BYTES[dtype] * math.prod(shape)


def write_config(path, cfg):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)


def header_bytes(tensors) -> bytes:
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes(dtype, shape)]}
        offset += nbytes(dtype, shape)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_header_only(path, cfg, tensors=None):
    """A checkpoint folder whose single safetensors file has the full header and a sparse (unwritten,
    zero-filled) data section: a valid file of the real size that takes no disk and no memory."""
    write_config(path, cfg)
    head, data = header_bytes(native_tensors(cfg) if tensors is None else tensors)
    with open(os.path.join(path, "model.safetensors"), "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data)


def test_flash_layout_matches_the_published_checkpoint():
    """V4-Flash: 69,187 tensors (BF16 433, F32 417, F8_E4M3 375, F8_E8M0 34,167, I8 33,792, I64 3), ~159.6 GB."""
    tensors = native_tensors(FLASH)
    counts = {}
    for dtype, _ in tensors.values():
        counts[dtype] = counts.get(dtype, 0) + 1
    assert counts == {"BF16": 433, "F32": 417, "F8_E4M3": 375, "F8_E8M0": 34167, "I8": 33792, "I64": 3}
    total = sum(nbytes(d, s) for d, s in tensors.values())
    assert abs(total / 1e9 - 159.6) < 0.5, total


def test_header_only_file_reads_like_a_checkpoint(tmp_path):
    from safetensors import safe_open

    cfg = dict(FLASH, num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], n_routed_experts=8)
    write_header_only(str(tmp_path), cfg)
    file = os.path.join(str(tmp_path), "model.safetensors")
    with safe_open(file, framework="pt") as fh:
        assert fh.get_slice("layers.1.ffn.experts.7.w2.weight").get_shape() == [4096, 1024]
        assert fh.get_tensor("layers.0.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
    assert os.stat(file).st_blocks * 512 < 2**20  # sparse: no data written
